"""Attention rollout (Abnar & Zuidema 2020, arXiv:2005.00928) and gradient-weighted rollout
(Chefer et al. 2021, arXiv:2103.15679): pure tensor maths on recorded attention, no model in sight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

HeadFusion = Literal["mean", "max", "min"]
HEAD_FUSIONS = ("mean", "max", "min")


def fuse_heads(attention: torch.Tensor, head_fusion: HeadFusion = "mean") -> torch.Tensor:
    """Fuses the heads of one block's attention into one.

    Args:
        attention: `(B, heads, T, T)` attention probabilities of one block.
        head_fusion: `mean`, `max` or `min` over the heads.

    Returns:
        `(B, 1, T, T)`; the input itself when it already has a single head.
    """
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}, got {head_fusion!r}")
    if attention.shape[1] == 1:
        return attention
    if head_fusion == "mean":
        return attention.mean(dim=1, keepdim=True)
    if head_fusion == "max":
        return attention.amax(dim=1, keepdim=True)
    return attention.amin(dim=1, keepdim=True)


def _check_attentions(attentions: Sequence[torch.Tensor], name: str = "attentions") -> None:
    if len(attentions) == 0:
        raise ValueError(f"{name} is empty: expected one (B, heads, T, T) tensor per block")
    first = attentions[0]
    for i, a in enumerate(attentions):
        if a.dim() != 4 or a.shape[-1] != a.shape[-2]:
            raise ValueError(f"{name}[{i}] has shape {tuple(a.shape)}, expected (B, heads, T, T)")
        if a.shape[0] != first.shape[0] or a.shape[-1] != first.shape[-1]:
            raise ValueError(f"{name}[{i}] has shape {tuple(a.shape)}, but {name}[0] has {tuple(first.shape)}")


def _grid(num_patches: int, grid_size: tuple[int, int] | None) -> tuple[int, int]:
    if grid_size is not None:
        grid_h, grid_w = grid_size
        if grid_h * grid_w != num_patches:
            raise ValueError(f"grid_size {tuple(grid_size)} does not hold the {num_patches} patch tokens")
        return grid_h, grid_w
    side = math.isqrt(num_patches)
    if side * side != num_patches:
        raise ValueError(f"{num_patches} patch tokens do not form a square grid: pass grid_size=(grid_h, grid_w)")
    return side, side


def _patch_row(rows: torch.Tensor, num_prefix_tokens: int, grid_size: tuple[int, int] | None) -> torch.Tensor:
    """(..., T) rows over all tokens -> (..., grid_h, grid_w) over the patch tokens."""
    if num_prefix_tokens < 1:
        raise ValueError(
            f"num_prefix_tokens must be >= 1 (rollout reads the class token's row), got {num_prefix_tokens}"
        )
    patches = rows[..., num_prefix_tokens:]
    grid_h, grid_w = _grid(patches.shape[-1], grid_size)
    return patches.reshape(*patches.shape[:-1], grid_h, grid_w)


def _compute_dtype(attention: torch.Tensor) -> torch.dtype:
    # half-precision attention (AMP) is rolled out in float32: products of 12+ blocks lose too much in 16 bits
    return torch.promote_types(attention.dtype, torch.float32)


def _discard_lowest(fused: torch.Tensor, discard_ratio: float, num_prefix_tokens: int) -> torch.Tensor:
    """Zeroes the lowest `discard_ratio` of each image's patch-to-patch weights.

    Rows and columns of the prefix tokens are never discarded, so the class token keeps its own entries.

    Args:
        fused: `(B, T, T)` head-fused attention.
        discard_ratio: fraction in [0, 1) of the `(T - prefix)**2` patch-to-patch weights to zero, per image.
        num_prefix_tokens: class and register tokens at the start of the sequence.

    Returns:
        `(B, T, T)`, a copy when anything is discarded.
    """
    B, T, _ = fused.shape
    patches = fused[:, num_prefix_tokens:, num_prefix_tokens:].reshape(B, -1)  # (B, (T - P)**2)
    k = int(patches.shape[-1] * discard_ratio)
    if k == 0:
        return fused
    lowest = patches.topk(k, dim=-1, largest=False).indices  # per image, not over the batch
    patches = patches.scatter(-1, lowest, 0.0)
    fused = fused.clone()
    fused[:, num_prefix_tokens:, num_prefix_tokens:] = patches.view(B, T - num_prefix_tokens, T - num_prefix_tokens)
    return fused


def _block_attention(
    attention: torch.Tensor, head_fusion: HeadFusion, discard_ratio: float, num_prefix_tokens: int
) -> torch.Tensor:
    """(B, heads, T, T) -> (B, T, T) fused heads, lowest weights discarded, not yet residual-augmented."""
    fused = fuse_heads(attention, head_fusion).squeeze(1).to(_compute_dtype(attention))  # (B, T, T)
    return _discard_lowest(fused, discard_ratio, num_prefix_tokens)


def _check_discard_ratio(discard_ratio: float) -> None:
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")


def joint_attention(
    attentions: Sequence[torch.Tensor],
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    num_prefix_tokens: int = 1,
) -> torch.Tensor:
    """The full rolled-out attention matrix `A_L ... A_1`, with `A_l = rownorm(fuse(attn_l) + I)`.

    Args:
        attentions: one `(B, heads, T, T)` tensor per block, first block first (`heads` may be 1).
        head_fusion: `mean`, `max` or `min` over the heads of each block.
        discard_ratio: fraction of each image's lowest patch-to-patch weights zeroed per block.
        num_prefix_tokens: class and register tokens at the start of the sequence.

    Returns:
        `(B, T, T)`; row `i` says how much token `i` after the last block draws from each input token.
        Every row sums to 1.
    """
    _check_attentions(attentions)
    _check_discard_ratio(discard_ratio)
    B, _, T, _ = attentions[0].shape
    eye = torch.eye(T, dtype=_compute_dtype(attentions[0]), device=attentions[0].device)  # (T, T)
    result = eye.expand(B, T, T)
    for attention in attentions:
        a = _block_attention(attention, head_fusion, discard_ratio, num_prefix_tokens) + eye  # residual stream
        a = a / a.sum(dim=-1, keepdim=True)
        result = a @ result  # (B, T, T)
    return result


def attention_rollout(
    attentions: Sequence[torch.Tensor],
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    num_prefix_tokens: int = 1,
    grid_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Attention rollout of the first prefix (class) token over the patches (Abnar & Zuidema 2020).

    Per block: fuse heads, zero the lowest `discard_ratio` of patch-to-patch weights per image (the prefix
    tokens' rows and columns are kept), add the identity for the residual stream, renormalise rows; then
    multiply through the blocks, first block first. Forms the full `(B, T, T)` product; `class_token_rollout`
    gives the same map with only the class token's row.

    If the class token attends only to itself in every block, the map is all zeros.

    Args:
        attentions: one `(B, heads, T, T)` tensor per block, first block first (`heads` may be 1).
        head_fusion: `mean`, `max` or `min` over the heads of each block.
        discard_ratio: fraction in [0, 1) of each image's lowest patch-to-patch weights zeroed per block.
        num_prefix_tokens: class and register tokens at the start of the sequence; row 0 is read.
        grid_size: `(grid_h, grid_w)` of the patches; inferred as square when omitted.

    Returns:
        `(B, grid_h, grid_w)` non-negative map.
    """
    joint = joint_attention(attentions, head_fusion, discard_ratio, num_prefix_tokens)
    return _patch_row(joint[:, 0], num_prefix_tokens, grid_size)


