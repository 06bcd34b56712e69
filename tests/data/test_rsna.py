"""vit_ct.data.datasets.rsna_manifest: the Kaggle RSNA 2019 ICH layout (real and synthetic DICOMs) as a manifest, the
competition metric against a hand computation, and a few training steps with configs/rsna_ich.yaml."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import TINY_MODEL_ARGS
from pydicom.data import get_testdata_file
from rsna_files import copy_with_patient, phantom_hu, write_ct_dicom

from vit_ct.data.datasets.rsna_manifest import RSNA_LABELS, build_rsna_manifest, main, read_rsna_labels
from vit_ct.data.io.reader import load_ct_slice
from vit_ct.data.manifests.manifest import read_manifest
from vit_ct.metrics.classification import WeightedLogLoss

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def rsna_folder(tmp_path):
    """Kaggle layout: stage_2_train.csv + stage_2_train/ID_<sop>.dcm; 2 real and 8 synthetic slices, 5 patients."""
    images = tmp_path / "stage_2_train"
    images.mkdir()
    slices = {}  # sop id -> (patient, labels in RSNA_LABELS order)
    for i, name in enumerate(["CT_small.dcm", "693_UNCR.dcm"]):
        source = get_testdata_file(name)
        if source is None:
            pytest.skip(f"{name} is not in the installed pydicom/pydicom-data test files")
        sop = f"ID_real{i:04d}"
        copy_with_patient(source, images / f"{sop}.dcm", "ID_patientA")
        slices[sop] = ("ID_patientA", [0, 0, 0, 0, 1, 1] if i else [0] * 6)
    rng = np.random.default_rng(0)
    for i in range(8):
        sop, patient = f"ID_syn{i:04d}", f"ID_patient{'BCDE'[i % 4]}"
        write_ct_dicom(images / f"{sop}.dcm", phantom_hu(32, i), patient)
        subtypes = [int(v) for v in rng.integers(0, 2, 5)]
        slices[sop] = (patient, [*subtypes, int(any(subtypes))])
    rows = [
        (f"{sop}_{label}", value)
        for sop, (_, labels) in slices.items()
        for label, value in zip(RSNA_LABELS, labels, strict=True)
    ]
    rows += rows[:7]  # the stage 2 file repeats some rows
    pd.DataFrame(rows, columns=["ID", "Label"]).to_csv(tmp_path / "stage_2_train.csv", index=False)
    return tmp_path, slices


def test_build_manifest_from_the_kaggle_layout(rsna_folder):
    folder, slices = rsna_folder
    out = folder / "rsna.csv"
    built = build_rsna_manifest(folder / "stage_2_train.csv", folder / "stage_2_train", out, progress=False)
    assert list(built.columns) == ["image", *RSNA_LABELS, "patient_id"] and len(built) == len(slices)
    for _, row in built.iterrows():
        sop = Path(row["image"]).stem
        patient, labels = slices[sop]
        assert row["patient_id"] == patient and [row[c] for c in RSNA_LABELS] == labels
        assert row["image"] == f"stage_2_train/{sop}.dcm"  # relative to the manifest's folder

    table = read_manifest(out, label_columns=RSNA_LABELS)
    assert table["patient_id"].nunique() == 5
    syn = table[table["image_ref"].str.contains("ID_syn0003")].iloc[0]
    np.testing.assert_array_equal(load_ct_slice(syn["image"]), phantom_hu(32, 3).astype(np.float32))


def test_command_line_entry(rsna_folder, capsys):
    folder, slices = rsna_folder
    main([str(folder / "stage_2_train.csv"), str(folder / "stage_2_train"), str(folder / "m.csv")])
    assert f"{len(slices)} slices, 5 patients" in capsys.readouterr().out
    elsewhere = folder / "elsewhere" / "m.csv"
    main([str(folder / "stage_2_train.csv"), str(folder / "stage_2_train"), str(elsewhere)])
    assert pd.read_csv(elsewhere)["image"][0] == str(folder / "stage_2_train" / "ID_real0000.dcm")  # not below it


@pytest.mark.parametrize(
    "rows, message",
    [
        ([("ID_a_epidural", "0"), ("ID_a_epidural", "1")], "both 0 and 1"),
        ([("ID_a_bleed", "0")], "unknown subtypes"),
        ([("ID_a_any", "2")], "must be 0 or 1"),
        ([("a_any", "1")], "ID_<sop id>_<subtype>"),
        ([("ID_a_any", "1")], "lack some of the six"),
    ],
)
def test_malformed_labels_are_named(tmp_path, rows, message):
    path = tmp_path / "labels.csv"
    pd.DataFrame(rows, columns=["ID", "Label"]).to_csv(path, index=False)
    with pytest.raises(ValueError, match=message):
        read_rsna_labels(path)


def test_missing_dicoms_are_named(rsna_folder):
    folder, _ = rsna_folder
    (folder / "stage_2_train" / "ID_syn0005.dcm").unlink()
    with pytest.raises(ValueError, match="1 of 10 labelled slices have no file.*ID_syn0005"):
        build_rsna_manifest(folder / "stage_2_train.csv", folder / "stage_2_train", folder / "m.csv", progress=False)


def test_weighted_log_loss_matches_the_competition_definition():
    rng = np.random.default_rng(0)
    probs, target = rng.uniform(0.01, 0.99, (50, 6)), rng.integers(0, 2, (50, 6))
    probs[0, 0], target[0, 0] = 0.0, 1  # a confident mistake: clipped to 1e-15, finite
    recipe = yaml.safe_load((ROOT / "configs" / "rsna_ich.yaml").read_text())
    assert recipe["data"]["init_args"]["label_columns"] == list(RSNA_LABELS)  # the weights' order
    weights = np.array(recipe["model"]["labels"]["label_weights"])
    assert weights.tolist() == [2.0 if label == "any" else 1.0 for label in RSNA_LABELS]
    clipped = np.clip(probs, 1e-15, 1 - 1e-15)
    bce = -(target * np.log(clipped) + (1 - target) * np.log(1 - clipped))
    per_slice = (bce * weights).sum(axis=1) / weights.sum()  # weighted mean over labels, then mean over slices
    # Kaggle: one log loss over every (slice, label) row of the submission, sample weight 2 for `any`, else 1.
    kaggle = np.average(bce.ravel(), weights=np.tile(weights, len(bce)))
    assert per_slice.mean() == pytest.approx(kaggle)
    metric = WeightedLogLoss(weights.tolist())
    for part in np.array_split(np.arange(50), 3):  # accumulates over batches
        metric.update(torch.from_numpy(probs[part]).float(), torch.from_numpy(target[part]))
    assert float(metric.compute()) == pytest.approx(per_slice.mean(), rel=1e-5)


@pytest.mark.slow
def test_rsna_fit_with_the_recipe(rsna_folder, monkeypatch):
    from vit_ct.cli import main as vit_ct

    folder, _ = rsna_folder
    build_rsna_manifest(folder / "stage_2_train.csv", folder / "stage_2_train", folder / "rsna.csv", progress=False)
    monkeypatch.chdir(folder)
    cli = vit_ct(
        ["fit", "--config", str(ROOT / "configs" / "rsna_ich.yaml"), "--data.manifest", str(folder / "rsna.csv"),
         *TINY_MODEL_ARGS, "--data.init_args.img_size", "32", "--data.init_args.batch_size", "4",
         "--data.init_args.num_workers", "0", "--trainer.max_epochs", "1", "--trainer.accelerator", "cpu",
         "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", "logs"]
    )  # fmt: skip
    assert cli.model.task == "multilabel" and cli.model.class_names == list(RSNA_LABELS)
    assert cli.model.hparams.in_chans == 3  # brain, subdural, bone
    assert cli.datamodule.cache == "disk" and cli.datamodule.slice_cache.done.sum() == 10  # the recipe's cache
    metrics = cli.trainer.callback_metrics
    assert {"val/weighted_log_loss", "val/auroc", "val/auroc_any"} <= set(metrics)
    assert np.isfinite(float(metrics["val/weighted_log_loss"]))
    assert cli.trainer.checkpoint_callback.last_model_path
    shutil.rmtree(folder / "logs", ignore_errors=True)
