"""A model that reads each slice in its scan (``--model.network.sequence gru``) through the commands: `fit` keeps
the head in its checkpoint, and `test` logs each figure in scan, equal to the slices read by hand: each patient's
slices in the order of their DICOM ImagePositionPatient, their embeddings through a GRU run over the whole scan.
Two DDP processes read each scan whole, as one process does."""

from __future__ import annotations

import json
from pathlib import Path

import highdicom as hd
import numpy as np
import pandas as pd
import pydicom
import pytest
import torch
from conftest import TINY_MODEL_ARGS, tiny_data_args
from npy_manifest import manifest_args, write_npy_manifest
from pydicom.sr.codedict import codes
from sklearn.metrics import roc_auc_score
from test_distributed import _vit_ct

from vit_ct import ViTClassifier
from vit_ct.cli import main
from vit_ct.report.report_command import main as report_main
from vit_ct.review.predict_run import open_predict_run
from vit_ct.review.scan_view import peak_slice, plot_scan, scans_by_probability

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")
QUIET = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]
pytestmark = pytest.mark.medium


def test_fit_keeps_the_sequence_and_test_scores_each_slice_in_its_whole_scan(tmp_path):
    manifest = tmp_path / "data" / "manifest.csv"  # 14 patients: 2 to test on, 8 slices
    data = [*tiny_data_args(manifest), "--data.init_args.n_patients", "14", "--data.init_args.batch_size", "16"]
    main(["fit", "--config", DEMO, *data, *TINY_MODEL_ARGS, *QUIET, "--trainer.max_epochs", "2",
          "--test_after_fit", "false", "--trainer.default_root_dir", str(tmp_path), "--model.network.sequence",
          "gru"])  # fmt: skip
    checkpoint_path = tmp_path / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(checkpoint_path, weights_only=True, map_location="cpu")
    assert checkpoint["hyper_parameters"]["sequence"] == "gru"
    assert "sequence.gru.weight_ih_l0" in checkpoint["state_dict"]
    assert checkpoint["state_dict"]["sequence.out.weight"].abs().sum() > 0  # it trained: no longer zero

    # in float32, as the reading by hand below; in batches that split the scans
    cli = main(["test", "--config", DEMO, *data, *QUIET, "--ckpt_path", str(checkpoint_path), "--trainer.precision",
                "32-true", "--data.init_args.batch_size", "3"])  # fmt: skip
    logged = {name: float(value) for name, value in cli.trainer.callback_metrics.items()}

    model = ViTClassifier.load_from_checkpoint(checkpoint_path).eval()
    dataset = cli.datamodule.datasets["test"]
    table = dataset.table
    batches = [cli.datamodule.on_after_batch_transfer(b, 0) for b in cli.datamodule.test_dataloader()]
    batch = {key: torch.cat([b[key] for b in batches]) for key in ("image", "label", "index")}
    assert len(batch["index"]) == len(table) and table["patient_id"].nunique() >= 2  # the test split
    with torch.no_grad():
        embeddings = model.vit.forward_head(model.vit.forward_features(batch["image"]), pre_logits=True)
        logits = model.vit.head(embeddings)
        in_scan = logits.clone()
        rows = table.iloc[batch["index"].numpy()]
        z = np.array([float(pydicom.dcmread(manifest.parent / f).ImagePositionPatient[2]) for f in rows["image"]])
        for patient in rows["patient_id"].unique():
            members = np.flatnonzero(rows["patient_id"].to_numpy() == patient)
            members = torch.from_numpy(members[np.argsort(z[members])])
            out, _ = model.sequence.gru(model.sequence.norm(embeddings[members])[None])
            in_scan[members] += model.sequence.out(out[0])
    prob, label = in_scan.softmax(-1)[:, 1].numpy(), batch["label"].numpy()
    assert not np.allclose(in_scan, logits)  # the scan changed the slices' reading
    assert logged["test/auroc_in_scan"] == pytest.approx(roc_auc_score(label, prob), abs=1e-5)
    assert logged["test/accuracy_in_scan"] == pytest.approx(np.mean((prob >= 0.5) == label), abs=1e-6)
    assert logged["test/auroc"] == pytest.approx(roc_auc_score(label, logits.softmax(-1)[:, 1].numpy()), abs=1e-5)
    scans = rows.assign(prob=prob, label=label).groupby("patient_id").agg(prob=("prob", "max"), label=("label", "max"))
    if scans["label"].nunique() == 2:
        assert logged["test/scan_auroc_in_scan"] == pytest.approx(roc_auc_score(scans["label"], scans["prob"]))

    # predict writes each slice's probability in its whole scan beside the slice's own, in batches that split scans,
    # its maps read over 2 x 2 shifted grids (the embeddings are the unshifted pass's)
    out = tmp_path / "out"
    main(["predict", "--config", DEMO, *data, *QUIET, "--ckpt_path", str(checkpoint_path), "--trainer.precision",
          "32-true", "--data.init_args.batch_size", "3", "--data.init_args.predict_split", "test", "--map_shifts", "2",
          "--output_dir", str(out), "--dicom_out", "true"])  # fmt: skip
    written = pd.read_csv(out / "predictions.csv")
    assert list(written.columns[:4]) == ["image", "prob", "prob_tta", "prob_in_scan"]
    by_image = dict(zip(rows["image_ref"], prob, strict=True))
    np.testing.assert_allclose(written["prob_in_scan"], written["image"].map(by_image), atol=1e-5)
    np.testing.assert_allclose(written["prob"], written["image"].map(dict(zip(rows["image_ref"],
                               logits.softmax(-1)[:, 1].numpy(), strict=True))), atol=1e-5)  # fmt: skip
    # scans.csv: each scan's highest slice in scan beside its highest alone, and its slices in scan order
    per_scan = pd.read_csv(out / "scans.csv").set_index("scan")
    assert list(per_scan.columns[:3]) == ["n_slices", "prob", "prob_in_scan"]
    np.testing.assert_allclose(per_scan.loc[scans.index, "prob_in_scan"], scans["prob"], atol=1e-4)
    for patient, group in rows.assign(prob=prob, z=z).groupby("patient_id"):
        written_order = [float(p) for p in per_scan.loc[patient, "slice_probs_in_scan"].split(";")]
        np.testing.assert_allclose(written_order, group.sort_values("z")["prob"], atol=1e-4)

    # the DICOM objects report each scan as read in its scan: the SR's probability its slices' highest in scan
    objects = pd.read_csv(out / "dicom" / "objects.csv").set_index(["scan", "kind"])
    for patient in scans.index:
        sr = hd.sr.srread(out / objects.loc[(patient, "sr"), "file"])
        (finding,) = sr.content.get_image_measurement_groups()
        (probability,) = finding.get_measurements(name=codes.DCM.Probability)
        assert probability.value == pytest.approx(scans.loc[patient, "prob"], abs=1e-4)
        assert sr.SeriesDescription.startswith(f"vit-ct finding; P(lesion) {probability.value:.3f} in scan, peak")

    # the review's scan view draws each slice read in its scan beside the slice alone
    run = open_predict_run(out)
    assert scans_by_probability(run) == scans["prob"].sort_values(ascending=False, kind="stable").index.tolist()
    patient = rows["patient_id"].iloc[0]
    curves = {line.get_label(): line.get_ydata() for line in plot_scan(run, patient).axes[1].lines}
    expected = rows.assign(prob=prob, z=z).query("patient_id == @patient").sort_values("z")["prob"]
    np.testing.assert_allclose(curves["P(lesion) in its scan"], expected, atol=1e-4)
    assert peak_slice(run.scan_slices(patient)) == int(np.argmax(expected.to_numpy()))  # the view opens on it

    # the report: the slices read in their scans as a model of its own beside the slices alone
    report_main([str(out), "--manifest", str(manifest), "--bootstrap", "20", "--output_dir", str(tmp_path / "report")])
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    in_scan = report["compare"]["vit-ct in scan"]["slice"]["auroc"]["value"]
    assert in_scan == pytest.approx(roc_auc_score(label, prob), abs=1e-6)
    assert report["slice"]["auroc"]["value"] == pytest.approx(logged["test/auroc"], abs=1e-5)


