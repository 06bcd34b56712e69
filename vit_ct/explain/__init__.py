"""Where the model looked, maps and hooks only: attention recording, rollout math (arXiv:2005.00928), the maps of a
batch with their floors and ceiling, occlusion, overlays, a map read as a segmentation. What the maps score is measured
in :mod:`vit_ct.metrics`. Knows no LightningModule (a model is an :class:`~vit_ct.explain.maps.Explainer`) and of
:mod:`vit_ct.data` only the HU windows."""
