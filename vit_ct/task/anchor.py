"""The anchor of fine-tuning (``anchor_loss_weight``): a frozen copy of the start network, whose rollout the model's
is held to by the anchor loss (:class:`vit_ct.task.losses.PatchLosses`), so that fine-tuning keeps the maps the start
weights could already show."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from vit_ct.explain.attention import record_attention


class StartAnchor:
    """The start network, frozen (``network`` None: nothing to hold to). A plain object, not a module: a model that
    holds one keeps it out of its module tree (neither trained, nor in the checkpoint, nor seen by DDP), and hands it
    its moves and casts (:meth:`apply`)."""

    def __init__(self, network: nn.Module | None = None) -> None:
        self.network = None if network is None else copy.deepcopy(network).eval().requires_grad_(False)

    def __bool__(self) -> bool:
        return self.network is not None

    def attention(self, image: torch.Tensor) -> list[torch.Tensor] | None:
        """The start network's head-averaged attention per block on ``image``, without gradients; None without a
        network."""
        if self.network is None:
            return None
        with torch.no_grad(), record_attention(self.network, head_fusion="mean") as held:
            self.network.forward_features(image)
        return held

    def check(self, weight: float) -> None:
        """Refuse a fit whose anchor loss has no start weights to hold to."""
        if weight > 0 and self.network is None:
            raise ValueError("model.losses.anchor_loss_weight > 0 holds the rollout to the start weights' rollout:"
                             " give --model.pretrained or --model.weights (or set it to 0)")  # fmt: skip

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """A move or cast of the model (``Module._apply``'s ``fn``), applied to the network too."""
        if self.network is not None:
            self.network._apply(fn)
