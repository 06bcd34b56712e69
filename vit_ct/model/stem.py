"""A convolutional patch stem that still emits one token per 16x16 patch (Xiao et al. 2021, arXiv:2106.14881).

Stride-2 3x3 convolutions instead of one 16x16 linear projection make a ViT trained from scratch on small data
optimise far better; the token grid, and so attention rollout, stays exactly that of the patch embedding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
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


class NeighbourKernels(nn.Module):
    """The convolution that first sees the image, for a network that reads a slice with its neighbours: one
    convolution over every channel whose kernels are held as two tensors, ``own`` over the slice's channels (the
    first ``per_slice``) and ``neighbours`` over the rest. The same output as the convolution and the same state dict
    (``weight`` over every channel, the slice's first; ``bias``), so weights and checkpoints read as before; only the
    optimiser sees two tensors, so that kernels new to weights trained on single slices can learn at a rate of their
    own (:func:`vit_ct.task.optim.param_groups`).

    Args:
        conv: the network's convolution, whose weights and geometry it takes.
        per_slice: the channels of one slice (one per window).
    """

    def __init__(self, conv: nn.Conv2d, per_slice: int) -> None:
        super().__init__()
        if not 0 < per_slice < conv.in_channels or conv.groups != 1 or conv.padding_mode != "zeros":
            raise ValueError(f"a slice's {per_slice} channels must be fewer than the {conv.in_channels} of a plain"
                             " convolution")  # fmt: skip
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self.own = nn.Parameter(conv.weight.detach()[:, :per_slice].clone())
        self.neighbours = nn.Parameter(conv.weight.detach()[:, per_slice:].clone())
        self.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach().clone())

    @property
    def weight(self) -> torch.Tensor:
        """The kernels as one convolution's, ``(out, C, k, k)``."""
        return torch.cat([self.own, self.neighbours], dim=1)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Fresh kernels as ``nn.Conv2d`` draws them for the one convolution (what timm's initialisation calls)."""
        fresh = nn.Conv2d(self.weight.shape[1], self.own.shape[0], self.own.shape[2:], bias=self.bias is not None,
                          device=self.own.device, dtype=self.own.dtype)  # fmt: skip
        self.own.copy_(fresh.weight[:, : self.own.shape[1]])
        self.neighbours.copy_(fresh.weight[:, self.own.shape[1] :])
        if self.bias is not None:
            self.bias.copy_(fresh.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        weight = self.weight
        destination[prefix + "weight"] = weight if keep_vars else weight.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        weight = state_dict.pop(prefix + "weight", None)  # one convolution's kernels, handed to the two tensors
        if weight is not None:
            state_dict[prefix + "own"] = weight[:, : self.own.shape[1]]
            state_dict[prefix + "neighbours"] = weight[:, self.own.shape[1] :]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def split_neighbour_kernels(patch_embed: nn.Module, per_slice: int) -> NeighbourKernels:
    """Hold the first convolution of ``patch_embed`` (timm's linear patch projection, or the conv stem's first) as
    :class:`NeighbourKernels`, in place; returns it."""
    proj = patch_embed.proj
    first = proj[0] if isinstance(proj, nn.Sequential) else proj
    split = NeighbourKernels(first, per_slice)
    if isinstance(proj, nn.Sequential):
        proj[0] = split
    else:
        patch_embed.proj = split
    return split
