"""benchmarks/small_data.py: the held-out family really differs from pretraining, the floors and the interval are
computed as stated, and a tiny end-to-end run trains every kind of row and writes its table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import DEMO_LEVERS
from sklearn.metrics import roc_auc_score

from vit_ct.sim.cohort import COHORT_STREAM, CohortConfig, draw_patient
from vit_ct.task import ViTClassifier
from vit_ct.task.settings import flat_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sd():
    from benchmarks import small_data

    return small_data


@pytest.fixture(scope="module")
def pretraining_draws():
    """300 patients' scanners as the pretraining set draws them (`python -m vit_ct.sim.pretraining`, the set
    `configs/pretrain.yaml` reads: the cohort's defaults at the config's input size)."""
    pretrain = yaml.safe_load((ROOT / "configs" / "pretrain.yaml").read_text())["data"]["init_args"]
    assert pretrain["manifest"] == "data/pretraining/manifest.csv" and pretrain["img_size"] == CohortConfig().size
    return [draw_patient(0, index, CohortConfig())[3] for index in range(300)]


def test_the_family_table_says_what_lies_outside_the_pretraining_and_the_draws_agree(sd, pretraining_draws):
    """The README's table of the held-out families (benchmarks/family_ranges.py, from the code): each verdict held
    against what the pretraining really draws, not against a config's defaults."""
    from benchmarks import family_ranges as ranges

    rows = {row.name: row.families for row in ranges.settings()}
    verdict = {(name, family): rows[name][family][1] for name in rows for family in ("near", "far")}
    beam = [p.beam_hardening for p in pretraining_draws]
    assert sd.HELDOUT.beam_hardening > max(beam) and verdict["bone beam hardening", "near"] == ranges.OUTSIDE
    assert min(beam) <= sd.HELDOUT_FAR.beam_hardening <= max(beam)
    assert verdict["bone beam hardening", "far"] == ranges.INSIDE
    kernels = {p.kernel_name for p in pretraining_draws}
    assert set(sd.HELDOUT.kernels) <= kernels and verdict["reconstruction kernel", "near"] == ranges.INSIDE
    assert not {k.name for k in sd.HELDOUT_FAR.kernels} & kernels
    assert verdict["reconstruction kernel", "far"] == ranges.OUTSIDE
    spacing = [p.pixel_spacing_mm for p in pretraining_draws]
    assert min(spacing) <= sd.HELDOUT.pixel_spacing_mm <= max(spacing) < sd.HELDOUT_FAR.pixel_spacing_mm
    spacing_verdicts = (verdict["pixel spacing", "near"], verdict["pixel spacing", "far"])
    assert spacing_verdicts == (ranges.INSIDE, ranges.OUTSIDE)
    modulation = CohortConfig().scanner.dose_modulation  # each slice's dose: the patient's, times up to this either way
    photons = [p.photons_per_ray for p in pretraining_draws]
    for family, phantom in (("near", sd.HELDOUT), ("far", sd.HELDOUT_FAR)):
        low, high = phantom.photons_per_ray_range
        assert min(photons) / modulation <= low and high <= max(photons) * modulation, family
        assert verdict["dose: photons per detector bin and view", family] == ranges.INSIDE
        assert verdict["bleed contrast", family] == ranges.INSIDE  # 45-85 HU within the cohort's 40-90
    assert ranges.outside("near") == ["bone beam hardening"]
    assert ranges.outside("far") == ["reconstruction kernel", "pixel spacing"]


def test_the_held_out_families_share_the_pretrainings_input_but_not_its_seeds(sd):
    pretrain = yaml.safe_load((ROOT / "configs" / "pretrain.yaml").read_text())
    assert pretrain["data"]["init_args"]["windows"] == sd.WINDOWS  # every stem weight carries over
    assert {sd.HELDOUT_SEED, sd.HELDOUT_FAR_SEED}.isdisjoint({pretrain.get("seed_everything", 0), 0, COHORT_STREAM})


