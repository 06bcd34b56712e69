"""A checkpoint opened with its data, for reading rather than training: where the model and slices come from (the
project folder, the checkpoint, its run's config, a data module that prepares slices as the model was trained:
:mod:`~vit_ct.inspection.loading`) and the model-randomisation check of its maps (:mod:`~vit_ct.inspection.map_check`).
The review and the report both stand on it; neither imports the other."""
