"""A map read as a segmentation: the region over half its maximum, scored against the lesion mask with MONAI's
metrics (Dice, IoU and the 95th-percentile Hausdorff distance in mm), the numbers weakly supervised segmentation
papers report; and the perfect patch map, the best any map on the model's patch grid can do.

A map is thresholded over the head only, at half of its maximum over the head: the rule needs no tuning per model
and does not change when the map is scaled. The perfect patch map is the lesion mask averaged over each patch and
brought back to the slice grid as every map is (bilinearly): its Dice is the ceiling the patch size sets.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from monai.metrics import compute_dice, compute_hausdorff_distance, compute_iou

HALF_MAX = 0.5  # share of the map's maximum over the head above which a pixel is in the map's region


def half_max_region(maps: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """``(B, H, W)`` bool: the head pixels where the map reaches half its maximum over the head; empty where the map
    is zero over the whole head (it points nowhere)."""
    maps = maps.float().masked_fill(~head, 0).clamp_min(0)
    top = maps.amax(dim=(1, 2), keepdim=True)
    return head & (maps >= HALF_MAX * top) & (top > 0)


def perfect_patch_map(lesion: torch.Tensor, grid: tuple[int, int] | torch.Size) -> torch.Tensor:
    """``(B, H, W)`` float: the lesion's share of each cell of the ``grid`` (the model's patch grid), bilinearly
    upsampled to the slice grid as the rollout is."""
    size = lesion.shape[-2:]
    pooled = F.adaptive_avg_pool2d(lesion[:, None].float(), tuple(grid))
    return F.interpolate(pooled, size=size, mode="bilinear", align_corners=False)[:, 0].clamp_min(0)


def segmentation_scores(
    maps: torch.Tensor,
    lesion: torch.Tensor,
    head: torch.Tensor,
    spacing_mm: torch.Tensor,
    *,
    surface_distance: bool = True,
) -> dict[str, torch.Tensor]:
    """Dice, IoU and HD95 of each map's half-maximum region against its lesion (``monai.metrics``).

    Args:
        maps: ``(B, H, W)`` float.
        lesion: ``(B, H, W)`` bool, within the head, not empty.
        head: ``(B, H, W)`` bool.
        spacing_mm: ``(B,)`` pixel size in mm.
        surface_distance: Also the 95th-percentile symmetric Hausdorff distance (the costly one).

    Returns:
        ``dice`` and ``iou`` ``(B,)`` float64 (0 where the map points nowhere), and with ``surface_distance``
        ``hd95_mm`` ``(B,)`` float64 (NaN where the map points nowhere: no distance exists).
    """
    region = half_max_region(maps, head)[:, None].float()  # MONAI's (B, C, H, W)
    truth = lesion[:, None].float()
    scores = {
        "dice": compute_dice(region, truth, include_background=True, ignore_empty=False)[:, 0].double(),
        "iou": compute_iou(region, truth, include_background=True, ignore_empty=False)[:, 0].double(),
    }
    if surface_distance:
        hd95 = torch.full((len(maps),), float("nan"), dtype=torch.float64, device=maps.device)
        pointed = region.flatten(1).any(dim=1)
        if pointed.any():
            spacing = [[float(s), float(s)] for s in spacing_mm[pointed].tolist()]
            with warnings.catch_warnings():  # MONAI 1.5-1.6 warn about an argument their own code passes
                warnings.simplefilter("ignore", FutureWarning)
                distance = compute_hausdorff_distance(
                    region[pointed].cpu(), truth[pointed].cpu(), include_background=True, percentile=95,
                    spacing=spacing,
                )  # fmt: skip
            hd95[pointed] = distance[:, 0].double().to(maps.device)
        scores["hd95_mm"] = hd95
    return scores
