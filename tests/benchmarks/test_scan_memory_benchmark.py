"""benchmarks/scan_memory.py: the set it builds (scan lengths, distinct slices, two manifests of the same rows whose
labels agree), and a small run of the whole benchmark through the real `vit-ct fit`, its record's figures checked
against each other and against the code's scan-bag memory layout."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from benchmarks import scan_memory


def test_scan_lengths_stay_in_range_and_add_up():
    lengths = scan_memory.scan_lengths(100_000, 3_000, 10, 80)
    assert lengths.sum() == 100_000 and len(lengths) == 3_000 and lengths.min() >= 10 and lengths.max() <= 80
    assert np.std(lengths) > 10  # they vary, as real series do (not all ~33)
    assert scan_memory.scan_lengths(30, 3, 10, 10).tolist() == [10, 10, 10]
    with pytest.raises(ValueError, match="--n 31 slices cannot be --scans 3 scans of 10 to 10"):
        scan_memory.scan_lengths(31, 3, 10, 10)


def test_the_set_lists_distinct_slices_twice_with_agreeing_labels_and_is_reused(tmp_path):
    lengths = scan_memory.scan_lengths(60, 4, 10, 20)
    manifests = scan_memory.build_set(tmp_path, lengths, size=16, bleed_fraction=0.5)
    by_slice, by_scan = pd.read_csv(manifests["slice"]), pd.read_csv(manifests["scan"])
    assert "scan_label" not in by_slice and "label" not in by_scan and len(by_slice) == len(by_scan) == 60
    assert (by_slice["image"] == by_scan["image"]).all() and (by_slice["scan"] == by_scan["scan"]).all()
    assert by_slice.groupby("scan").size().sort_index().tolist() == lengths.tolist()
    # a scan's label is the maximum of its slices' labels, the same on every row; some scans have a bleed, some not
    expected = by_slice.groupby("scan")["label"].transform("max")
    assert (by_scan["scan_label"] == expected).all() and set(by_scan["scan_label"]) == {0, 1}
    images = [np.load(tmp_path / name) for name in by_slice["image"]]
    assert all(image.shape == (16, 16) and image.dtype == np.float32 for image in images)
    assert len({image.tobytes() for image in images}) == 60  # no copies of one image
    stamp = (tmp_path / "set.json").stat().st_mtime_ns
    assert scan_memory.build_set(tmp_path, lengths, size=16, bleed_fraction=0.5) == manifests
    assert (tmp_path / "set.json").stat().st_mtime_ns == stamp  # kept, not rebuilt
    scan_memory.build_set(tmp_path, lengths, size=20, bleed_fraction=0.5)  # other settings: rebuilt
    assert np.load(tmp_path / by_slice["image"][0]).shape == (20, 20)


@pytest.mark.slow
def test_the_benchmark_trains_both_manifests_and_records_consistent_figures(tmp_path):
    """300 slices in 12 scans of 10 to 45, batches of 32 (so that the long scans are cut), both kinds through
    `vit-ct fit`, two epochs."""
    figures = scan_memory.main(["--root", str(tmp_path / "set"), "--n", "300", "--scans", "12", "--batch_size", "32",
                                "--epochs", "2", "--val_batches", "1", "--cache", "false",
                                "--records", str(tmp_path / "records")])  # fmt: skip
    record = json.loads((tmp_path / "records" / "scan_memory.json").read_text())
    assert record["figures"] == pytest.approx(figures) and record["command"].startswith(
        "python -m benchmarks.scan_memory"
    )
    runs = record["notes"]["runs"]
    assert [(r["kind"], r["status"]) for r in runs] == [("slice", 0), ("scan", 0)] and figures["cache_false_finished"]
    slice_peak, scan_peak = figures["cache_false_slice_peak_mib"], figures["cache_false_scan_peak_mib"]
    assert slice_peak > 100 and scan_peak > 100  # a process with torch loaded, read from the kernel
    assert math.isfinite(figures["cache_false_ratio"])
    assert figures["cache_false_ratio"] == pytest.approx(scan_peak / slice_peak)
    # batches never exceed the batch size; scans longer than a batch exist, so scans were cut across batches, at
    # most one at each border between two batches of an epoch, and not every scan (most fit whole)
    scan_run = next(r for r in runs if r["kind"] == "scan")
    assert figures["scans_longer_than_batch"] > 0 and figures["longest_scan"] > 32
    assert figures["cache_false_largest_batch"] == 32 and 1 <= figures["cache_false_most_of_one_scan"] <= 32
    assert 1 <= figures["cache_false_scans_cut"] <= scan_run["batches"] - 2
    assert figures["cache_false_scans_cut"] < figures["cache_false_scans_trained"]
    # the scan-bag memory: one row per training slice, (K=2) float32 evidence + an int64 scan each
    assert figures["scan_memory_rows"] == scan_run["training_rows"] and 0 < scan_run["training_rows"] < 300
    assert figures["scan_memory_columns"] == 2 and figures["scan_memory_bytes_per_slice"] == 2 * 4 + 8
    slice_run = next(r for r in runs if r["kind"] == "slice")
    assert slice_run["scan_memory_bytes"] == 0  # slice labels: nothing remembered
    assert scan_run["peak_before_training_kib"] <= scan_run["peak_after_training_kib"] <= scan_run["peak_kib"]
    # every peak is the process's own, written as it ended (two checks, two fits), not wait4's count, which starts
    # from this test process's own high-water mark
    assert len(list((tmp_path / "set" / "runs").rglob("*.peak"))) == 4
