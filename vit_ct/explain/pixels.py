"""Maps down to the pixel, read through the stem: each cell of the rollout spread over its pixels by the model's own
gradient x input (``--map_pixels``).

The rollout (over shifted grids, :mod:`vit_ct.explain.shifted`) gives each cell of ``patch_size / map_shifts`` pixels
one value. Below the cell, what the model reads of each pixel is its gradient x input: the gradient of the lesion
log-odds with respect to the input, through every block and the patch stem, times the input against air (what the
padding holds), summed over the windows, averaged over the same shifted passes. Its positive part (evidence for a
lesion), smoothed over :data:`SMOOTH_PX` pixels (about the footprint of a stem's first 3 x 3 stride-2 convolution),
gives each pixel its share of its cell; the cell's rollout is spread over its pixels by the square root of that share
(:data:`POWER`: the share itself splinters a cell into a few pixels), scaled so that every cell keeps its own mean:
pooled back to the cells, the map is the rollout. A cell without positive relevance keeps its value on every pixel.
Each value is the model's (the cells its attention, the spread its gradient); nothing is zeroed or edited after the
fact. benchmarks/stem_relevance.py measures it against the rollout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

SMOOTH_PX = 2.0  # Gaussian sigma, in pixels, of the relevance before it is shared out
POWER = 0.5  # the cell's value follows share**POWER (1: the share itself)


def lesion_log_odds(logits: torch.Tensor, task: str, class_names: Sequence[str] | None = None) -> torch.Tensor:
    """``(B,)`` log-odds of P(lesion) as :func:`vit_ct.metrics.lesion_probability.lesion_scores` defines P(lesion),
    from the logits (no saturation where the probability is near 0 or 1): binary ``logit_1 - logit_0``, multi-class
    ``logsumexp(logits_1..) - logit_0``, multi-label the ``any`` label's logit where there is one, else the largest.
    """
    logits = logits.float()
    if task == "binary":
        return logits[:, 1] - logits[:, 0]
    if task == "multiclass":
        return logits[:, 1:].logsumexp(dim=1) - logits[:, 0]
    names = list(class_names or [])
    return logits[:, names.index("any")] if "any" in names else logits.max(dim=1).values


def input_relevance(gradient: torch.Tensor, image: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """``(B, S, S)`` float32: gradient x (input - air), summed over the channels; ``fill`` ``(C,)`` the air level."""
    return (gradient.float() * (image.float() - fill.to(image.device, torch.float32)[:, None, None])).sum(dim=1)


def smooth(maps: torch.Tensor, sigma: float = SMOOTH_PX) -> torch.Tensor:
    """``(B, H, W)`` under a normalised Gaussian of ``sigma`` pixels (separable; zero beyond the edge)."""
    radius = int(3 * sigma)
    taps = torch.arange(-radius, radius + 1, dtype=torch.float32, device=maps.device)
    kernel = torch.exp(-(taps**2) / (2 * sigma**2))
    kernel = kernel / kernel.sum()
    out = F.conv2d(maps[:, None].float(), kernel.view(1, 1, 1, -1), padding=(0, radius))
    return F.conv2d(out, kernel.view(1, 1, -1, 1), padding=(radius, 0))[:, 0]


def _per_cell(values: torch.Tensor, cell: int) -> torch.Tensor:
    """``(B, H, W)`` -> each pixel its ``cell`` x ``cell`` cell's mean."""
    mean = F.avg_pool2d(values[:, None], cell)[:, 0]
    return mean.repeat_interleave(cell, -2).repeat_interleave(cell, -1)


def spread_over_pixels(
    cells: torch.Tensor, relevance: torch.Tensor, *, power: float = POWER, sigma: float = SMOOTH_PX
) -> torch.Tensor:
    """A map on cells brought to the pixels by the relevance (see the module's text).

    Args:
        cells: ``(B, gh, gw)`` map, one value per cell (the rollout on its grid).
        relevance: ``(B, S, S)`` signed relevance per pixel (:func:`input_relevance`), ``S`` a multiple of ``gh``.
        power: the spread follows the share to this power.
        sigma: smoothing of the positive relevance, in pixels (0: none).

    Returns:
        ``(B, S, S)`` float32, non-negative, whose mean over each cell is the cell's value.
    """
    size = relevance.shape[-1]
    if relevance.shape[-2] != size or cells.shape[-1] != cells.shape[-2] or size % cells.shape[-1]:
        raise ValueError(f"relevance {tuple(relevance.shape)} does not tile into the cells {tuple(cells.shape)}")
    cell = size // cells.shape[-1]
    evidence = relevance.float().clamp_min(0)
    evidence = smooth(evidence, sigma) if sigma > 0 else evidence
    weight = evidence**power
    mean = _per_cell(weight, cell)
    tiny = torch.finfo(torch.float32).tiny
    weight = torch.where(mean > tiny, weight / mean.clamp_min(tiny), torch.ones_like(weight))  # mean 1 per cell
    values = cells.float().clamp_min(0).repeat_interleave(cell, -2).repeat_interleave(cell, -1)
    return values * weight