def test_the_fine_tuned_rows_train_the_readmes_recipe_read_from_its_config(sd):
    import argparse

    config = flat_config(yaml.safe_load((ROOT / "configs" / "finetune.yaml").read_text())["model"])
    args = argparse.Namespace(shipped=config["pretrained"], pretrained=None, demo=None, recipe_changes=None)
    recipe = {k: v for k, v in config.items() if k not in ("pretrained", "depth")}
    assert recipe["anchor_loss_weight"] > 0 and recipe["attention_loss_weight"] > 0 and recipe["evidence_attention"]
    model = sd.build_model(sd.ROWS["shipped-ft"], args)
    assert {k: model.hparams[k] for k in recipe} == recipe and model.anchor
    unanchored = sd.build_model(sd.ROWS["shipped-ft-unanchored"], args)
    assert unanchored.hparams.anchor_loss_weight == 0 and not unanchored.anchor
    assert {k: unanchored.hparams[k] for k in recipe if k != "anchor_loss_weight"} == {
        k: v for k, v in recipe.items() if k != "anchor_loss_weight"
    }


def test_patient_bootstrap_gives_sklearns_auroc_inside_its_interval(sd):
    rng = np.random.default_rng(0)
    patients = np.repeat(np.arange(20), 5)
    labels = rng.integers(0, 2, 100)
    scores = labels + rng.normal(0, 1.0, 100)
    auroc, low, high = sd.patient_bootstrap_auroc(labels, scores, patients, n=300)
    assert auroc == pytest.approx(roc_auc_score(labels, scores))
    assert low < auroc < high and 0.0 < high - low < 0.4
    assert sd.patient_bootstrap_auroc(labels, labels + 0.5, patients, n=50) == (1.0, 1.0, 1.0)


def test_seeds_give_a_row_of_means_with_their_spread(sd):
    runs = [{"name": "ViT", "input": "256", "auroc": a, "auroc_low": 0.0, "auroc_high": 1.0, "pointing": p, "dice": d,
             "seed": seed} for seed, (a, p, d) in enumerate([(0.70, 0.50, 0.30), (0.74, 0.60, 0.36)])]  # fmt: skip
    row = sd.mean_over_seeds(runs)
    assert (row["auroc"], row["pointing"], row["dice"]) == pytest.approx((0.72, 0.55, 0.33))
    assert (row["auroc_sd"], row["pointing_sd"], row["dice_sd"]) == pytest.approx(
        tuple(np.array([0.04, 0.1, 0.06]) / np.sqrt(2))  # the sample standard deviation of two
    )
    assert row["seeds"] == 2 and row["per_seed"] == runs
    assert "| 0.720 ± 0.028 (2 seeds) |" in sd.markdown([row]) and "| 0.330 ± 0.042 |" in sd.markdown([row])
    _, figures = sd.record_of([row])
    assert figures["vit_256_dice_sd"] == pytest.approx(0.06 / np.sqrt(2)) and "vit_256_pointing_sd" in figures


def test_image_statistics_read_only_the_head(sd):
    image = torch.rand(3, 2, 16, 16)
    head = torch.zeros(3, 1, 16, 16)
    head[..., 4:12, 4:12] = 1
    features = sd.image_statistics({"image": image, "head": head})
    assert features.shape == (3, 2 * 7)
    outside = image.clone()
    outside[..., :4, :] = 1.0  # brighter air changes nothing
    assert np.allclose(sd.image_statistics({"image": outside, "head": head}), features)
    inside = image[0, 0][head[0, 0] > 0.5]
    assert features[0, 0] == pytest.approx(float(inside.mean()))


def test_statistics_floor_finds_a_global_brightness_difference(sd):
    generator = torch.Generator().manual_seed(0)

    def split(n):
        label = torch.arange(n) % 2
        image = torch.rand(n, 2, 16, 16, generator=generator) * 0.5 + 0.3 * label[:, None, None, None]
        return {"image": image, "head": torch.ones(n, 1, 16, 16), "label": label}

    train, test = split(40), split(20)
    assert roc_auc_score(test["label"], sd.statistics_floor(train, test)) == 1.0


