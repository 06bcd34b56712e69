"""Maps down to the pixel (vit_ct.explain.pixels, ``--map_pixels``): each cell of the rollout spread over its
pixels by the gradient x input through the stem, checked by hand and against autograd on the real network."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEMO_LEVERS

from vit_ct.explain.map_reading import MapReading
from vit_ct.explain.maps import Explained
from vit_ct.explain.pixels import input_relevance, lesion_log_odds, smooth, spread_over_pixels
from vit_ct.explain.shifted import shift_back_mean, shifted_explained
from vit_ct.task import ViTClassifier
from vit_ct.task.inference import infer
from vit_ct.task.reading import ReadMaps


def test_each_cell_is_spread_by_its_relevance_by_hand_and_keeps_its_mean():
    """A 4 x 4 slice of four 2 x 2 cells, no smoothing. Cell (0, 0): relevance only on its first pixel -> all of the
    cell there (4 x its value). Cell (0, 1): positive relevance 4 and 1 -> square roots 2 and 1, mean 3/4 -> weights
    8/3 and 4/3 (share 4/5 and 1/5 at power 1: 16/5 and 4/5). Cell (1, 0): no positive relevance -> flat. Cell
    (1, 1): flat relevance -> flat."""
    cells = torch.tensor([[[2.0, 3.0], [5.0, 7.0]]])
    relevance = torch.tensor([[[1.0, 0, 4, 1], [0, 0, 0, -3], [-1, -2, 2, 2], [0, -5, 2, 2]]])
    spread = spread_over_pixels(cells, relevance, sigma=0)
    expected = torch.tensor([[[8.0, 0, 8, 4], [0, 0, 0, 0], [5, 5, 7, 7], [5, 5, 7, 7]]])  # 2 * 4; 3 * 8/3, 3 * 4/3
    torch.testing.assert_close(spread, expected)
    torch.testing.assert_close(F.avg_pool2d(spread[:, None], 2)[:, 0], cells)
    linear = spread_over_pixels(cells, relevance, sigma=0, power=1.0)
    torch.testing.assert_close(linear[0, 0, 2:], torch.tensor([3 * 16 / 5, 3 * 4 / 5]))
    with pytest.raises(ValueError, match="tile"):
        spread_over_pixels(cells, torch.zeros(1, 5, 5))


def test_smoothing_is_a_normalised_gaussian():
    delta = torch.zeros(1, 21, 21)
    delta[0, 10, 10] = 1.0
    blurred = smooth(delta, 2.0)
    torch.testing.assert_close(blurred.sum(), torch.tensor(1.0))
    assert blurred[0].argmax() == 10 * 21 + 10
    torch.testing.assert_close(blurred[0], blurred[0].T)
    ratio = blurred[0, 10, 12] / blurred[0, 10, 10]  # two pixels off: exp(-4 / 8)
    torch.testing.assert_close(ratio, torch.exp(torch.tensor(-0.5)))


def test_the_lesion_log_odds_is_that_of_p_lesion():
    torch.manual_seed(0)
    logits = torch.randn(5, 4)
    p = logits[:, :2].softmax(-1)[:, 1]
    torch.testing.assert_close(lesion_log_odds(logits[:, :2], "binary"), torch.logit(p))
    p = 1 - logits.softmax(-1)[:, 0]  # multi-class: P(lesion) = 1 - P(class 0)
    torch.testing.assert_close(lesion_log_odds(logits, "multiclass"), torch.logit(p), rtol=1e-5, atol=1e-5)
    names = ["epidural", "any", "subdural", "sah"]
    torch.testing.assert_close(lesion_log_odds(logits, "multilabel", names), logits[:, 1])
    torch.testing.assert_close(lesion_log_odds(logits, "multilabel", ["a", "b", "c", "d"]), logits.max(1).values)


def test_relevance_over_shifted_passes_comes_back_aligned_to_the_pixel():
    """A stand-in whose relevance is its input: the shifted passes, shifted back and averaged, give the slice
    itself on every pixel, also the far edge that some passes dropped."""

    def pixel_copy(image):
        rollout = F.avg_pool2d(image[:, :1], 16)[:, 0]
        return Explained(output=image.sum((1, 2, 3)), rollout=rollout, class_attention=rollout[:, None],
                         relevance=image[:, 0].clone())  # fmt: skip

    torch.manual_seed(0)
    image = torch.rand(2, 1, 32, 32)
    explained = shifted_explained(pixel_copy, image, patch_size=16, shifts=4, fill=torch.zeros(1))
    torch.testing.assert_close(explained.relevance, image[:, 0])
    maps = [torch.ones(1, 4, 4) * k for k in range(4)]
    torch.testing.assert_close(shift_back_mean(maps, [(0, 0), (0, 2), (2, 0), (2, 2)])[0, 0, 0], torch.tensor(1.5))
    assert shift_back_mean(maps, [(0, 0), (0, 2), (2, 0), (2, 2)])[0, 3, 3] == 0  # only the unshifted pass saw it


def _batch(B=2, size=32, channels=1):
    torch.manual_seed(1)
    image = torch.zeros(B, channels, size, size)
    image[..., 6:28, 4:30] = torch.rand(B, channels, 22, 26)  # a head in air
    mask = torch.zeros(B, 1, size, size)
    mask[..., 12:17, 14:19] = 1
    return {"image": image, "head": (image[:, :1] > 0).float(), "mask": mask, "has_mask": torch.tensor([True] * B),
            "label": torch.ones(B, dtype=torch.long), "index": torch.arange(B),
            "source_shape": torch.tensor([[size, size]] * B), "pixel_spacing_mm": torch.full((B,), 0.9)}  # fmt: skip


@pytest.mark.parametrize("shifts", [1, 2])
def test_the_vit_read_to_the_pixel_is_its_rollout_spread_by_its_own_gradient(shifts):
    """The real network: pooled back to its cells the pixel map is the rollout of the same passes; the relevance of
    the unshifted pass is autograd's gradient x input of the lesion log-odds; the logits are the plain forward's;
    under inference_mode, as predict runs, and without touching the parameters' gradients."""
    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(**DEMO_LEVERS, img_size=32, in_chans=1, embed_dim=32, depth=2, num_heads=2)
    model.eval()
    image = _batch()["image"]
    cells = model.explained(image, reading=MapReading(shifts=shifts)).rollout
    with torch.inference_mode():
        explained = model.explained(image, reading=MapReading(shifts=shifts, pixels=True))
    assert explained.rollout.shape == (2, 32, 32) and (explained.rollout >= 0).all()
    cell = 16 // shifts
    torch.testing.assert_close(F.avg_pool2d(explained.rollout[:, None], cell)[:, 0], cells, rtol=1e-5, atol=1e-7)
    assert explained.rollout.flatten(1).std(1).gt(0).all() and not torch.equal(
        explained.rollout, cells.repeat_interleave(cell, -2).repeat_interleave(cell, -1)
    )  # the pixels of a cell differ: the gradient moved them
    assert all(p.grad is None for p in model.parameters())
    x = image.clone().requires_grad_(True)
    logits = model(x)
    torch.testing.assert_close(explained.output, logits.detach())
    if shifts == 1:
        (gradient,) = torch.autograd.grad((logits[:, 1] - logits[:, 0]).sum(), x)
        torch.testing.assert_close(explained.relevance, (gradient * image).sum(1))  # air is 0 in the brain window
        torch.testing.assert_close(input_relevance(gradient, image, torch.zeros(1)), (gradient * image).sum(1))


