"""What is measured, as torchmetrics states synced across DDP ranks or as plain functions: slice classification
(:mod:`~vit_ct.metrics.classification`), the maps against the lesion (:mod:`~vit_ct.metrics.localisation`: pointing,
energy, pixel AUROC, Dice / IoU / HD95) and the attention sink (:mod:`~vit_ct.metrics.sink`), both per stage in
:mod:`~vit_ct.metrics.map_scores`, and scans (:mod:`~vit_ct.metrics.lesion_probability`: the one P(lesion) and the one
positive rule that training, predict and the review share). The maps themselves are made in :mod:`vit_ct.explain`."""
