"""The losses of :class:`vit_ct.task.classifier.ViTClassifier`, as pure functions of tensors: the slice
classification loss, the patch loss from lesion masks, the multiple-instance loss from slice labels, and the attention
loss that trains the rollout (arXiv:2005.00928) onto the lesion (its mask, or where no mask exists the model's own
patch evidence), and the anchor loss that holds the rollout to the start weights' while fine-tuning. Each returns None
where the batch holds nothing it could score.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from vit_ct.data.manifests.labels import lesion_label
from vit_ct.explain.rollout import class_token_rollout
from vit_ct.model.network import attention_keys

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
    per label (``multilabel``: ``class_weights`` are per-label positive weights), in float32, over the known labels
    (-1: unknown, e.g. a slice of a scan labelled with a lesion); None when none is known."""
    logits = logits.float()
    known = label >= 0
    if not known.any():
        return None
    if task == "multilabel":
        if known.all():
            return F.binary_cross_entropy_with_logits(logits, label.float(), pos_weight=class_weights)
        losses = F.binary_cross_entropy_with_logits(logits, label.float(), pos_weight=class_weights, reduction="none")
        return losses[known].mean()
    return F.cross_entropy(logits[known], label[known], weight=class_weights, label_smoothing=label_smoothing)


def patch_loss(
    patch_logits: torch.Tensor, mask: torch.Tensor, has_mask: torch.Tensor, label: torch.Tensor, patch_size: int
) -> torch.Tensor | None:
    """BCE of each patch's logit against "this patch holds lesion pixels", on the slices whose mask is known (a mask
    given, or a lesion-free slice, whose mask is empty by definition); lesion and lesion-free patches weigh equally.

    Args:
        patch_logits: ``(B, N)``, one per patch token.
        mask: ``(B, 1, S, S)`` lesion masks, 0/1.
        has_mask: ``(B,)`` bool, a mask was given.
        label: the batch's labels (a lesion-free slice, :func:`vit_ct.data.manifests.labels.lesion_label` 0, has
            an empty mask).
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


def lesion_share(mask: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``(B, N)``: the lesion's share of each patch, summing to 1 per slice (all 0 where the mask is empty)."""
    share = F.avg_pool2d(mask.float(), patch_size).flatten(1)
    return share / share.sum(dim=1, keepdim=True).clamp_min(1e-12)


