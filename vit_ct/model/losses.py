"""The losses of :class:`vit_ct.model.classifier.ViTClassifier`, as pure functions of tensors: the slice
classification loss, the patch loss from lesion masks, and the attention loss that trains the rollout
(arXiv:2005.00928) onto the lesion. Each returns None where the batch holds nothing it could score.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from vit_ct.data.labels import lesion_label
from vit_ct.explain.rollout import class_token_rollout

Task = Literal["binary", "multiclass", "multilabel"]


class Losses(NamedTuple):
    """A batch's loss and its parts; ``logits`` in float32."""

    total: torch.Tensor
    logits: torch.Tensor
    parts: dict[str, torch.Tensor]


def classification_loss(
    logits: torch.Tensor,
    label: torch.Tensor,
    task: Task,
    *,
    class_weights: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy over classes (``binary``, ``multiclass``: ``class_weights`` per class) or binary cross-entropy
    per label (``multilabel``: ``class_weights`` are per-label positive weights), in float32."""
    logits = logits.float()
    if task == "multilabel":
        return F.binary_cross_entropy_with_logits(logits, label.float(), pos_weight=class_weights)
    return F.cross_entropy(logits, label, weight=class_weights, label_smoothing=label_smoothing)


def patch_loss(
    patch_logits: torch.Tensor, mask: torch.Tensor, has_mask: torch.Tensor, label: torch.Tensor, patch_size: int
) -> torch.Tensor | None:
    """BCE of each patch's logit against "this patch holds lesion pixels", on the slices whose mask is known (a mask
    given, or a lesion-free slice, whose mask is empty by definition); lesion and lesion-free patches weigh equally.

    Args:
        patch_logits: ``(B, N)``, one per patch token.
        mask: ``(B, 1, S, S)`` lesion masks, 0/1.
        has_mask: ``(B,)`` bool, a mask was given.
        label: the batch's labels (a lesion-free slice, :func:`vit_ct.data.labels.lesion_label` 0, has an empty mask).
        patch_size: side of a patch in pixels.
    """
    known = has_mask | (lesion_label(label) == 0)
    if not known.any():
        return None
    target = (F.max_pool2d(mask.float(), patch_size) > 0.5).flatten(1).float()  # (B, N)
    losses = F.binary_cross_entropy_with_logits(patch_logits.float()[known], target[known], reduction="none")
    # Lesion patches are ~1% of all: weigh both kinds equally, or "never blood" is the easy minimum.
    lesion = target[known] > 0.5
    if lesion.all() or not lesion.any():
        return losses.mean()
    return 0.5 * (losses[lesion].mean() + losses[~lesion].mean())


def attention_loss(
    attentions: list[torch.Tensor],
    mask: torch.Tensor,
    has_mask: torch.Tensor,
    *,
    patch_size: int,
    num_prefix_tokens: int,
    grid_size: tuple[int, int],
    target: Literal["rollout", "class_token"] = "rollout",
) -> torch.Tensor | None:
    """Cross-entropy of the lesion's share of each patch against where the class token's attention goes: its
    attention rollout over the patches (``target="rollout"``, renormalised over the patches) or its attention row in
    every block (``"class_token"``, averaged over blocks); over the slices whose lesion mask is known and not empty.

    Args:
        attentions: one ``(B, 1, T, T)`` head-averaged attention per block, rows summing to 1, in the graph.
        mask: ``(B, 1, S, S)`` lesion masks; has_mask: ``(B,)`` bool, a mask was given.
        patch_size: side of a patch in pixels; num_prefix_tokens: class and register tokens; grid_size: the patch
            grid.
        target: what the loss reads.
    """
    scored = has_mask & mask.flatten(1).any(dim=1)
    if not scored.any():
        return None
    share = F.avg_pool2d(mask[scored].float(), patch_size).flatten(1)  # (b, N)
    share = share / share.sum(dim=1, keepdim=True)
    attentions = [attention[scored].float() for attention in attentions]

    def cross_entropy(attended: torch.Tensor) -> torch.Tensor:
        return -(share * attended.clamp_min(1e-6).log()).sum(dim=1).mean()

    if target == "rollout":
        rollout = class_token_rollout(attentions, num_prefix_tokens=num_prefix_tokens, grid_size=grid_size).flatten(1)
        return cross_entropy(rollout / rollout.sum(dim=1, keepdim=True).clamp_min(1e-12))
    return torch.stack([cross_entropy(a[:, 0, 0, num_prefix_tokens:]) for a in attentions]).mean()