def test_infer_scores_the_pixel_map_and_its_ceiling_is_the_mask():
    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(
        **DEMO_LEVERS, img_size=32, in_chans=1, embed_dim=32, depth=2, num_heads=2
    ).eval()
    assert "map_pixels" not in model.hparams  # set per command, as map_shifts
    inference = infer(model, _batch(), MapReading(shifts=2, pixels=True))
    assert inference.rollout.shape == (2, 32, 32)
    assert (inference.scores["perfect_grid_dice"] == 1).all()  # a perfect map on the pixel grid is the mask
    assert torch.isfinite(inference.scores["rollout_dice"]).all() and inference.prob_tta is not None
    assert 0 <= float(inference.sink["rollout_air"][0]) <= 1


def test_a_multiclass_model_is_read_to_the_pixel_by_its_p_lesion():
    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(
        **DEMO_LEVERS, img_size=32, in_chans=2, embed_dim=32, depth=1, num_heads=2, num_classes=3
    )
    explained = model.eval().explained(_batch(channels=2)["image"], reading=MapReading(pixels=True))
    assert explained.rollout.shape == (2, 32, 32) and explained.relevance.abs().sum() > 0


def test_predict_writes_the_pixel_map_and_the_review_reads_the_same(synthetic_set, tmp_path):
    """``vit-ct predict``'s writer and the review with ``map_pixels``: the map on the source grid, the pixel ceiling
    (the mask: Dice 1), and the review's table equal to predictions.csv."""
    import numpy as np
    import pandas as pd
    from conftest import quiet_trainer

    from vit_ct import review
    from vit_ct.metrics.localisation import SCORES, SURFACE_DISTANCE_SOURCES
    from vit_ct.metrics.schema import PREDICTIONS, REVIEW
    from vit_ct.predict.writer import PredictionWriter

    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(
        **DEMO_LEVERS, img_size=32, in_chans=2, embed_dim=32, depth=2, num_heads=2
    ).eval()
    windows = {"data": {"init_args": {"windows": ["brain", "subdural"]}}}
    data = review.review_datamodule(model, synthetic_set, split="test", batch_size=3, config=windows)
    reading = MapReading(shifts=2, pixels=True)
    quiet_trainer(callbacks=[PredictionWriter(tmp_path / "out"), ReadMaps(reading)]).predict(model, datamodule=data)
    written = pd.read_csv(tmp_path / "out" / PREDICTIONS.file, float_precision="round_trip")
    scored = written["perfect_grid_dice"].notna()
    assert scored.any() and (written.loc[scored, "perfect_grid_dice"] > 0.99).all()
    assert np.load(tmp_path / "out" / written[PREDICTIONS.rollout].iloc[0]).shape == (64, 64)  # the source grid
    table = review.run_review(model, data, progress=False, reading=reading)
    assert table[REVIEW.rollout].iloc[0].shape == (32, 32)  # the model grid's pixels
    kept = [s for s in SCORES if s != "hd95_px"]
    shared = [PREDICTIONS.score(s, name) for s in SURFACE_DISTANCE_SOURCES for name in kept]
    assert np.allclose(written[shared].to_numpy(), table[shared].to_numpy(), equal_nan=True, rtol=1e-6, atol=1e-9)


def test_the_test_step_scores_the_pixel_map_under_inference_mode():
    """``vit-ct test``'s step (Lightning runs it under inference_mode): the losses' pass has no gradient, so the map
    is read again with it; the pixel ceiling is the mask itself."""
    from conftest import quiet_trainer

    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(**DEMO_LEVERS, img_size=32, in_chans=1, embed_dim=32, depth=2, num_heads=2)
    trainer = quiet_trainer(callbacks=[ReadMaps(MapReading(shifts=2, pixels=True))])
    trainer.test(model, dataloaders=torch.utils.data.DataLoader([_batch()], batch_size=None), verbose=False)
    values = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert values["test/perfect_grid_dice"] == pytest.approx(1.0) and 0 <= values["test/rollout_dice"] <= 1
