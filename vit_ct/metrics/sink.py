"""Where does the explanation's mass go when it is not on the head? The attention sink, measured.

A ViT's class token can park attention on tokens that carry no evidence (air patches, the class token itself,
register tokens), and attention rollout then shows hot spots in the air. Measured on the patch grid where the model
lives (``rollout_air``: the rollout's share on patches without a single head pixel; the class token's attention on
prefix tokens and on air patches, block by block) and on the slice grid where a reader looks (the upsampled map's
mass outside the head, beside the floor a perfect patch-level map scores there: a 16 x 16 patch at the inner table
of the skull is partly bone and air, so even the lesion itself, pooled to patches and brought back, spills outside).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import Metric

from vit_ct.explain.maps import upsample


def air_patches(head: torch.Tensor, grid_size: tuple[int, int]) -> torch.Tensor:
    """Patches without a single head pixel.

    Args:
        head: ``(B, 1, S, S)`` or ``(B, S, S)`` head mask, 0/1 (``CTBatch["head"]``: HU above -300).
        grid_size: ``(grid_h, grid_w)`` patch grid; ``S`` a multiple of each side.

    Returns:
        ``(B, grid_h, grid_w)`` bool.
    """
    head = head if head.dim() == 4 else head[:, None]
    return F.adaptive_max_pool2d(head.float(), grid_size)[:, 0] < 0.5


def mass_share(maps: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Share of each map's mass on ``where``: ``(B, ...)`` non-negative maps and bool -> ``(B,)`` float64; 0 for a
    map that is zero everywhere (it puts nothing anywhere)."""
    maps = maps.double().clamp_min(0).flatten(1)
    total = maps.sum(dim=1)
    on = (maps * where.flatten(1)).sum(dim=1)
    return torch.where(total > 0, on / total.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(total))


