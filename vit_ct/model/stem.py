"""A convolutional patch stem that still emits one token per 16x16 patch (Xiao et al. 2021, arXiv:2106.14881).

Stride-2 3x3 convolutions instead of one 16x16 linear projection make a ViT trained from scratch on small data
optimise far better; the token grid, and so attention rollout, stays exactly that of the patch embedding.
"""

from __future__ import annotations

import math

from timm.layers import PatchEmbed
from torch import nn


class ConvStemPatchEmbed(PatchEmbed):
    """timm ``PatchEmbed`` whose projection is a conv stem: log2(patch) stride-2 3x3 convs, then a 1x1 conv.

    Takes timm's ``embed_layer`` arguments, so ``timm.create_model(..., embed_layer=ConvStemPatchEmbed)`` works and
    every attribute (``patch_size``, ``grid_size``, ``num_patches``) keeps its meaning.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        patch_h, patch_w = self.patch_size
        if patch_h != patch_w or patch_h & (patch_h - 1):
            raise ValueError(f"the conv stem needs a square power-of-two patch, got {self.patch_size}")
        in_chans, embed_dim = self.proj.in_channels, self.proj.out_channels
        bias = self.proj.bias is not None
        stages = int(math.log2(patch_h))
        layers: list[nn.Module] = []
        width = max(embed_dim // 2 ** (stages - 1), 8)
        channels = in_chans
        for _ in range(stages):
            layers += [nn.Conv2d(channels, width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
            channels, width = width, min(width * 2, embed_dim)
        layers.append(nn.Conv2d(channels, embed_dim, 1, bias=bias))
        self.proj = nn.Sequential(*layers)  # (B, C, H, W) -> (B, D, H / patch, W / patch)
