"""Localisation metrics of attention maps against lesion masks: hand-made maps, sklearn's AUROC, DDP merging."""

import numpy as np
import pytest
import torch
from conftest import DEMO_LEVERS
from sklearn.metrics import roc_auc_score

from vit_ct.explain.maps import localisation_maps
from vit_ct.explain.segmentation import perfect_patch_map
from vit_ct.metrics.localisation import LocalisationMetrics, model_grid_spacing_mm, pixel_auroc
from vit_ct.task import ViTClassifier

torch.set_num_threads(1)
SIZE = 16


def _case():
    """(1, 16, 16) lesion square inside a head disk."""
    y, x = torch.meshgrid(torch.arange(SIZE), torch.arange(SIZE), indexing="ij")
    head = (((y - 7.5) ** 2 + (x - 7.5) ** 2) <= 7.5**2).float()[None]
    mask = torch.zeros(1, SIZE, SIZE)
    mask[0, 4:7, 5:9] = 1
    return mask, head


def _scores(maps, mask, head, **kwargs):
    metric = LocalisationMetrics(tolerance_mm=kwargs.pop("tolerance_mm", 0.0), pixel_spacing_mm=1.0)
    metric.update(maps, mask, head, **kwargs)
    return {k: v.item() for k, v in metric.compute().items()}


def test_perfect_map_scores_one():
    mask, head = _case()
    s = _scores(mask.clone(), mask, head)
    assert s["pointing"] == 1 and s["energy"] == 1 and s["pixel_auroc"] == 1 and s["slices"] == 1
    assert s["mask_fraction"] == pytest.approx(12 / head.sum().item())
    assert s["energy_ratio"] == pytest.approx(1 / s["mask_fraction"])


def test_inverted_map_scores_zero():
    mask, head = _case()
    s = _scores(1 - mask, mask, head)
    assert s["pixel_auroc"] == 0 and s["energy"] == 0 and s["pointing"] == 0


def test_constant_map_scores_chance_not_luck():
    mask, head = _case()
    s = _scores(torch.full_like(mask, 0.3), mask, head)
    assert s["pixel_auroc"] == pytest.approx(0.5)
    assert s["energy"] == pytest.approx(s["mask_fraction"]) and s["energy_ratio"] == pytest.approx(1.0)
    # every head pixel ties for the maximum: the score is the share of them on the lesion (tolerance 0)
    assert s["pointing"] == pytest.approx(12 / head.sum().item())
    # a map that is zero over the head says nothing either
    assert _scores(torch.zeros_like(mask), mask, head)["energy"] == pytest.approx(s["mask_fraction"])


def test_only_head_pixels_count():
    mask, head = _case()
    maps = mask.clone()
    maps[0, 0, 0] = 100.0  # outside the head disk: ignored by every score
    s = _scores(maps, mask, head)
    assert s["pointing"] == 1 and s["energy"] == 1 and s["pixel_auroc"] == 1


def test_pixel_auroc_equals_sklearn_with_ties():
    g = torch.Generator().manual_seed(0)
    maps = torch.randint(0, 5, (8, 12, 12), generator=g).float()  # many ties
    maps[:4] += torch.rand(4, 12, 12, generator=g)  # and some without
    head = torch.rand(8, 12, 12, generator=g) < 0.8
    lesion = (torch.rand(8, 12, 12, generator=g) < 0.25) & head
    ours = pixel_auroc(maps, lesion, head)
    for b in range(8):
        inside = head[b]
        expected = roc_auc_score(lesion[b][inside].numpy(), maps[b][inside].numpy())
        assert ours[b].item() == pytest.approx(expected, abs=1e-12)


def test_slices_without_mask_or_lesion_are_ignored():
    mask, head = _case()
    perfect = _scores(mask.clone(), mask, head)
    maps = torch.cat([mask, 1 - mask, torch.rand(1, SIZE, SIZE)])  # wrong maps on the slices to skip
    masks = torch.cat([mask, mask, torch.zeros(1, SIZE, SIZE)])  # slice 2: negative, empty mask
    heads = head.expand(3, SIZE, SIZE)
    known = torch.tensor([True, False, True])  # slice 1: mask unknown
    np.testing.assert_equal(_scores(maps, masks, heads, known=known), perfect)  # (hd95_px: NaN in both)


