"""benchmarks/faithfulness.py: deletion/insertion inputs and areas against hand-built cases; a tiny end-to-end run."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import DEMO_LEVERS

from vit_ct.explain.occlusion import brain_baseline, occlusion_sensitivity
from vit_ct.task import ViTClassifier


@pytest.fixture(scope="module")
def fb():
    from benchmarks import faithfulness

    return faithfulness


def test_baseline_is_normal_brain_in_the_head_and_air_outside():
    image = torch.rand(1, 2, 4, 4)
    head = torch.zeros(1, 1, 4, 4)
    head[..., 1:3, 1:3] = 1
    baseline = brain_baseline(image, head, [(40.0, 80.0), (80.0, 200.0)])
    assert torch.allclose(baseline[0, :, 1, 1], torch.tensor([30 / 80, 50 / 200]))  # (30 - 0) / 80, (30 + 20) / 200
    assert torch.equal(baseline[..., 0, :], image[..., 0, :])


def test_patch_order_is_descending_with_seeded_random_ties(fb):
    maps = torch.tensor([[[0.1, 0.9], [0.5, 0.5]]])
    orders = {tuple(fb.patch_order(maps, torch.Generator().manual_seed(s))[0].tolist()) for s in range(20)}
    assert orders == {(1, 2, 3, 0), (1, 3, 2, 0)}  # the tie of patches 2 and 3 goes both ways
    again = fb.patch_order(maps, torch.Generator().manual_seed(3))
    assert torch.equal(again, fb.patch_order(maps, torch.Generator().manual_seed(3)))


def test_perturbed_replaces_the_first_patches_of_the_order(fb):
    image, baseline = torch.ones(1, 1, 4, 4), torch.zeros(1, 1, 4, 4)  # a 2 x 2 grid of 2 x 2 patches
    order = torch.tensor([[3, 0, 2, 1]])
    counts = fb.patch_counts(4, 4)
    deletion, insertion = fb.perturbed(image, baseline, order, counts, (2, 2))
    assert counts.tolist() == [0, 1, 2, 3, 4]
    expected = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]])  # patches 1..4
    for k in range(3):
        per_patch = deletion[0, k, 0, ::2, ::2].flatten()
        assert torch.equal(per_patch, expected[k]), k
    assert torch.equal(deletion[:, -1], baseline) and torch.equal(insertion[:, 0], baseline)
    assert torch.equal(insertion, 1 - deletion)


def test_curve_area_over_the_fraction_of_patches(fb):
    counts = fb.patch_counts(64, 16)
    line = 1 - counts.double() / 64  # falls linearly from 1 to 0: area 1/2
    assert torch.allclose(fb.curve_area(line[None], counts), torch.tensor([0.5], dtype=torch.float64))
    flat = torch.full((1, 17), 0.3, dtype=torch.float64)
    assert torch.allclose(fb.curve_area(flat, counts), torch.tensor([0.3], dtype=torch.float64))


def test_benchmark_runs_end_to_end(fb, synthetic_set, tmp_path):
    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(**DEMO_LEVERS, img_size=32, in_chans=2, embed_dim=32, depth=2, num_heads=2)
    ckpt = tmp_path / "tiny.ckpt"
    checkpoint = {"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}
    torch.save({**checkpoint, "pytorch-lightning_version": L.__version__}, ckpt)
    out = tmp_path / "table.md"
    args = ["--ckpt", str(ckpt), "--manifest", str(synthetic_set), "--split", "train", "--steps", "2"]
    report = fb.main([*args, "--n-slices", "3", "--windows", "brain", "subdural", "--out", str(out)])
    assert out.read_text() == report + "\n"
    rows = [line for line in report.splitlines() if line.startswith("| ") and "method" not in line]
    assert [r.split(" | ")[0][2:] for r in rows] == list(fb.METHODS)
    assert all(r.rstrip(" |").endswith("| 3") for r in rows)  # every method scored on the same 3 slices
    occlusion = next(r for r in rows if r.startswith("| occlusion "))
    assert occlusion.split(" | ")[-3] == str(2 * 2 + 1)  # a pass per patch of the 2 x 2 grid, and the intact slice


def test_occlusion_is_the_score_drop_of_each_patch_at_the_baseline():
    """A linear score: hiding a patch lowers it by exactly that patch's weighted difference from the baseline."""
    torch.manual_seed(0)
    image, weight = torch.rand(2, 2, 32, 32), torch.rand(1, 2, 32, 32)
    head = torch.ones(2, 1, 32, 32)
    head[..., :8, :] = 0  # the top row of patches is air: its baseline is the image itself, nothing to hide
    baseline = brain_baseline(image, head, [(40.0, 80.0), (80.0, 200.0)])

    def score(x):
        return (x * weight).sum(dim=(1, 2, 3))

    maps = occlusion_sensitivity(score, image, baseline, patch_size=8, n_batch=5)
    expected = ((image - baseline) * weight).unfold(2, 8, 8).unfold(3, 8, 8).sum(dim=(1, 4, 5))  # (2, 4, 4)
    assert type(maps) is torch.Tensor and maps.shape == (2, 4, 4)  # a plain tensor, not a MetaTensor
    torch.testing.assert_close(maps, expected, atol=1e-4, rtol=1e-4)
    assert maps[:, 0].abs().max() < 1e-4


def test_grad_cam_reads_the_full_patch_grid_of_a_model_that_skips_air(fb):
    """The model lets air patches skip its blocks; Grad-CAM runs the same function with every token in the blocks,
    so it gets the same logits and a map on the whole grid."""
    tiny = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2, "in_chans": 2}
    model = ViTClassifier.from_hparams(**DEMO_LEVERS, **tiny).eval()
    images = torch.zeros(2, 2, 32, 32)
    images[0, :, 8:, 8:24] = 0.5
    images[1, :, 16:24, 8:16] = 0.5  # one content patch: the batch runs padded, air masked
    with torch.no_grad():
        torch.testing.assert_close(fb._EveryToken(model)(images), model(images))
    maps = fb.grad_cam(model, images, (4, 4))
    assert maps.shape == (2, 4, 4) and torch.isfinite(maps).all()  # it failed on the shorter sequence before