@pytest.mark.slow
def test_two_processes_read_each_scan_whole_as_one_does(tmp_path):
    """Evaluation shards deal a scan's slices to both ranks (rank::world): each rank gathers every slice before it
    reads the scans, so the figures in scan equal one process's."""
    manifest = write_npy_manifest(tmp_path / "data", train=8, val=7)
    table = pd.read_csv(manifest)
    # labels alternate 0, 1 by row: validation (rows 8-14) holds two scans without a bleed (c, f) and one with (d)
    table["scan"] = ["a"] * 4 + ["b"] * 4 + ["c", "d", "c", "d", "f", "d", "f"] + ["e"] * 2
    table["position_mm"] = [5.0 * ((7 * i) % 11) for i in range(len(table))]  # not in row order
    table.to_csv(manifest, index=False)
    common = [*manifest_args(manifest, batch_size=2), "--model.network.sequence", "gru"]
    _vit_ct("fit", *common, "--trainer.max_epochs", "2", "--trainer.logger", "false", cwd=tmp_path)
    checkpoint = next(tmp_path.rglob("last.ckpt"))
    probe = ["--trainer.callbacks+=probes.RecordIndices", "--trainer.callbacks.folder", str(tmp_path / "rec")]
    ddp = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    figures = {}
    for name, more in (("one", []), ("two", ddp)):
        _vit_ct("validate", *common, *probe, *more, "--trainer.logger", "false", "--ckpt_path", str(checkpoint),
                cwd=tmp_path)  # fmt: skip
        figures[name] = json.loads((tmp_path / "rec" / "validate-rank0.json").read_text())["metrics"]
    assert figures["two"]["val/auroc"] == pytest.approx(figures["one"]["val/auroc"], abs=1e-6)
    for name in ("val/auroc_in_scan", "val/accuracy_in_scan", "val/scan_auroc_in_scan"):
        assert figures["two"][name] == pytest.approx(figures["one"][name], abs=1e-6), name
