"""benchmarks/context.py end to end at a tiny size: the scan set as the recipe's user has it (masks only on the test
patients), two rows through the real commands (context from an inflated start, and the same with each slice read in
its scan by a sequence head too), and a record whose table and figures agree with the predictions."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import roc_auc_score

from benchmarks import context_seeds
from benchmarks.context import NAMED_KERNELS, family_cohort, main
from benchmarks.small_data import HELDOUT_FAMILIES
from vit_ct.sim.projector import Kernel, fourier_filter
from vit_ct.sim.protocol import REFERENCE_SPACING_MM, REFERENCE_THICKNESS_MM, sample_protocol


def protocol_scale(protocol) -> float:
    """What the drawn dose is multiplied by for the protocol's pixel size and slice thickness."""
    return (protocol.pixel_spacing_mm / REFERENCE_SPACING_MM) * (
        protocol.slice_thickness_mm / REFERENCE_THICKNESS_MM
    ) ** 0.5


@pytest.mark.slow
def test_a_tiny_run_trains_two_rows_and_records_what_the_predictions_say(tmp_path):
    folder = tmp_path / "runs"
    main(["--patients", "16", "--slices", "6", "--epochs", "1", "--num_workers", "1", "--folder", str(folder),
          "--rows", "inflated", "both", "--split", "0.5", "0.125", "0.375", "--record", "context_rows"],
         records=tmp_path / "records")  # fmt: skip
    manifest = pd.read_csv(folder / "scans" / "labels_only.csv", dtype=str, keep_default_na=False)
    assert (manifest.loc[manifest["split"] != "test", "mask"] == "").all()
    assert (manifest.loc[manifest["split"] == "test", "mask"] != "").all()
    assert manifest.groupby("split")["patient_id"].nunique().to_dict() == {"train": 8, "val": 2, "test": 6}
    record = json.loads((tmp_path / "records" / "context_rows.json").read_text())  # the name --record gives
    rows = record["tables"]["context"]["rows"]
    assert [row[0] for row in rows] == ["context 5 mm, inflated start", "context 5 mm, inflated + sequence (in scan)"]
    assert rows[0][-2:] == [1.0, 1.0]
    # the inflated start: a third of the slice's kernels on each slice, so the two neighbours' norm over the slice's
    # own is sqrt(2) at the start; one epoch moves it a little
    assert 1.2 < rows[0][6] < 1.6 and 1.2 < rows[1][6] < 1.6
    for name, prob in (("inflated", "prob"), ("both", "prob_in_scan")):  # a sequence head: scored in scan
        slices = pd.read_csv(folder / f"{name}_predict" / "predictions.csv")
        assert len(slices) == (manifest["split"] == "test").sum()
        assert np.isclose(record["figures"][f"auroc_{name}"], roc_auc_score(slices["label"], slices[prob]))
    checkpoint = json.loads((folder / "inflated" / "summary.json").read_text())["last_checkpoint"]
    config = (folder / "inflated" / "config.yaml").read_text()
    assert "context_mm: 5.0" in config and "neighbour_start: inflated" in config and checkpoint.endswith("last.ckpt")


@pytest.mark.slow
def test_scan_labels_train_from_one_label_per_scan_and_score_on_the_slices_of_a_held_out_family(tmp_path):
    folder = tmp_path / "runs"
    main(["--patients", "16", "--slices", "6", "--epochs", "1", "--num_workers", "1", "--folder", str(folder),
          "--rows", "sequence", "--labels", "scan", "--family", "far"], records=tmp_path / "records")  # fmt: skip
    slices = pd.read_csv(folder / "scans" / "labels_only.csv")
    assert (slices["pixel_spacing_mm"] == 1.25).all() and (slices["kernel"] == "G1.30B1.50").all()  # far's scanner
    trained_on = pd.read_csv(folder / "scans" / "scan_labels_only.csv")
    assert "label" not in trained_on and "mask" not in trained_on
    lesion = slices.groupby("patient_id")["label"].max().gt(0).astype(int)  # a scan per patient
    per_scan = trained_on.groupby("patient_id")["scan_label"]
    assert (per_scan.nunique() == 1).all() and per_scan.first().equals(lesion)
    assert "scan_labels_only.csv" in (folder / "sequence_scans" / "config.yaml").read_text()
    record = json.loads((tmp_path / "records" / "context_far_scans.json").read_text())
    predicted = pd.read_csv(folder / "sequence_scans_predict" / "predictions.csv")  # scored on the slices' labels
    assert np.isclose(record["figures"]["auroc_sequence"], roc_auc_score(predicted["label"], predicted["prob_in_scan"]))


