"""What is measured, as torchmetrics states synced across DDP ranks or as plain functions: slice classification
(:mod:`~vit_ct.metrics.classification`), the maps (:mod:`~vit_ct.metrics.map_scores`), and scans
(:mod:`~vit_ct.metrics.lesion_probability`: the one P(lesion) and the one positive rule that training, predict and the
review share)."""
