"""Run a timm ViT on a batch and explain its decision as a patch map: attention rollout
(Abnar & Zuidema 2020, arXiv:2005.00928) or gradient-weighted rollout (Chefer et al. 2021, arXiv:2103.15679); and the
maps brought to the slice grid, beside the floors and the ceiling the localisation scores compare them with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from vit_ct.explain.attention import num_prefix_tokens, patch_grid, record_attention
from vit_ct.explain.rollout import HeadFusion, class_token_rollout, gradient_rollout
from vit_ct.explain.segmentation import perfect_patch_map


@dataclass
class Explained:
    """What one recorded forward pass gives: the model's output, the attention rollout and the attention rows of the
    class token (what the sink metrics of :mod:`vit_ct.metrics.sink` read). Read over shifted grids
    (:func:`vit_ct.explain.shifted.shifted_explained`), ``rollout`` is on the finer grid and ``shifted_outputs`` holds
    the shifted passes' outputs; the rest is the unshifted pass's."""

    output: Any
    rollout: torch.Tensor  # (B, grid_h, grid_w) float32, non-negative; a grid `map_shifts` times finer when shifted
    class_attention: torch.Tensor  # (B, blocks, T) float32: the class token's head-fused row per block, sums to 1
    shifted_outputs: tuple[Any, ...] = ()  # the outputs of the passes over shifted grids, the unshifted one aside
    relevance: torch.Tensor | None = None  # (B, S, S) gradient x input per pixel, where the map is read to the pixel


class Explainer(Protocol):
    """What the maps below ask of a model (:meth:`vit_ct.ViTClassifier.explain`), so that explain/ knows no
    LightningModule: logits and ``(B, grid_h, grid_w)`` attention rollout of a ``(B, C, S, S)`` batch, in eval mode."""

    def explain(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def explain_forward(
    model: nn.Module,
    forward: Callable[[], Any],
    image_shape: tuple[int, ...] | torch.Size,
    *,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
) -> Explained:
    """Runs ``forward()`` with the attention of ``model`` recorded and rolls it out: the one rollout path of vit-ct
    (training metrics, predict, review), the memory-lean way: heads fused in the hook, class-token row only.

    Gradients follow whatever mode the caller is in; the recorded attention is detached either way.

    Args:
        model: a timm `VisionTransformer` or a module holding one; ``forward`` runs it once on one batch.
        forward: the forward pass, e.g. ``lambda: model(images)``; its result is returned as ``output``.
        image_shape: `(B, C, H, W)` of the batch, for the patch grid.
        head_fusion: `mean`, `max` or `min` over the heads of each block.
        discard_ratio: fraction in [0, 1) of each image's lowest patch-to-patch weights zeroed per block.
    """
    with record_attention(model, head_fusion=head_fusion) as attentions:
        output = forward()
    rollout = class_token_rollout(
        attentions,
        head_fusion=head_fusion,
        discard_ratio=discard_ratio,
        num_prefix_tokens=num_prefix_tokens(model),
        grid_size=patch_grid(model, image_shape),
    )
    rows = torch.stack([a[:, 0, 0] for a in attentions], dim=1).float()  # (B, blocks, T)
    rows = rows / rows.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)  # max/min fusion
    return Explained(output, rollout.float(), rows)


def explain_rollout(
    model: nn.Module, images: torch.Tensor, *, head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0
) -> torch.Tensor:
    """Attention-rollout maps of a batch (:func:`rollout_with_output` without the model's output)."""
    return rollout_with_output(model, images, head_fusion=head_fusion, discard_ratio=discard_ratio)[1]


def rollout_with_output(
    model: nn.Module, images: torch.Tensor, *, head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's output and attention-rollout maps of a batch from one forward pass (:func:`explain_forward`).

    Call `model.eval()` first, or attention dropout makes the maps random.

    Args:
        model: a timm `VisionTransformer` or a module holding one (e.g. a LightningModule) whose forward takes
            `images`.
        images: `(B, C, H, W)` input batch, as the model takes it.
        head_fusion: `mean`, `max` or `min` over the heads of each block.
        discard_ratio: fraction in [0, 1) of each image's lowest patch-to-patch weights zeroed per block.

    Returns:
        `(output, maps)`: what `model(images)` returns, and `(B, grid_h, grid_w)` float32 maps, non-negative, on the
        device of `images`.
    """
    with torch.no_grad():
        explained = explain_forward(
            model, lambda: model(images), images.shape, head_fusion=head_fusion, discard_ratio=discard_ratio
        )
    return explained.output, explained.rollout


def _target_logit(logits: torch.Tensor, target: int | torch.Tensor | None) -> torch.Tensor:
    """(B, classes) logits -> (B,) logit being explained."""
    if logits.dim() == 1 or logits.shape[-1] == 1:  # binary: the positive (lesion) logit
        return logits.reshape(logits.shape[0])
    if target is None:
        target = logits.argmax(dim=-1)
    target = torch.as_tensor(target, device=logits.device).expand(logits.shape[0])
    if target.min() < 0 or target.max() >= logits.shape[-1]:
        raise ValueError(f"target must be a class index in [0, {logits.shape[-1]}), got {target.tolist()}")
    return logits.gather(-1, target[:, None].long())[:, 0]


def explain_gradient_rollout(
    model: nn.Module, images: torch.Tensor, *, target: int | torch.Tensor | None = None
) -> torch.Tensor:
    """Gradient-weighted rollout maps of a batch (Chefer et al. 2021) for one logit per image.

    Works inside `torch.inference_mode()` / `torch.no_grad()` (e.g. a Lightning `predict_step`): gradients are
    switched back on locally, and taken with `torch.autograd.grad`, so the parameters' `.grad` stay untouched
    and frozen parameters are fine. Call `model.eval()` first.

    Args:
        model: a timm `VisionTransformer` or a module holding one whose forward returns `(B, classes)` logits.
        images: `(B, C, H, W)` input batch, as the model takes it.
        target: class explained: an index, one index per image, or `None` for each image's top class. Ignored
            for a single-logit (binary) model, whose positive logit is explained.

    Returns:
        `(B, grid_h, grid_w)` float32 maps, non-negative, on the device of `images`.
    """
    with torch.inference_mode(False), torch.enable_grad():
        # an inference-mode tensor cannot enter autograd, its clone can; requires_grad keeps the attention
        # in the graph even when every parameter is frozen
        images = images.clone().requires_grad_(True)
        with record_attention(model, keep_graph=True) as attentions:
            logits = model(images)
        # images are independent in a ViT, so the gradient of the sum is each image's own gradient
        gradients = torch.autograd.grad(_target_logit(logits, target).sum(), attentions)
    return gradient_rollout(
        [a.detach() for a in attentions],
        gradients,
        num_prefix_tokens=num_prefix_tokens(model),
        grid_size=patch_grid(model, images.shape),
    ).float()


def upsample(maps: torch.Tensor, size: tuple[int, int] | torch.Size) -> torch.Tensor:
    """``(B, grid_h, grid_w)`` patch maps -> ``(B, *size)`` float32, bilinearly, clipped at 0: how every map is
    brought to the slice grid (float32 also under AMP: fewer false ties)."""
    with torch.autocast(maps.device.type, enabled=False):
        heat = F.interpolate(maps[:, None].float(), size=tuple(size), mode="bilinear", align_corners=False)
    return heat[:, 0].clamp_min(0)


def upsampled_rollout(model: Explainer, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and the attention rollout bilinearly upsampled to the input's ``(B, S, S)``.

    Args:
        model: an :class:`Explainer` (a :class:`vit_ct.ViTClassifier`), in eval mode.
        image: ``(B, C, S, S)`` model input.
    """
    with torch.no_grad():
        logits, rollout = model.explain(image)
    return logits, upsample(rollout, image.shape[-2:])  # (B, S, S)


def localisation_maps(
    model: Explainer | None,
    batch: dict,
    *,
    rollout: torch.Tensor | None = None,
    patch_grid: tuple[int, int] | None = None,
) -> dict[str, torch.Tensor]:
    """The maps localisation scores (:mod:`vit_ct.metrics.localisation`) on the model grid, each ``(B, S, S)``.

    ``rollout``: the model's attention rollout, upsampled; ``floor_image``: the first window of the image itself
    (acute blood is bright); ``floor_head``: the head mask (uniform over the head: chance); ``perfect_patch``: the
    lesion mask pooled to the model's patch grid and upsampled (the ceiling of any patch-level map); and where the
    rollout's grid is finer than the patches (shifted-grid rollout, :mod:`vit_ct.explain.shifted`), ``perfect_grid``:
    the lesion mask pooled to the rollout's own grid and upsampled (the ceiling of any map on that grid).

    Args:
        model: an :class:`Explainer`, see :func:`upsampled_rollout`; may be None when ``rollout`` is given.
        batch: a :class:`vit_ct.CTBatch` (``image``, ``head`` and ``mask`` are read).
        rollout: ``(B, grid_h, grid_w)`` rollout already computed for this batch; None: the model's.
        patch_grid: ``(grid_h, grid_w)`` of the model's patches; None: the rollout's grid.
    """
    if rollout is None:
        with torch.no_grad():
            rollout = model.explain(batch["image"])[1]
    lesion = batch["mask"][:, 0] > 0.5
    patch_grid = tuple(rollout.shape[-2:]) if patch_grid is None else tuple(patch_grid)
    maps = {
        "rollout": upsample(rollout, batch["image"].shape[-2:]),
        "floor_image": batch["image"][:, 0].float(),
        "floor_head": batch["head"][:, 0].float(),
        "perfect_patch": perfect_patch_map(lesion, patch_grid),
    }
    if patch_grid != tuple(rollout.shape[-2:]):
        maps["perfect_grid"] = perfect_patch_map(lesion, rollout.shape[-2:])
    return maps