def test_pointing_tolerance_in_mm():
    mask = torch.zeros(1, SIZE, SIZE)
    mask[0, 8, 4:7] = 1
    maps = torch.zeros(1, SIZE, SIZE)
    maps[0, 8, 8] = 1.0  # the maximum, 2 pixels right of the lesion
    head = torch.ones_like(mask)
    assert _scores(maps, mask, head, tolerance_mm=3.0)["pointing"] == 1
    assert _scores(maps, mask, head, tolerance_mm=1.0)["pointing"] == 0
    # 2 pixels of 1.5 mm = 3 mm: in with 3 mm, out with 2.9 mm; spacing per slice overrides the constructor's
    assert _scores(maps, mask, head, tolerance_mm=3.0, pixel_spacing_mm=torch.tensor([1.5]))["pointing"] == 1
    assert _scores(maps, mask, head, tolerance_mm=2.9, pixel_spacing_mm=1.5)["pointing"] == 0
    # a batch's NaN (a file without spacing) falls back to the constructor's spacing
    unknown = torch.tensor([float("nan")])
    assert _scores(maps, mask, head, tolerance_mm=3.0, pixel_spacing_mm=unknown)["pointing"] == 1  # 1 mm default
    metrics = LocalisationMetrics(tolerance_mm=3.0, pixel_spacing_mm=2.0)
    metrics.update(maps, mask, head, pixel_spacing_mm=unknown)
    assert float(metrics.compute()["pointing"]) == 0  # 2 pixels of 2 mm = 4 mm > 3 mm
    maps[0, 10, 6] = 1.0  # a tie 2 pixels below the lesion: in
    maps[0, 2, 14] = 1.0  # a far tie
    assert _scores(maps, mask, head, tolerance_mm=2.0)["pointing"] == pytest.approx(2 / 3)


def test_states_merge_like_ddp():
    g = torch.Generator().manual_seed(1)
    mask, head = _case()
    masks = mask.expand(6, SIZE, SIZE).clone()
    masks[1] = 0  # a negative
    maps = torch.rand(6, SIZE, SIZE, generator=g)
    whole, first, second = (LocalisationMetrics(tolerance_mm=2.0, pixel_spacing_mm=1.0) for _ in range(3))
    whole.update(maps, masks, head.expand(6, SIZE, SIZE))
    first.update(maps[:4], masks[:4], head.expand(4, SIZE, SIZE))
    second.update(maps[4:], masks[4:], head.expand(2, SIZE, SIZE))
    assert all(whole._reductions[name] is not None for name in LocalisationMetrics.STATES)
    first.merge_state(second)
    for key, value in whole.compute().items():
        torch.testing.assert_close(first.compute()[key], value, equal_nan=True)
    assert whole.compute()["slices"] == 5


def test_nothing_scored_is_nan():
    metric = LocalisationMetrics()
    metric.update(torch.rand(2, 8, 8), torch.zeros(2, 8, 8))  # negatives only
    values = metric.compute()
    assert values["slices"] == 0 and np.isnan(values["pointing"].item()) and np.isnan(values["pixel_auroc"].item())


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="share one"):
        LocalisationMetrics().update(torch.rand(2, 8, 8), torch.rand(2, 1, 8, 8))


def _tiny_batch(B=4, size=32):
    mask = torch.zeros(B, 1, size, size)
    mask[::2, :, 8:14, 10:16] = 1
    head = torch.zeros(B, 1, size, size)
    head[:, :, 2:30, 2:30] = 1
    return {
        "image": torch.rand(B, 1, size, size),
        "mask": mask,
        "head": head,
        "has_mask": torch.tensor([True, True, False, True]),
        "label": torch.tensor([1, 0, 1, 0]),
        "index": torch.arange(B),
        "source_shape": torch.tensor([[size, size]] * B),
    }


def test_maps_on_the_model_grid():
    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(
        **DEMO_LEVERS, img_size=32, in_chans=1, embed_dim=32, depth=2, num_heads=2
    ).eval()
    batch = _tiny_batch()
    maps = localisation_maps(model, batch)
    assert {k: tuple(v.shape) for k, v in maps.items()} == {
        k: (4, 32, 32) for k in ("rollout", "floor_image", "floor_head", "perfect_patch")
    }
    assert maps["rollout"].min() >= 0 and maps["rollout"].std() > 0
    torch.testing.assert_close(maps["floor_image"], batch["image"][:, 0])
    torch.testing.assert_close(maps["floor_head"], batch["head"][:, 0])
    torch.testing.assert_close(maps["perfect_patch"], perfect_patch_map(batch["mask"][:, 0] > 0.5, (2, 2)))  # 16 px


def test_model_scores_positive_slices_with_masks():
    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(
        **DEMO_LEVERS, img_size=32, in_chans=1, embed_dim=32, depth=2, num_heads=2
    ).eval()
    with torch.no_grad(), pytest.warns(UserWarning, match="self.log"):  # no trainer attached: logging is skipped
        model.validation_step(_tiny_batch(), 0)
    localisation = model.map_metrics["val"].localisation
    assert localisation["rollout"].compute()["slices"] == 1  # slice 0: 2 has no mask, 1 and 3 are empty
    head = localisation["floor_head"].compute()
    assert head["pixel_auroc"] == pytest.approx(0.5) and head["energy_ratio"] == pytest.approx(1.0)
    assert model_grid_spacing_mm(32) == pytest.approx(230 / 32)
