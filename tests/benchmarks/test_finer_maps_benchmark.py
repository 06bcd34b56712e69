"""benchmarks/finer_maps.py on a tiny checkpoint: it runs `vit-ct test` and `vit-ct predict` per map_shifts setting
and writes a record whose figures agree with each other and with what `vit-ct test` reports (timings not judged)."""

import json

import pytest


@pytest.mark.medium
def test_the_benchmark_writes_a_record_whose_figures_agree(tiny_checkpoint, synthetic_set, tmp_path):
    from benchmarks import finer_maps

    argv = ["--ckpt", str(tiny_checkpoint), "--manifest", str(synthetic_set), "--shifts", "1", "2", "--repeats", "1",
            "--n-slices", "3", "--sanity-slices", "2", "--steps", "4", "--warm-up", "0"]  # fmt: skip
    finer_maps.main(argv, records=tmp_path)
    record = json.loads((tmp_path / "finer_maps.json").read_text())
    f, notes = record["figures"], record["notes"]
    assert record["command"].startswith("python -m benchmarks.finer_maps --ckpt")
    # the same `vit-ct test` in this process gives the record's map scores
    direct = finer_maps.test_metrics(["--config", str(finer_maps.MANIFEST_CONFIG), "--ckpt_path",
                                      str(tiny_checkpoint)], synthetic_set, 2)  # fmt: skip
    assert f["shifts2_rollout_dice"] == pytest.approx(direct["rollout_dice"])
    assert f["shifts2_perfect_grid_dice"] == pytest.approx(direct["perfect_grid_dice"])
    # the ceilings: the perfect map on the 8-px grid outlines at least as well as the one on 16-px patches; the patch
    # ceiling does not depend on how the model is read, and map_shifts 1 has no grid ceiling of its own
    assert f["shifts2_perfect_grid_dice"] >= f["shifts2_perfect_patch_dice"]
    assert f["shifts1_perfect_patch_dice"] == pytest.approx(f["shifts2_perfect_patch_dice"])
    assert "shifts1_perfect_grid_dice" not in f
    # one pass: predict's prob is the single pass vit-ct test scores, no prob_tta; 4 passes: prob_tta written
    assert f["shifts1_auroc_prob"] == pytest.approx(f["shifts1_test_auroc"], abs=1e-6)
    assert f["shifts1_auroc_prob_tta"] is None and 0 <= f["shifts2_auroc_prob_tta"] <= 1
    assert f["shifts2_auroc_prob"] == pytest.approx(f["shifts1_auroc_prob"], abs=1e-6)
    # the ratios are the record's own times
    for what in ("predict", "model"):
        assert f[f"shifts1_{what}_ratio"] == 1.0
        assert f[f"shifts2_{what}_ratio"] == pytest.approx(f[f"shifts2_{what}_s"] / f[f"shifts1_{what}_s"])
    assert notes["cells"] == [4, 4] and notes["faithfulness_slices"] == 3 and notes["sanity_slices"] == 2
    # the paired differences are the differences of the two maps' mean areas over the same slices
    for curve in ("deletion", "insertion"):
        assert f[f"shifts2_{curve}_vs_1"] == pytest.approx(f[f"shifts2_{curve}"] - f[f"shifts1_{curve}"], abs=1e-9)
    for key in ("shifts1_deletion", "shifts2_insertion", "random_deletion"):
        assert 0 <= f[key] <= 1
    assert {f["shifts1_randomisation_passed"], f["shifts2_randomisation_passed"]} <= {0, 1}
    maps = record["tables"]["finer_maps"]
    assert [row[0] for row in maps["rows"]] == ["rollout, map_shifts 1", "rollout, map_shifts 2",
        "perfect patch map", "perfect grid map, map_shifts 2", "floor: image", "floor: head", "random map"]  # fmt: skip
    assert maps["rows"][1][4] == f["shifts2_rollout_dice"]


@pytest.mark.medium
def test_the_pixel_benchmark_scores_what_vit_ct_test_reports(tiny_checkpoint, synthetic_set, tmp_path):
    """benchmarks/stem_relevance.py: its map_pixels row is what `vit-ct test --map_pixels true` scores, the
    pixel map's randomisation check is recorded, and the cost ratios are the record's own times."""
    from benchmarks import finer_maps, stem_relevance

    argv = ["--ckpt", str(tiny_checkpoint), "--manifest", str(synthetic_set), "--repeats", "1", "--n-slices", "3",
            "--sanity-slices", "2", "--steps", "4"]  # fmt: skip
    stem_relevance.main(argv, records=tmp_path)
    record = json.loads((tmp_path / "stem_relevance.json").read_text())
    f = record["figures"]
    model_args = ["--config", str(finer_maps.MANIFEST_CONFIG), "--ckpt_path", str(tiny_checkpoint)]
    # the benchmark reads the pixel maps in fp32; vit-ct test's precision auto is bf16 on a CPU with native bf16, where
    # the gradient through the stem differs in the third decimal: both read at fp32 here
    fp32 = ["--trainer.precision", "32-true"]
    direct = finer_maps.test_metrics([*model_args, *fp32, "--map_pixels", "true"], synthetic_set, 2)
    assert f["demo_pixels_dice"] == pytest.approx(direct["rollout_dice"])
    assert direct["perfect_grid_dice"] == pytest.approx(1.0)  # on the pixels, the perfect map is the mask
    plain = finer_maps.test_metrics(model_args, synthetic_set, 2)
    assert f["demo_rollout2_dice"] == pytest.approx(plain["rollout_dice"])
    assert f["demo_pixels_randomisation_passed"] in (0, 1) and 0 <= f["demo_pixels_deletion"] <= 1
    assert f["demo_pixels_vs_rollout"] == pytest.approx(f["demo_model_s_pixels"] / f["demo_model_s_rollout"])
    rows = record["tables"]["stem_relevance_demo"]["rows"]
    assert [row[0] for row in rows] == [*stem_relevance.METHODS, "random order"]
