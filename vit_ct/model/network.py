"""The network: timm's Vision Transformer (arXiv:2010.11929) whose air patches skip the blocks.

No training in here (that is :class:`vit_ct.task.classifier.ViTClassifier`): ``forward_features`` / ``forward_head``
as in timm, with one change a timm user can read in ``forward_features`` below.
"""

from __future__ import annotations

import timm
import torch
import torch.nn.functional as F
from timm.models import VisionTransformer
from torch.utils.checkpoint import checkpoint

# Windowed input at or below this is "nothing here": every window maps air (-1000 HU) to exactly 0.
EMPTY_LEVEL = 1e-3


def attention_keys(image: torch.Tensor, patch_size: int, num_prefix_tokens: int) -> torch.Tensor:
    """Which tokens may be attended to: every prefix token, and every patch with at least one pixel above the floor
    of some window (``EMPTY_LEVEL``). Patches at the floor of every window hold only air: HU below all windows.

    Args:
        image: ``(B, C, H, W)`` windowed input in [0, 1], ``H`` and ``W`` multiples of ``patch_size``.
        patch_size: side of a patch in pixels.
        num_prefix_tokens: class and register tokens in front of the patch tokens (always keys).

    Returns:
        ``(B, 1, 1, T)`` bool, True where a key may be attended to; broadcasts over heads and queries as timm's
        (and ``scaled_dot_product_attention``'s) boolean ``attn_mask``.
    """
    content = F.max_pool2d(image.detach().amax(dim=1, keepdim=True).float(), patch_size) > EMPTY_LEVEL
    patches = content.flatten(1)  # (B, N)
    prefix = patches.new_ones(patches.shape[0], num_prefix_tokens)
    return torch.cat([prefix, patches], dim=1)[:, None, None, :]


class AirSkippingViT(VisionTransformer):
    """timm's ``VisionTransformer`` in which patches that hold nothing skip the blocks, when ``mask_air``.

    Such patches (every pixel at the floor of every window: air, padding, outside the scan circle) are attention keys
    of no token, so nothing they compute could reach another token: the blocks run only the tokens that are keys
    somewhere in the batch (each slice's own air among them masked), and air tokens keep their embedding. The same
    logits as timm's own ``forward_features(x, attn_mask=keys)`` (:meth:`forward_features_every_token`), faster
    on head CT (benchmarks/air_tokens.py and its record).

    While the blocks run a subset, ``running_tokens`` is ``(index (B, t), T)``, the position of each running token
    in the full sequence; :func:`vit_ct.explain.attention.record_attention` reads it to record every block's attention
    on the full sequence (identity rows and zero columns for the tokens left out).

    Build it with :meth:`create`, which lets timm build the architecture.
    """

    mask_air: bool = False
    running_tokens: tuple[torch.Tensor, int] | None = None

    @classmethod
    def create(cls, arch: str, *, mask_air: bool, **kwargs) -> AirSkippingViT:
        """``timm.create_model(arch, **kwargs)`` (timm's defaults and initialisation for ``arch``), as this class."""
        network = timm.create_model(arch, pretrained=False, **kwargs)
        network.__class__ = cls  # the module timm built, unchanged but for the methods below: no new parameters
        network.mask_air = mask_air
        return network

    def forward_features(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        *,
        checkpoint_blocks: bool = True,
    ) -> torch.Tensor:
        """Tokens ``(B, T, D)`` after the final norm, as timm's ``forward_features``; without ``mask_air`` (or given
        an ``attn_mask``) timm's path. ``checkpoint_blocks=False`` runs every block plainly even with gradient
        checkpointing on (attention recorded in the graph would be recorded again when a checkpointed block is
        recomputed in the backward pass)."""
        if is_causal:  # not a vision model's use; timm's own path
            return super().forward_features(x, attn_mask=attn_mask, is_causal=True)
        if not self.mask_air or attn_mask is not None:
            tokens = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
            return self.norm(self._run_blocks(tokens, attn_mask, checkpoint_blocks))
        keys = attention_keys(x, self.patch_embed.patch_size[0], self.num_prefix_tokens)[:, 0, 0]  # (B, T)
        tokens = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))  # (B, T, D)
        # the tokens that are keys somewhere in the batch, keys first in their order: (B, t)
        index = (~keys).long().argsort(dim=1, stable=True)[:, : int(keys.sum(dim=1).max())]
        running = tokens.gather(1, index[..., None].expand(-1, -1, tokens.shape[-1]))
        self.running_tokens = (index, tokens.shape[1])
        try:
            running = self._run_blocks(running, keys.gather(1, index)[:, None, None, :], checkpoint_blocks)
        finally:
            self.running_tokens = None
        return self.norm(tokens.scatter(1, index[..., None].expand_as(running), running))

    def forward_features_every_token(self, x: torch.Tensor) -> torch.Tensor:
        """``forward_features`` as timm computes it, every token through every block: air patches (where the network
        masks them) are masked as keys instead of skipping the blocks. The same class token and logits; the block
        outputs lie on the full patch grid (what Grad-CAM reads), and it is the reference the skipping is tested and
        timed against."""
        keys = attention_keys(x, self.patch_embed.patch_size[0], self.num_prefix_tokens) if self.mask_air else None
        return super().forward_features(x, attn_mask=keys)

    def _run_blocks(self, x: torch.Tensor, keys: torch.Tensor | None, checkpoint_blocks: bool) -> torch.Tensor:
        # timm's own loop skips gradient checkpointing when given a mask: the blocks are run here instead
        for block in self.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled() and checkpoint_blocks:
                x = checkpoint(block, x, attn_mask=keys, use_reentrant=False)
            else:
                x = block(x, attn_mask=keys)
        return x
