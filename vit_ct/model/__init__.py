"""The model: the LightningModule (:mod:`~vit_ct.model.classifier`), the network it trains
(:mod:`~vit_ct.model.network`, timm's ViT with air patches skipping the blocks; :mod:`~vit_ct.model.stem`, the conv
stem), its losses, optimiser groups and schedule, and the weights it can start from (:mod:`~vit_ct.model.weights`)."""

from vit_ct.model.classifier import ViTClassifier

__all__ = ["ViTClassifier"]