def evidence_share(patch_logits: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
    """``(B, N)``: the patch head's own evidence as a share of the slice, the softmax of its logits over the patches
    that hold something (``patches``, bool; 0 elsewhere), detached: where the model itself says the lesion is, the
    attention target of a positive slice without a mask."""
    logits = patch_logits.detach().float().masked_fill(~patches, float("-inf"))
    return logits.softmax(dim=1).nan_to_num(0.0)  # a slice of nothing but air: all 0


def mil_logit(patch_logits: torch.Tensor, patches: torch.Tensor, sharpness: float) -> torch.Tensor:
    """``(B,)``: the slice's logit pooled from its patches' (multiple-instance learning): the log-sum-exp mean
    ``log(mean(exp(r z))) / r`` over the patches that hold something, between their mean (``r`` -> 0) and their
    maximum (``r`` -> inf), so that a slice is positive when a few of its patches are, and every patch gets a share
    of the gradient (Pinheiro & Collobert 2015)."""
    z = patch_logits.float() * sharpness
    count = patches.sum(dim=1).clamp_min(1)
    return (torch.logsumexp(z.masked_fill(~patches, float("-inf")), dim=1) - count.log()) / sharpness


def mil_loss(
    patch_logits: torch.Tensor, patches: torch.Tensor, label: torch.Tensor, sharpness: float
) -> torch.Tensor | None:
    """BCE of the pooled patch evidence (:func:`mil_logit`) against the slice's lesion label, on labelled slices
    with something in them: the patch head learns from slice labels alone, without masks."""
    lesion = lesion_label(label)
    known = (lesion >= 0) & patches.any(dim=1)
    if not known.any():
        return None
    pooled = mil_logit(patch_logits[known], patches[known], sharpness)
    return F.binary_cross_entropy_with_logits(pooled, lesion[known].float())


def rollout_share(
    attentions: list[torch.Tensor], *, num_prefix_tokens: int, grid_size: tuple[int, int]
) -> torch.Tensor:
    """``(B, N)``: the class token's attention rollout over the patches as a share of the slice (summing to 1), from
    one ``(B, 1, T, T)`` head-fused attention per block."""
    rollout = class_token_rollout(attentions, num_prefix_tokens=num_prefix_tokens, grid_size=grid_size).flatten(1)
    return rollout / rollout.sum(dim=1, keepdim=True).clamp_min(1e-12)


def attention_loss(
    attentions: list[torch.Tensor],
    share: torch.Tensor,
    scored: torch.Tensor,
    *,
    num_prefix_tokens: int,
    grid_size: tuple[int, int],
    target: Literal["rollout", "class_token"] = "rollout",
) -> torch.Tensor | None:
    """Cross-entropy of a target share of each patch (the lesion's, :func:`lesion_share`, or the patch evidence's,
    :func:`evidence_share`) against where the class token's attention goes: its attention rollout over the patches
    (``target="rollout"``, renormalised over the patches) or its attention row in every block (``"class_token"``,
    averaged over blocks); over the ``scored`` slices.

    Args:
        attentions: one ``(B, 1, T, T)`` head-averaged attention per block, rows summing to 1, in the graph.
        share: ``(B, N)`` target shares, summing to 1 on the scored slices.
        scored: ``(B,)`` bool, the slices the loss reads.
        num_prefix_tokens: class and register tokens; grid_size: the patch grid.
        target: what the loss reads.
    """
    if not scored.any():
        return None
    share = share[scored]
    attentions = [attention[scored].float() for attention in attentions]

    def cross_entropy(attended: torch.Tensor) -> torch.Tensor:
        return -(share * attended.clamp_min(1e-6).log()).sum(dim=1).mean()

    if target == "rollout":
        return cross_entropy(rollout_share(attentions, num_prefix_tokens=num_prefix_tokens, grid_size=grid_size))
    return torch.stack([cross_entropy(a[:, 0, 0, num_prefix_tokens:]) for a in attentions]).mean()


@dataclass(frozen=True)
class PatchLosses:
    """The losses that read the patch tokens and the attention, weighted, for one batch: the patch loss (masks), the
    multiple-instance loss (labels), the attention loss (masks, and with ``evidence_attention`` the patch evidence
    on positive slices without one) and the anchor loss (the start network's rollout, on every slice with something
    in it). A weight of 0 leaves a loss out.

    Attributes:
        patch_size: side of a patch in pixels; num_prefix_tokens: class and register tokens; grid_size: the grid.
    """

    patch_size: int
    num_prefix_tokens: int
    grid_size: tuple[int, int]
    patch_weight: float = 0.0
    mil_weight: float = 0.0
    mil_sharpness: float = 5.0
    attention_weight: float = 0.0
    attention_target: Literal["rollout", "class_token"] = "rollout"
    evidence_attention: bool = False
    anchor_weight: float = 0.0

    def __call__(
        self,
        batch: dict,
        patch_logits: torch.Tensor | None,
        attentions: list[torch.Tensor] | None,
        anchor: list[torch.Tensor] | None = None,
    ) -> list[tuple[str, float, torch.Tensor | None]]:
        """``(name, weight, loss or None)`` per loss in use, for a batch (``image``, ``label``, ``mask``,
        ``has_mask``), its patch logits ``(B, N)``, its recorded attention (None when not recorded) and the start
        network's on the same batch (``anchor``: None when there is none to hold to)."""
        label, mask, has_mask, prefix = batch["label"], batch["mask"], batch["has_mask"], self.num_prefix_tokens
        # the patches that hold something (not only air): the ones pooled and attended to
        patches = attention_keys(batch["image"], self.patch_size, prefix)[:, 0, 0, prefix:]  # (B, N)
        terms = []
        if self.patch_weight > 0:
            part = patch_loss(patch_logits, mask, has_mask, label, self.patch_size)
            terms.append(("patch_loss", self.patch_weight, part))
        if self.mil_weight > 0:
            terms.append(("mil_loss", self.mil_weight, mil_loss(patch_logits, patches, label, self.mil_sharpness)))
        if attentions and self.attention_weight > 0:
            share, scored = lesion_share(mask, self.patch_size), has_mask & mask.flatten(1).any(dim=1)
            if self.evidence_attention:
                evidence = (lesion_label(label) == 1) & ~has_mask
                share = torch.where(evidence[:, None], evidence_share(patch_logits, patches), share)
                scored = scored | (evidence & patches.any(dim=1))
            part = attention_loss(attentions, share, scored, num_prefix_tokens=self.num_prefix_tokens,
                                  grid_size=self.grid_size, target=self.attention_target)  # fmt: skip
            terms.append(("attention_loss", self.attention_weight, part))
        if attentions and anchor is not None:
            held = rollout_share([a.float() for a in anchor], num_prefix_tokens=prefix, grid_size=self.grid_size)
            scored = patches.any(dim=1)
            part = attention_loss(attentions, held, scored, num_prefix_tokens=prefix, grid_size=self.grid_size)
            if part is not None:  # as the KL divergence from the start's rollout: 0 where the two are the same
                part = part + (held[scored] * held[scored].clamp_min(1e-6).log()).sum(dim=1).mean()
            terms.append(("anchor_loss", self.anchor_weight, part))
        return terms