@pytest.mark.slow
def test_each_seed_fits_the_same_set_again_and_the_record_holds_their_spread(tmp_path):
    folder = tmp_path / "runs"
    context_seeds.main(["--patients", "12", "--slices", "4", "--epochs", "1", "--num_workers", "1", "--folder",
                        str(folder), "--rows", "alone", "--seeds", "0", "3", "--split", "0.5", "0.17", "0.33"],
                       records=tmp_path / "records")  # fmt: skip
    record = json.loads((tmp_path / "records" / "context_seeds.json").read_text())
    figures, rows = record["figures"], record["tables"]["seeds"]["rows"]
    assert [row[:2] for row in rows] == [["alone", 0], ["alone", 3], ["alone", "mean of 2"]]
    for seed in (0, 3):
        assert f"seed_everything: {seed}" in (folder / f"alone_seed{seed}" / "config.yaml").read_text()
        slices = pd.read_csv(folder / f"alone_seed{seed}_predict" / "predictions.csv")
        assert np.isclose(figures[f"auroc_alone_seed{seed}"], roc_auc_score(slices["label"], slices["prob"]))
    aurocs = [figures["auroc_alone_seed0"], figures["auroc_alone_seed3"]]
    assert np.isclose(figures["auroc_alone"], np.mean(aurocs)) and np.isclose(
        figures["auroc_sd_alone"], np.std(aurocs, ddof=1)
    )
    with pytest.raises(SystemExit):  # a seed twice is refused before any work
        context_seeds.main(["--seeds", "1", "1", "--folder", str(tmp_path / "never")], records=tmp_path / "records")
    assert not (tmp_path / "never").exists()


def test_a_held_out_familys_scans_carry_its_scanner_on_every_patient():
    far, near = (family_cohort(HELDOUT_FAMILIES[name][0]) for name in ("far", "near"))
    rng = np.random.default_rng(0)
    for _ in range(20):
        protocol = sample_protocol(rng, far.scanner, size=256)
        assert protocol.kernel == Kernel(1.3, 1.5) and protocol.pixel_spacing_mm == 1.25
        assert protocol.beam_hardening == 0.05 and 2e6 <= protocol.photons_per_ray / protocol_scale(protocol) <= 5e6
        kernel = sample_protocol(rng, near.scanner, size=256).kernel  # between Shepp-Logan and the plain ramp
        assert isinstance(kernel, Kernel) and 1.25 <= kernel.half_response <= 5.0 and kernel.edge_boost == 0
    assert far.bleed_hu_range == (45.0, 85.0) and far.low_contrast_fraction == 0.3 and far.small_fraction == 0.3


@pytest.mark.parametrize("name", ["ramp", "shepp-logan"])
def test_a_named_filter_becomes_the_kernel_with_its_response_at_nyquist(name):
    ramp = fourier_filter(256, "ramp")
    nyquist = 128  # FFT order: index size / 2 is the Nyquist frequency
    named = fourier_filter(256, name)[nyquist] / ramp[nyquist]
    kernel = fourier_filter(256, NAMED_KERNELS[name])[nyquist] / ramp[nyquist]
    assert abs(float(named) - float(kernel)) < 0.05
