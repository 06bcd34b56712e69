"""Shifted-grid rollout (vit_ct.explain.shifted): maps on a grid finer than the patches, read from the model itself."""

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import DEMO_LEVERS

from vit_ct.explain.map_reading import MapReading
from vit_ct.explain.maps import Explained, rollout_with_output, upsample
from vit_ct.explain.shifted import air_level, combine_shifted, grid_offsets, shift_image, shifted_explained
from vit_ct.metrics.schema import PREDICTIONS, REVIEW
from vit_ct.task import ViTClassifier
from vit_ct.task.inference import infer
from vit_ct.task.reading import ReadMaps

PATCH = 16


def _patch_mean_model(image: torch.Tensor) -> Explained:
    """A stand-in whose "rollout" is each patch's mean of the first channel: a known function of its input."""
    rollout = F.avg_pool2d(image[:, :1], PATCH)[:, 0]
    return Explained(output=rollout.flatten(1).sum(1, keepdim=True), rollout=rollout, class_attention=rollout[:, None])


def test_grid_offsets_are_every_fraction_of_a_patch_the_unshifted_first():
    assert grid_offsets(16, 1) == [(0, 0)]
    assert grid_offsets(16, 2) == [(0, 0), (0, 8), (8, 0), (8, 8)]
    assert grid_offsets(16, 4)[:5] == [(0, 0), (0, 4), (0, 8), (0, 12), (4, 0)] and len(grid_offsets(16, 4)) == 16
    for bad in (0, 3, 5):
        with pytest.raises(ValueError, match="map_shifts"):
            grid_offsets(16, bad)


def test_shift_moves_the_content_and_fills_with_each_windows_air():
    image = torch.arange(2 * 4 * 4, dtype=torch.float32).reshape(1, 2, 4, 4)
    shifted = shift_image(image, 1, 2, torch.tensor([0.0, 0.25]))
    assert torch.equal(shifted[0, :, 1:, 2:], image[0, :, :3, :2])
    assert (shifted[0, 0, 0] == 0).all() and (shifted[0, 0, :, :2] == 0).all()
    assert (shifted[0, 1, 0] == 0.25).all() and (shifted[0, 1, :, :2] == 0.25).all()
    # air (-1000 HU) through the windows: 0 in brain and subdural, above 0 in a window reaching below -1000 HU
    torch.testing.assert_close(air_level([(40, 80), (80, 200), (-600, 1500)], 3), torch.tensor([0.0, 0.0, 350 / 1500]))
    assert torch.equal(air_level(None, 2), torch.zeros(2))


def test_a_known_pattern_comes_back_on_the_half_patch_grid_aligned_to_the_pixel():
    """One bright 8 x 8 cell (rows 24-31, columns 32-39 of a 64 x 64 slice): one pass sees only its 16 x 16 patch; the
    four passes shifted by 0 / 8 px put the peak on the cell itself. Worked by hand: in y the cell is row 3 of 8
    cells; unshifted, patch rows pair cells {2,3}, shifted by 8 px {3,4}: cell row 2 shares a patch with it in one
    pass of two, row 3 in both, row 4 in one; in x (cell column 4): {4,5} and {3,4}. Each patch's mean is 64/256."""
    image = torch.zeros(1, 1, 64, 64)
    image[..., 24:32, 32:40] = 1.0
    explained = shifted_explained(_patch_mean_model, image, patch_size=PATCH, shifts=2, fill=torch.zeros(1))
    in_y = torch.tensor([0, 0, 0.5, 1, 0.5, 0, 0, 0])
    in_x = torch.tensor([0, 0, 0, 0.5, 1, 0.5, 0, 0])
    torch.testing.assert_close(explained.rollout[0], 0.25 * torch.outer(in_y, in_x))
    # one pass: the patch (rows 16-31, columns 32-47) is flat, 4 times the cell's area
    single = _patch_mean_model(image).rollout
    assert single[0, 1, 2] == 0.25 and (single[0].flatten() > 0).sum() == 1
    # on the pixels: the maximum of the finer map, upsampled as every rollout is, lies in the bright cell
    heat = upsample(explained.rollout, (64, 64))[0]
    top = (heat == heat.max()).nonzero()
    assert top[:, 0].min() >= 24 and top[:, 0].max() < 32 and top[:, 1].min() >= 32 and top[:, 1].max() < 40
    assert len(explained.shifted_outputs) == 3


def test_the_far_edge_a_shift_drops_is_averaged_over_the_passes_that_saw_it():
    maps = [torch.full((1, 2, 2), float(v)) for v in (1, 2, 3, 4)]  # passes (0,0), (0,8), (8,0), (8,8)
    fine = combine_shifted(maps, 16, 2)[0]
    assert fine[0, 0] == 2.5  # every pass
    assert fine[3, 0] == 1.5  # the last row of cells: only the passes not shifted in y
    assert fine[0, 3] == 2.0  # the last column: only those not shifted in x
    assert fine[3, 3] == 1.0  # the corner: the unshifted pass alone


