"""Occlusion sensitivity (Zeiler & Fergus 2014) through ``monai.visualize.OcclusionSensitivity``: how much the
score falls when one patch of the slice is replaced by normal brain. A baseline that needs nothing from the model
but its output, so it reads any classifier; one forward pass per patch of the grid.

The occluded patch is set to the slice's brain baseline, not to a constant: every head pixel at 30 HU (grey/white
matter average, below fresh blood at 50-90 HU) windowed as the input is, air left as air. An occluded patch then
loses exactly the hyperdensity that marks a bleed and gains no new edge, the same baseline as the deletion curves of
the faithfulness benchmark. MONAI occludes with a constant, so the model is run on the slice minus its baseline and
the baseline added back inside: occluding with 0 is occluding with normal brain.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from monai.utils import convert_to_tensor
from monai.visualize import OcclusionSensitivity
from torch import nn

from vit_ct.data.transforms.windows import window_hu

BASELINE_HU = 30.0  # normal brain


def brain_baseline(image: torch.Tensor, head: torch.Tensor, windows: Sequence[tuple[float, float]]) -> torch.Tensor:
    """The slice with every head pixel at :data:`BASELINE_HU`, windowed per channel; ``(B, C, S, S)`` from the image
    and its ``(B, 1, S, S)`` head mask. A model with context reads ``windows`` for each of three slices: its
    neighbours' channels take the baseline at the same pixels."""
    fill = torch.stack([window_hu(torch.tensor(BASELINE_HU), c, w) for c, w in windows]).float()  # (C,) in [0, 1]
    fill = fill.repeat(image.shape[1] // len(windows))
    return torch.where(head > 0.5, fill[None, :, None, None].to(image), image)


class _FromBaseline(nn.Module):
    """``score(x + baseline)`` as a one-channel output: MONAI's occluded zeros become the baseline."""

    def __init__(self, score: Callable[[torch.Tensor], torch.Tensor], baseline: torch.Tensor) -> None:
        super().__init__()
        self.score, self.baseline = score, baseline

    def forward(self, shifted: torch.Tensor) -> torch.Tensor:
        return self.score(shifted + self.baseline)[:, None]


def occlusion_sensitivity(
    score: Callable[[torch.Tensor], torch.Tensor],
    image: torch.Tensor,
    baseline: torch.Tensor,
    *,
    patch_size: int,
    n_batch: int = 64,
) -> torch.Tensor:
    """``(B, gh, gw)``: the score of the intact slice minus the score with each patch at the baseline (larger = the
    patch mattered more; negative where hiding it raised the score).

    Args:
        score: Images ``(N, C, S, S)`` -> ``(N,)`` scores (e.g. P(lesion)); run without gradients.
        image: ``(B, C, S, S)`` model input.
        baseline: ``(B, C, S, S)``, e.g. :func:`brain_baseline`.
        patch_size: Side of the occluded square, in pixels: the model's patch, so the map is on its patch grid
            (patches do not overlap: one forward pass per patch).
        n_batch: Occluded copies per forward batch.
    """
    grid = (image.shape[-2] // patch_size, image.shape[-1] // patch_size)
    maps = []
    with torch.no_grad():
        for one, base in zip(image.split(1), baseline.split(1), strict=True):
            occlusion = OcclusionSensitivity(
                _FromBaseline(score, base), mask_size=patch_size, n_batch=n_batch, verbose=False, mode=0.0,
                overlap=0.0, activate=False,
            )  # fmt: skip
            with warnings.catch_warnings():  # MONAI 1.6 indexes with a list, which torch warns about
                warnings.filterwarnings("ignore", message="Using a non-tuple sequence", category=UserWarning)
                occluded, _ = occlusion(one - base)  # (1, 1, S, S): the score with the patch under each pixel hidden
            occluded = convert_to_tensor(occluded, track_meta=False)  # a plain tensor, not MONAI's MetaTensor
            drop = score(one).float()[:, None, None, None] - occluded.float()
            maps.append(F.adaptive_avg_pool2d(drop, grid)[:, 0])  # constant over each patch
    return torch.cat(maps)
