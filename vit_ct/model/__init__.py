"""The model, its training and the weights it starts from.

The LightningModule (:mod:`~vit_ct.model.classifier`), the network it trains
(:mod:`~vit_ct.model.network`, timm's ViT with air patches skipping the blocks; :mod:`~vit_ct.model.stem`, the conv
stem), its losses, optimiser groups and schedule, and the weights it can start from (:mod:`~vit_ct.model.weights`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vit_ct.model.classifier import ViTClassifier

__all__ = ["ViTClassifier"]


def __getattr__(name: str):
    """``ViTClassifier`` on first use (PEP 562): ``python -m vit_ct.model.shipped list`` needs no Lightning or timm."""
    if name == "ViTClassifier":
        from vit_ct.model.classifier import ViTClassifier

        return ViTClassifier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
