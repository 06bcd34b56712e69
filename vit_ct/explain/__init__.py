"""Where the model looked: attention recording, rollout math (arXiv:2005.00928), explanation maps of a batch,
localisation scores and overlays. Knows no LightningModule and no CLI."""
