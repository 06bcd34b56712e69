"""The map read as a segmentation: its half-maximum region, MONAI's Dice, IoU and HD95 against hand-computed values
on small masks, and the perfect patch map (the ceiling the patch grid sets)."""

from __future__ import annotations

import math

import pytest
import torch

from vit_ct.explain.segmentation import half_max_region, perfect_patch_map, segmentation_scores
from vit_ct.metrics.localisation import LocalisationMetrics


def _canvas(*pixels: tuple[int, int], size: int = 12) -> torch.Tensor:
    image = torch.zeros(1, size, size, dtype=torch.bool)
    for r, c in pixels:
        image[0, r, c] = True
    return image


def test_half_max_region_is_over_the_head_only():
    maps = torch.zeros(1, 6, 6)
    maps[0, 1, 1], maps[0, 2, 2], maps[0, 3, 3], maps[0, 0, 5] = 1.0, 0.5, 0.49, 9.0
    head = torch.ones(1, 6, 6, dtype=torch.bool)
    head[0, 0, 5] = False  # the map's largest value lies outside the head: not its maximum
    region = half_max_region(maps, head)
    assert region.nonzero().tolist() == [[0, 1, 1], [0, 2, 2]]
    assert not half_max_region(torch.zeros(1, 6, 6), head).any()  # a map that is zero points nowhere


def test_dice_and_iou_by_hand():
    lesion = torch.zeros(1, 10, 10, dtype=torch.bool)
    lesion[0, 2:4, 2:5] = True  # 6 pixels
    maps = torch.zeros(1, 10, 10)
    maps[0, 3:5, 3:5] = 1.0  # 4 pixels, 2 of them on the lesion
    head = torch.ones_like(lesion)
    scores = segmentation_scores(maps, lesion, head, torch.tensor([1.0]))
    assert scores["dice"].item() == pytest.approx(2 * 2 / (6 + 4))
    assert scores["iou"].item() == pytest.approx(2 / 8)


def test_hd95_in_mm_by_hand():
    # map region {(5, 8)}, lesion {(5, 5), (5, 6)}: map -> lesion [2] px, lesion -> map [3, 2] px; the symmetric
    # 95th percentile is max(2, 2 + 0.95 * (3 - 2)) = 2.95 px, at 0.5 mm per pixel 1.475 mm
    maps = _canvas((5, 8)).float()
    lesion = _canvas((5, 5), (5, 6))
    scores = segmentation_scores(maps, lesion, torch.ones_like(lesion), torch.tensor([0.5]))
    assert scores["hd95_mm"].item() == pytest.approx(2.95 * 0.5)
    assert scores["dice"].item() == 0


def test_a_map_pointing_nowhere_scores_zero_dice_and_no_distance():
    lesion = _canvas((5, 5))
    scores = segmentation_scores(torch.zeros(1, 12, 12), lesion, torch.ones_like(lesion), torch.tensor([1.0]))
    assert scores["dice"].item() == 0 and scores["iou"].item() == 0 and math.isnan(scores["hd95_mm"].item())


def test_perfect_patch_map_pools_then_upsamples_bilinearly():
    lesion = torch.zeros(1, 4, 4, dtype=torch.bool)
    lesion[0, :2, :2] = True  # the top-left cell of a 2 x 2 patch grid
    # align_corners=False: output pixel i samples the grid at (i + 0.5) / 2 - 0.5 = -0.25, 0.25, 0.75, 1.25 (clamped)
    weights = torch.tensor([1.0, 0.75, 0.25, 0.0])
    torch.testing.assert_close(perfect_patch_map(lesion, (2, 2))[0], torch.outer(weights, weights))
    half = torch.zeros(1, 4, 4, dtype=torch.bool)
    half[0, 0, :2] = True  # half of the top-left cell
    assert perfect_patch_map(half, (2, 2))[0, 0, 0] == pytest.approx(0.5)
    torch.testing.assert_close(perfect_patch_map(lesion, (4, 4)), lesion.float())  # one pixel per patch: the mask


def test_metric_averages_and_leaves_hd95_to_the_slices_where_it_exists():
    lesion = torch.zeros(2, 12, 12)
    lesion[:, 5, 5:7] = 1
    maps = torch.zeros(2, 12, 12)
    maps[0, 5, 8] = 1.0  # HD95 2.95 px, Dice 0
    maps[1, 5, 5:7] = 1.0  # the lesion itself: Dice 1, HD95 0
    metric = LocalisationMetrics(pixel_spacing_mm=2.0)
    metric.update(maps, lesion)
    values = metric.compute()
    assert values["dice"].item() == pytest.approx(0.5) and values["iou"].item() == pytest.approx(0.5)
    assert values["hd95_mm"].item() == pytest.approx(2.95 * 2.0 / 2)
    assert values["hd95_slices"].item() == 2
    maps[1] = 0  # now it points nowhere: Dice 0, and no distance to average
    metric.reset()
    metric.update(maps, lesion)
    values = metric.compute()
    assert values["dice"].item() == 0 and values["hd95_mm"].item() == pytest.approx(2.95 * 2.0)
    assert values["hd95_slices"].item() == 1
    assert "hd95_mm" not in LocalisationMetrics(surface_distance=False).compute()
