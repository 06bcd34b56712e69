"""Record the attention of a timm ViT with removable hooks, for attention rollout
(Abnar & Zuidema 2020, arXiv:2005.00928). Hook code only: the maths is in `vit_ct.explain.rollout`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import timm.layers
import torch
from timm.models.vision_transformer import ParallelScalingBlock, VisionTransformer
from torch import nn

from vit_ct.explain.rollout import HEAD_FUSIONS, HeadFusion, fuse_heads

# timm modules whose unfused path is `softmax -> attn_drop -> @ v`, so the input of `attn_drop` is the attention
# probabilities. DiffAttention is left out on purpose: the input of its `attn_drop` is a difference of softmaxes.
_RECORDABLE = tuple(
    cls
    for cls in (timm.layers.Attention, getattr(timm.layers, "AttentionRope", None), ParallelScalingBlock)
    if cls is not None  # AttentionRope is recent
)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The timm attention modules of `model` in forward order (first block first).

    Args:
        model: a timm `VisionTransformer` or any module holding one (e.g. a LightningModule).

    Returns:
        The modules, each with a `fused_attn` flag and an `attn_drop` dropout fed the attention probabilities.
    """
    found = [m for m in model.modules() if isinstance(m, _RECORDABLE) and isinstance(m.attn_drop, nn.Dropout)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} holds no timm attention module ({', '.join(c.__name__ for c in _RECORDABLE)}): "
            "record_attention needs a timm Vision Transformer"
        )
    return found