def test_one_pass_is_the_plain_rollout_exactly():
    torch.manual_seed(0)
    maps = torch.rand(2, 3, 3)
    assert torch.equal(combine_shifted([maps], 16, 1), maps)
    model = ViTClassifier.from_hparams(
        **DEMO_LEVERS, img_size=32, in_chans=1, embed_dim=32, depth=2, num_heads=2
    ).eval()
    image = torch.rand(2, 1, 32, 32)
    logits, plain = rollout_with_output(model, image)
    explained = model.explained(image)
    assert torch.equal(explained.rollout, plain) and torch.equal(explained.output, logits)
    assert explained.shifted_outputs == ()


def test_a_model_whose_map_does_not_move_with_the_shift_gives_its_plain_rollout():
    """A stand-in whose map is its input's mean everywhere: with the slice's edge in air (0), every shifted pass
    sees the same mean, so the combined map, on the finer grid and on the pixels, is the plain one."""

    def uniform(image: torch.Tensor) -> Explained:
        rollout = image[:, 0].mean(dim=(1, 2))[:, None, None].expand(-1, 3, 3).clone()
        return Explained(rollout.sum((1, 2))[:, None], rollout, rollout[:, None])

    torch.manual_seed(0)
    image = torch.zeros(2, 1, 48, 48)
    image[..., 4:36, 6:36] = torch.rand(2, 1, 32, 30)  # the last 12 rows and columns are air: no shift drops a head
    for shifts in (2, 4):
        combined = shifted_explained(uniform, image, patch_size=PATCH, shifts=shifts, fill=torch.zeros(1)).rollout
        assert combined.shape == (2, 3 * shifts, 3 * shifts)
        plain = uniform(image).rollout
        torch.testing.assert_close(upsample(combined, (48, 48)), upsample(plain, (48, 48)), rtol=1e-6, atol=0)


def _ct_batch(B=3, size=64):
    torch.manual_seed(1)
    image = torch.zeros(B, 1, size, size)
    image[..., 24:56, 10:54] = torch.rand(B, 1, 32, 44)  # a head in air
    head = (image > 0).float()
    mask = torch.zeros(B, 1, size, size)
    mask[:, :, 30:37, 30:36] = 1
    return {"image": image, "head": head, "mask": mask, "has_mask": torch.tensor([True] * B),
            "label": torch.tensor([1] * B), "index": torch.arange(B),
            "source_shape": torch.tensor([[size, size]] * B), "pixel_spacing_mm": torch.full((B,), 0.9)}  # fmt: skip


def test_the_vit_read_over_shifted_grids_end_to_end():
    """The real network (air patches skip the blocks): the map is the four passes' rollouts over the shifted slices,
    combined; P(lesion) stays the unshifted pass's, prob_tta is the mean over the four; the ceiling of the finer grid
    is scored beside the patch grid's."""
    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(**DEMO_LEVERS, img_size=64, in_chans=1, embed_dim=32, depth=2, num_heads=2)
    model.eval()
    assert model.vit.mask_air and not hasattr(model, "map_shifts")  # chosen per command, handed to each step
    batch = _ct_batch()
    inference = infer(model, batch, MapReading(shifts=2))
    assert inference.rollout.shape == (3, 8, 8)
    passes = [rollout_with_output(model, shift_image(batch["image"], dy, dx, torch.zeros(1))) for dy, dx in
              grid_offsets(PATCH, 2)]  # fmt: skip
    torch.testing.assert_close(inference.rollout, combine_shifted([m for _, m in passes], PATCH, 2))
    probs = torch.stack([model.probabilities(logits) for logits, _ in passes])
    torch.testing.assert_close(inference.prob, probs[0])
    torch.testing.assert_close(inference.prob_tta, probs.mean(0))
    # cells that only air patches covered in every pass keep no attention (air is air in the shifted passes too): the
    # head starts at row 24, so cell rows 0 and 1 (pixels 0-15) lay in air patches in every pass (pixels -8-23)
    assert (inference.rollout[:, :2] == 0).all() and (inference.rollout[:, 2] > 0).any()
    row = inference.probabilities(0, model.class_names)
    assert list(row) == [PREDICTIONS.prob, PREDICTIONS.prob_tta]
    assert {"rollout_dice", "perfect_patch_dice", "perfect_grid_dice", "perfect_grid_hd95_mm"} <= set(inference.scores)
    # the finer grid's ceiling is at least as sharp as the patch grid's on a lesion smaller than a patch
    assert inference.scores["perfect_grid_dice"][0] > inference.scores["perfect_patch_dice"][0]
    assert inference.sink["cls_air"].shape == (3, 2) and 0 <= float(inference.sink["rollout_air"][0]) <= 1
    single = infer(model, batch)  # one pass unless told
    assert single.prob_tta is None and "perfect_grid_dice" not in single.scores and single.rollout.shape == (3, 4, 4)
    assert list(single.probabilities(0, model.class_names)) == [PREDICTIONS.prob]
    torch.testing.assert_close(single.prob, inference.prob)


