"""The anchor of fine-tuning (``anchor_loss_weight``): a frozen copy of the start network, whose rollout the model's
is held to by the anchor loss (:class:`vit_ct.task.losses.PatchLosses`), so that fine-tuning keeps the maps the start
weights could already show."""

from __future__ import annotations

import copy

import torch
from torch import nn

from vit_ct.explain.attention import record_attention


class StartAnchor(nn.Module):
    """Mixin of the model: ``_anchor``, the start network frozen (None: nothing to hold to), kept out of the module
    tree (neither trained, nor in the checkpoint, nor seen by DDP) but moved and cast with the model."""

    _anchor: nn.Module | None = None

    def hold_to_start(self, network: nn.Module | None) -> None:
        """Freeze a copy of ``network`` (the start weights, just loaded) as the anchor; None: no anchor."""
        anchor = None if network is None else copy.deepcopy(network).eval().requires_grad_(False)
        object.__setattr__(self, "_anchor", anchor)  # not a submodule

    def anchor_attention(self, image: torch.Tensor) -> list[torch.Tensor] | None:
        """The start network's head-averaged attention per block on ``image``, without gradients; None without an
        anchor."""
        if self._anchor is None:
            return None
        with torch.no_grad(), record_attention(self._anchor, head_fusion="mean") as held:
            self._anchor.forward_features(image)
        return held

    def check_anchor(self, weight: float) -> None:
        """Refuse a fit whose anchor loss has no start weights to hold to."""
        if weight > 0 and self._anchor is None:
            raise ValueError("model.losses.anchor_loss_weight > 0 holds the rollout to the start weights' rollout: give"
                             " --model.pretrained or --model.weights (or set it to 0)")  # fmt: skip

    def _apply(self, fn, recurse: bool = True):
        """Moves and casts (``.to``, ``.double``, ...) reach the anchor too."""
        if self._anchor is not None:
            self._anchor._apply(fn, recurse)
        return super()._apply(fn, recurse)