def class_token_shares(
    class_attention: torch.Tensor, air: torch.Tensor, num_prefix_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The class token's attention on the prefix tokens (itself and any registers) and on air patches, per block.

    Args:
        class_attention: ``(B, blocks, T)`` the class token's attention row in each block, heads fused, rows summing
            to 1 (:class:`vit_ct.explain.maps.Explained`).
        air: ``(B, grid_h, grid_w)`` bool, :func:`air_patches`.
        num_prefix_tokens: class and register tokens in front of the patch tokens.

    Returns:
        ``prefix`` and ``air`` shares, each ``(B, blocks)`` float64.
    """
    rows = class_attention.double()
    prefix = rows[..., :num_prefix_tokens].sum(dim=-1)
    on_air = (rows[..., num_prefix_tokens:] * air.flatten(1)[:, None, :]).sum(dim=-1)
    return prefix, on_air


def patch_level_floor(mask: torch.Tensor, patch_size: int) -> torch.Tensor:
    """What a perfect patch-level map shows on the slice grid: the lesion mask pooled to patches (each patch weighted
    by its lesion pixels) and brought back the way rollout is, bilinearly.

    Args:
        mask: ``(B, S, S)`` lesion mask, 0/1.
        patch_size: side of a patch in pixels.

    Returns:
        ``(B, S, S)`` float32, non-negative.
    """
    pooled = F.avg_pool2d(mask[:, None].float(), patch_size)
    return upsample(pooled[:, 0], mask.shape[-2:])


def sink_per_slice(
    rollout: torch.Tensor,
    class_attention: torch.Tensor,
    head: torch.Tensor,
    num_prefix_tokens: int,
    patch_grid: tuple[int, int] | None = None,
) -> dict[str, torch.Tensor]:
    """The sink of each slice of a batch, as ``predictions.csv`` and the review list it.

    Args:
        rollout: ``(B, grid_h, grid_w)`` rollout on its grid (the patch grid, or a finer one read over shifted grids).
        class_attention: ``(B, blocks, T)``, see :func:`class_token_shares`.
        head: ``(B, 1, S, S)`` head mask, 0/1.
        num_prefix_tokens: class and register tokens in front of the patch tokens.
        patch_grid: ``(grid_h, grid_w)`` of the model's patches; None: the rollout's grid.

    Returns:
        ``rollout_air`` (the rollout's share on cells of its grid without a head pixel) and ``rollout_outside_head``
        ``(B,)`` (on the slice grid, rollout upsampled bilinearly), ``cls_prefix`` and ``cls_air`` ``(B, blocks)``;
        float64.
    """
    air = air_patches(head, rollout.shape[-2:])
    heat = upsample(rollout, head.shape[-2:])
    patch_air = air if patch_grid is None else air_patches(head, patch_grid)
    prefix, on_air = class_token_shares(class_attention, patch_air, num_prefix_tokens)
    return {
        "rollout_air": mass_share(rollout, air),
        "rollout_outside_head": mass_share(heat, head[:, 0] < 0.5),
        "cls_prefix": prefix,
        "cls_air": on_air,
    }


class SinkMetrics(Metric):
    """The attention sink over an evaluation set; every state a sum (``dist_reduce_fx="sum"``), as DDP needs.

    ``compute`` returns, averaged over all slices: ``rollout_air`` (share of the rollout on patches without a head
    pixel), ``cls_prefix_block{i}`` and ``cls_air_block{i}`` (the class token's attention on prefix tokens and on
    air patches in block ``i``); averaged over the slices with a known, non-empty lesion mask:
    ``rollout_outside_head`` (share of the upsampled rollout outside the head's pixels) and
    ``rollout_outside_head_floor`` (the same for :func:`patch_level_floor`); and ``slices`` / ``lesion_slices``.

    Args:
        num_blocks: transformer blocks of the model.
        **kwargs: Passed to ``torchmetrics.Metric``.
    """

    is_differentiable = False
    full_state_update = False

    def __init__(self, num_blocks: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_blocks = num_blocks
        zero = torch.tensor(0.0, dtype=torch.float64)
        for name in ("rollout_air", "slices", "outside_head", "outside_head_floor", "lesion_slices"):
            self.add_state(name, default=zero.clone(), dist_reduce_fx="sum")
        for name in ("cls_prefix", "cls_air"):
            self.add_state(name, default=torch.zeros(num_blocks, dtype=torch.float64), dist_reduce_fx="sum")

    def update(
        self,
        rollout: torch.Tensor,
        heat: torch.Tensor,
        class_attention: torch.Tensor,
        head: torch.Tensor,
        mask: torch.Tensor,
        scored: torch.Tensor,
        *,
        num_prefix_tokens: int,
        patch_size: int,
    ) -> None:
        """Adds a batch.

        Args:
            rollout: ``(B, grid_h, grid_w)`` rollout on its grid (the patch grid or a finer one).
            heat: ``(B, S, S)`` the same, upsampled to the slice grid.
            class_attention: ``(B, blocks, T)``, see :func:`class_token_shares`.
            head: ``(B, S, S)`` head mask, 0/1.
            mask: ``(B, S, S)`` lesion mask, 0/1.
            scored: ``(B,)`` bool: the lesion mask is known and not empty.
            num_prefix_tokens: class and register tokens in front of the patch tokens.
            patch_size: side of a patch in pixels.
        """
        patches = (head.shape[-2] // patch_size, head.shape[-1] // patch_size)
        prefix, on_air = class_token_shares(class_attention, air_patches(head, patches), num_prefix_tokens)
        self.rollout_air += mass_share(rollout, air_patches(head, rollout.shape[-2:])).sum()
        self.cls_prefix += prefix.sum(dim=0)
        self.cls_air += on_air.sum(dim=0)
        self.slices += len(rollout)
        if scored.any():
            outside = head[scored] < 0.5
            self.outside_head += mass_share(heat[scored], outside).sum()
            self.outside_head_floor += mass_share(patch_level_floor(mask[scored], patch_size), outside).sum()
            self.lesion_slices += scored.sum()

    def compute(self) -> dict[str, torch.Tensor]:
        """Means (NaN where no slice was counted)."""
        nan = torch.tensor(float("nan"), dtype=torch.float64, device=self.slices.device)
        n = self.slices if self.slices > 0 else nan
        m = self.lesion_slices if self.lesion_slices > 0 else nan
        values = {
            "rollout_air": self.rollout_air / n,
            "rollout_outside_head": self.outside_head / m,
            "rollout_outside_head_floor": self.outside_head_floor / m,
        }
        for i in range(self.num_blocks):
            values[f"cls_prefix_block{i}"] = self.cls_prefix[i] / n
            values[f"cls_air_block{i}"] = self.cls_air[i] / n
        return {**values, "slices": self.slices, "lesion_slices": self.lesion_slices}
