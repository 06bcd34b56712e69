"""The task: the LightningModule that trains the network and reads its maps.

``ViTClassifier`` (:mod:`~vit_ct.task.classifier`) wraps the network of :mod:`vit_ct.model` with its losses
(:mod:`~vit_ct.task.losses`, the scan bags of :mod:`~vit_ct.task.scan_bags`, the fine-tuning anchor of
:mod:`~vit_ct.task.anchor`), the optimiser's groups and schedule (:mod:`~vit_ct.task.optim`), the checkpoint hooks
that carry the input contract (:mod:`~vit_ct.task.checkpointed`), and how its maps are read
(:mod:`~vit_ct.task.reading`, :mod:`~vit_ct.task.inference`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vit_ct.task.classifier import ViTClassifier

__all__ = ["ViTClassifier"]


def __getattr__(name: str):
    """``ViTClassifier`` on first use (PEP 562)."""
    if name == "ViTClassifier":
        from vit_ct.task.classifier import ViTClassifier

        return ViTClassifier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