@pytest.mark.slow
def test_tiny_run_trains_every_kind_of_row_and_writes_its_table(sd, tmp_path):
    torch.manual_seed(0)
    vit = ViTClassifier.from_hparams(**DEMO_LEVERS, stem="conv", depth=6, img_size=128, in_chans=2).vit
    pretrained = tmp_path / "pretrained.pth"
    torch.save(vit.state_dict(), pretrained)  # a timm state dict of the pretraining architecture
    out = tmp_path / "table.md"
    args = ["--root", str(tmp_path / "heldout"), "--patients", "6", "--slices-per-patient", "3", "--epochs", "1"]
    sd.main([*args, "--rows", "resnet18", "vit-ft", "vit-ft-masks", "--pretrained", str(pretrained), "--out", str(out)])
    manifest = pd.read_csv(tmp_path / "heldout" / "manifest.csv")
    train_slices = int((manifest["split"] == "train").sum())
    rows = {r["name"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert set(rows) == {
        "floor: global image statistics",
        "floor: windowed image",
        "floor: head mask",
        "ceiling: perfect patch map",
        "ceiling: perfect map, 8-pixel grid",  # the maps are read over 2 x 2 shifted grids, as vit-ct test reads them
        "ResNet-18, scratch",
        "ViT, fine-tuned",
        "ViT, fine-tuned + masks",
    }
    assert rows["ResNet-18, scratch"]["map"] == "Grad-CAM" and rows["ViT, fine-tuned + masks"]["map"] == "rollout"
    assert rows["floor: head mask"]["pixel_auroc"] == pytest.approx(0.5)  # uniform over the head: chance
    assert rows["floor: head mask"]["outside_head"] == 0.0  # nothing of it off the head
    assert rows["floor: windowed image"]["outside_head"] == 0.0  # air windows to 0
    assert all(0.0 <= r["outside_head"] <= 1.0 for r in rows.values() if "outside_head" in r)
    for name in ("ResNet-18, scratch", "ViT, fine-tuned + masks"):
        assert 0.0 <= rows[name]["auroc_low"] <= rows[name]["auroc"] <= rows[name]["auroc_high"] <= 1.0
        assert rows[name]["images_seen"] == train_slices  # one epoch
    assert "| ResNet-18, scratch | 128 |" in out.read_text()
    labels_only = pd.read_csv(tmp_path / "heldout" / "manifest_labels_only.csv")
    assert "mask" not in labels_only and len(labels_only) == len(manifest)  # what the labels-only rows train on
    scans = pd.read_csv(tmp_path / "heldout" / "manifest_scan_labels_only.csv")  # what the scan-label rows train on
    assert not {"mask", "label"} & set(scans) and len(scans) == len(manifest)
    assert scans["scan_label"].tolist() == manifest.groupby("patient_id")["label"].transform("max").tolist()
    test_scans = manifest[manifest["split"] == "test"].groupby("patient_id")["label"].max()
    if test_scans.nunique() == 2:  # scan AUROC is defined only where the test split holds scans of both kinds
        assert 0.0 <= rows["ViT, fine-tuned"]["scan_auroc"] <= 1.0
    else:
        assert np.isnan(rows["ViT, fine-tuned"]["scan_auroc"])
    ceiling = rows["ceiling: perfect patch map"]
    assert ceiling["dice"] >= rows["floor: windowed image"]["dice"] and ceiling["pointing"] >= 0.5
    assert rows["ceiling: perfect map, 8-pixel grid"]["dice"] >= ceiling["dice"]  # a finer grid allows more
    assert {f"pointing_q{q}" for q in range(1, 5)} <= set(rows["ViT, fine-tuned"])