def _vision_transformer(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(module, VisionTransformer) or (
            hasattr(module, "patch_embed") and hasattr(module, "num_prefix_tokens")
        ):
            return module
    raise ValueError(f"{type(model).__name__} holds no timm VisionTransformer (a module with patch_embed)")


# A network whose blocks run only some of its tokens (vit-ct's air-skipping ViT, vit_ct.model.network) names them
# during the forward pass in this attribute: `(index, total)`, the position of each running token in the full
# sequence (B, T') and the length of the full sequence T. Attention is then recorded on the full sequence.
RUNNING_TOKENS = "running_tokens"


def to_full_sequence(attention: torch.Tensor, index: torch.Tensor, total: int) -> torch.Tensor:
    """``(B, H, T', T')`` attention among the tokens at ``index`` -> ``(B, H, T, T)`` on the full sequence, as if the
    left-out tokens had been there as queries and keys: identity rows for them (a token that skips the blocks keeps
    its own value) and zero columns (nothing attends to them). Rows still sum to 1, so rollout, sink measures and
    maps stay on the full patch grid. Differentiable."""
    B, H, kept, _ = attention.shape
    cols = attention.new_zeros(B, H, kept, total).scatter(
        3, index[:, None, None, :].expand(B, H, kept, kept), attention
    )
    left_out = torch.ones(B, total, dtype=torch.bool, device=index.device).scatter(1, index, False)
    full = torch.diag_embed(left_out.to(attention.dtype))[:, None].expand(B, H, total, total)
    return full.scatter(2, index[:, None, :, None].expand(B, H, kept, total), cols)


def from_full_sequence(full: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_full_sequence`: the rows and columns of the tokens at ``index``."""
    B, H, total, _ = full.shape
    kept = index.shape[1]
    rows = full.gather(2, index[:, None, :, None].expand(B, H, kept, total))
    return rows.gather(3, index[:, None, None, :].expand(B, H, kept, kept))


def num_prefix_tokens(model: nn.Module) -> int:
    """Number of class and register tokens in front of the patch tokens.

    Args:
        model: a timm `VisionTransformer` or any module holding one.
    """
    return int(_vision_transformer(model).num_prefix_tokens)


def patch_grid(model: nn.Module, image_shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    """The `(grid_h, grid_w)` of patch tokens the model makes from images of `image_shape`.

    Args:
        model: a timm `VisionTransformer` or any module holding one.
        image_shape: `(H, W)` or a full `(B, C, H, W)` shape; only the last two sizes are read.

    Returns:
        The patch grid; non-square inputs need a model built with `dynamic_img_size=True`.
    """
    patch_embed = _vision_transformer(model).patch_embed
    H, W = (int(s) for s in tuple(image_shape)[-2:])
    fixed = getattr(patch_embed, "img_size", None)
    if fixed is not None and getattr(patch_embed, "strict_img_size", False) and tuple(fixed) != (H, W):
        raise ValueError(
            f"the model takes {tuple(fixed)} images, got {(H, W)}: build it with that img_size or dynamic_img_size=True"
        )
    patch_h, patch_w = patch_embed.patch_size
    if getattr(patch_embed, "dynamic_img_pad", False):  # images padded up to whole patches
        return math.ceil(H / patch_h), math.ceil(W / patch_w)
    return H // patch_h, W // patch_w


@contextlib.contextmanager
def record_attention(
    model: nn.Module, *, head_fusion: HeadFusion | None = None, keep_graph: bool = False
) -> Iterator[list[torch.Tensor]]:
    """Records the attention probabilities of every block during the forward passes inside the context.

    Switches the model's attention to the unfused path (`fused_attn = False`; `scaled_dot_product_attention`
    never materialises the probabilities) and hooks the input of each `attn_drop`, i.e. the softmax output
    before dropout. On exit, also after an exception, which is re-raised, the hooks are removed and every
    `fused_attn` flag gets its previous value back. Logits are the same inside and outside, up to float rounding.

    Memory: the probabilities take `B * heads * T**2` floats per block (ViT-B/16 at 512 x 512: 50 MB per image and
    block); `head_fusion` fuses the heads inside the hook and keeps `heads` times less.

    Args:
        model: a timm `VisionTransformer` or any module holding one (e.g. a LightningModule).
        head_fusion: `None` keeps every head, `(B, heads, T, T)`; `mean`, `max` or `min` stores `(B, 1, T, T)`.
        keep_graph: keep the tensors in the autograd graph and `retain_grad()` them, so that their `.grad` is
            filled by a backward pass (for `gradient_rollout`, which needs every head: leave `head_fusion=None`).

    Yields:
        A list that fills with one tensor per block per forward pass, first block first.
    """
    if head_fusion is not None and head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"head_fusion must be None or one of {HEAD_FUSIONS}, got {head_fusion!r}")
    modules = attention_modules(model)
    vit = _vision_transformer(model)
    attentions: list[torch.Tensor] = []

    def store(dropout: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        attention = args[0]  # (B, heads, T, T), rows sum to 1
        replaced = None
        subset = getattr(vit, RUNNING_TOKENS, None)  # the blocks run some tokens only: record on the full sequence
        gradients_at_it = keep_graph and head_fusion is None  # e.g. gradient rollout: autograd.grad at the record
        if subset is not None and gradients_at_it:
            attention = to_full_sequence(attention, *subset)
            # the block goes on from the full tensor (the same values), so gradients taken at it are the model's
            replaced = (from_full_sequence(attention, subset[0]), *args[1:])
        if not keep_graph:
            attention = attention.detach()
        if head_fusion is not None:
            attention = fuse_heads(attention, head_fusion)  # (B, 1, T, T)
        if subset is not None and not gradients_at_it:  # fused first: heads times less to expand
            attention = to_full_sequence(attention, *subset)
        if keep_graph and attention.requires_grad:
            attention.retain_grad()
        attentions.append(attention)
        return replaced

    previous = [m.fused_attn for m in modules]
    handles = []
    try:
        for module in modules:
            module.fused_attn = False
            handles.append(module.attn_drop.register_forward_pre_hook(store))
        yield attentions
    finally:
        for handle in handles:
            handle.remove()
        for module, fused in zip(modules, previous, strict=True):
            module.fused_attn = fused