def class_token_rollout(
    attentions: Sequence[torch.Tensor],
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    num_prefix_tokens: int = 1,
    grid_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """`attention_rollout` for large inputs: propagates only the class token's row.

    Row 0 of `A_L ... A_1` is `e_0 A_L ... A_1`, so a `(B, T)` row vector is multiplied by each block's
    matrix from the last block backwards: O(L T^2) work instead of O(L T^3), and no `T x T` tensor is
    formed beyond the per-block attention itself (without discarding, not even its identity-augmented copy).
    Pair it with `record_attention(model, head_fusion=...)` so that only `(B, 1, T, T)` per block is stored.

    Args:
        attentions: one `(B, heads, T, T)` tensor per block, first block first (`heads` may be 1).
        head_fusion: `mean`, `max` or `min` over the heads of each block.
        discard_ratio: fraction in [0, 1) of each image's lowest patch-to-patch weights zeroed per block.
        num_prefix_tokens: class and register tokens at the start of the sequence; row 0 is read.
        grid_size: `(grid_h, grid_w)` of the patches; inferred as square when omitted.

    Returns:
        `(B, grid_h, grid_w)`, equal to `attention_rollout` up to float rounding.
    """
    _check_attentions(attentions)
    _check_discard_ratio(discard_ratio)
    B, _, T, _ = attentions[0].shape
    row = torch.zeros(B, 1, T, dtype=_compute_dtype(attentions[0]), device=attentions[0].device)  # (B, 1, T)
    row[:, :, 0] = 1.0
    for attention in reversed(attentions):
        a = _block_attention(attention, head_fusion, discard_ratio, num_prefix_tokens)  # (B, T, T)
        # row @ rownorm(a + I) == (row / s) @ a + row / s with s the row sums of a + I: no augmented copy
        scaled = row / (a.sum(dim=-1).unsqueeze(1) + 1.0)  # (B, 1, T)
        row = scaled @ a + scaled
    return _patch_row(row[:, 0], num_prefix_tokens, grid_size)


def gradient_rollout(
    attentions: Sequence[torch.Tensor],
    gradients: Sequence[torch.Tensor],
    num_prefix_tokens: int = 1,
    grid_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Gradient-weighted rollout of the class token (Chefer et al. 2021, "generic attention-model explainability").

    Per block `A_bar = mean_heads(relu(grad * A))`; starting from `R = I`, each block adds `A_bar @ R`; the
    map is row 0 of `R` over the patches. Unlike plain rollout it is class-specific: the gradients come from
    the logit being explained.

    Args:
        attentions: one `(B, heads, T, T)` tensor per block, first block first, all heads kept.
        gradients: the gradient of the explained logit with respect to each of `attentions`.
        num_prefix_tokens: class and register tokens at the start of the sequence; row 0 is read.
        grid_size: `(grid_h, grid_w)` of the patches; inferred as square when omitted.

    Returns:
        `(B, grid_h, grid_w)` non-negative map.
    """
    _check_attentions(attentions)
    _check_attentions(gradients, name="gradients")
    if len(gradients) != len(attentions):
        raise ValueError(f"got {len(gradients)} gradients for {len(attentions)} attention tensors")
    B, _, T, _ = attentions[0].shape
    dtype = _compute_dtype(attentions[0])
    R = torch.eye(T, dtype=dtype, device=attentions[0].device).expand(B, T, T)  # (B, T, T)
    for attention, gradient in zip(attentions, gradients, strict=True):
        if gradient.shape != attention.shape:
            raise ValueError(f"gradient shape {tuple(gradient.shape)} differs from attention {tuple(attention.shape)}")
        a_bar = (gradient.to(dtype) * attention.to(dtype)).clamp(min=0).mean(dim=1)  # (B, T, T)
        R = R + a_bar @ R
    return _patch_row(R[:, 0], num_prefix_tokens, grid_size)


def last_block_attention(
    attentions: Sequence[torch.Tensor],
    head_fusion: HeadFusion = "mean",
    num_prefix_tokens: int = 1,
    grid_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The class token's attention over the patches in the last block, heads fused: the raw-attention baseline.
    Arguments as :func:`per_block_maps`; returns `(B, grid_h, grid_w)`."""
    _check_attentions(attentions)
    return per_block_maps(attentions[-1:], head_fusion, num_prefix_tokens, grid_size)[:, 0]


def per_head_maps(
    attentions: Sequence[torch.Tensor],
    block: int = -1,
    num_prefix_tokens: int = 1,
    grid_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The class token's attention over the patches for every head of one block, for review.

    Args:
        attentions: one `(B, heads, T, T)` tensor per block, first block first.
        block: index of the block (negative counts from the last).
        num_prefix_tokens: class and register tokens at the start of the sequence; row 0 is read.
        grid_size: `(grid_h, grid_w)` of the patches; inferred as square when omitted.

    Returns:
        `(B, heads, grid_h, grid_w)`.
    """
    _check_attentions(attentions)
    return _patch_row(attentions[block][:, :, 0], num_prefix_tokens, grid_size)


def per_block_maps(
    attentions: Sequence[torch.Tensor],
    head_fusion: HeadFusion = "mean",
    num_prefix_tokens: int = 1,
    grid_size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The class token's attention over the patches in every block, heads fused, for review.

    Args:
        attentions: one `(B, heads, T, T)` tensor per block, first block first.
        head_fusion: `mean`, `max` or `min` over the heads.
        num_prefix_tokens: class and register tokens at the start of the sequence; row 0 is read.
        grid_size: `(grid_h, grid_w)` of the patches; inferred as square when omitted.

    Returns:
        `(B, blocks, grid_h, grid_w)`.
    """
    _check_attentions(attentions)
    rows = torch.stack([fuse_heads(a, head_fusion)[:, 0, 0] for a in attentions], dim=1)  # (B, blocks, T)
    return _patch_row(rows, num_prefix_tokens, grid_size)