def test_test_metrics_score_the_finer_map_and_both_ceilings():
    """The trainer's reading (its ReadMaps callback, as the command adds it) reaches the test step; a trainer without
    one reads one pass, with no grid ceiling."""
    from conftest import quiet_trainer

    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(**DEMO_LEVERS, img_size=64, in_chans=1, embed_dim=32, depth=2, num_heads=2)
    loader = torch.utils.data.DataLoader([_ct_batch()], batch_size=None)
    quiet_trainer(callbacks=[ReadMaps(MapReading(shifts=2))]).test(model, dataloaders=loader, verbose=False)
    logged = {k: float(v) for k, v in model.trainer.callback_metrics.items()}
    assert {"test/rollout_dice", "test/perfect_patch_dice", "test/perfect_grid_dice"} <= set(logged)
    assert logged["test/perfect_grid_dice"] > logged["test/perfect_patch_dice"]
    quiet_trainer().test(model, dataloaders=loader, verbose=False)
    assert "test/perfect_grid_dice" not in model.trainer.callback_metrics


def test_map_shifts_must_divide_the_patch():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="map_shifts"):
            MapReading(shifts=bad)
    with pytest.raises(ValueError, match="dividing patch_size"):
        MapReading(shifts=3).check(16)
    model = ViTClassifier.from_hparams(
        **DEMO_LEVERS, img_size=32, in_chans=1, embed_dim=32, depth=1, num_heads=2
    ).eval()
    with pytest.raises(ValueError, match="map_shifts"):
        model.explained(torch.zeros(1, 1, 32, 32), reading=MapReading(shifts=3))


def test_predict_writes_prob_tta_and_the_finer_ceiling_and_the_review_reads_the_same(synthetic_set, tmp_path):
    """``vit-ct predict``'s writer and the review over the same shifted passes: predictions.csv's header is the
    schema's with ``prob_tta`` and ``perfect_grid``; the review table has the same values, and its summary a
    ``perfect_grid`` row beside ``perfect_patch``."""
    from conftest import quiet_trainer

    from vit_ct import review
    from vit_ct.metrics.localisation import SCORES, SURFACE_DISTANCE_SOURCES
    from vit_ct.predict.writer import PredictionWriter

    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(**DEMO_LEVERS, img_size=32, in_chans=2, embed_dim=32, depth=2, num_heads=2)
    model.eval()
    windows = {"data": {"init_args": {"windows": ["brain", "subdural"]}}}
    data = review.review_datamodule(model, synthetic_set, split="test", batch_size=3, config=windows)
    reading = ReadMaps(MapReading(shifts=2))
    quiet_trainer(callbacks=[PredictionWriter(tmp_path / "out"), reading]).predict(model, datamodule=data)
    written = pd.read_csv(tmp_path / "out" / PREDICTIONS.file, float_precision="round_trip")
    kept = [s for s in SCORES if s != "hd95_px"]  # every synthetic slice has a pixel spacing
    assert list(written.columns) == PREDICTIONS.header(
        task="binary", class_names=model.class_names, labels=True, scan=True, frame=False, mask=True, blocks=2,
        sources=SURFACE_DISTANCE_SOURCES, scores=kept, tta=True,
    )  # fmt: skip
    assert written[PREDICTIONS.prob_tta].between(0, 1).all() and written["perfect_grid_dice"].notna().any()
    maps = np.load(tmp_path / "out" / written[PREDICTIONS.rollout].iloc[0])
    assert maps.shape == (64, 64)  # the source slice's grid, as ever
    table = review.run_review(model, data, progress=False, reading=MapReading(shifts=2))
    shared = [PREDICTIONS.score(s, name) for s in SURFACE_DISTANCE_SOURCES for name in kept]
    assert np.array_equal(written[shared].to_numpy(), table[shared].to_numpy(), equal_nan=True)
    assert table[REVIEW.rollout].iloc[0].shape == (4, 4)  # 32 px, 8-px cells
    summary = review.localisation_summary(table)
    assert {"rollout", "perfect_patch", "perfect_grid"} <= set(summary.index)
    assert summary.loc["perfect_grid", "dice"] >= summary.loc["perfect_patch", "dice"]


def test_a_checkpoint_does_not_carry_how_its_maps_are_read(tmp_path):
    torch.manual_seed(0)
    built = dict(DEMO_LEVERS, img_size=32, in_chans=1, embed_dim=32, depth=1, num_heads=2)
    model = ViTClassifier.from_hparams(**built)
    assert not {"map_shifts", "map_pixels"} & set(model.hparams)
    path = tmp_path / "k.ckpt"
    contract = {"img_size": 32, "patch_size": 16, "in_chans": 1, "windows": [[40.0, 80.0]],
                "read_options": {"modalities": ["CT"], "stored_values_are_hu": False}}  # fmt: skip
    checkpoint = {"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams), "vit_ct_input": contract}
    torch.save({**checkpoint, "pytorch-lightning_version": "2.6.0", "hparams_name": "kwargs"}, path)
    loaded = ViTClassifier.load_from_checkpoint(path)
    assert not hasattr(loaded, "map_shifts") and not {"map_shifts", "map_pixels"} & set(loaded.hparams)
