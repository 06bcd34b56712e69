"""Whole simulated scans: contiguous slices of one head, each bleed a 3-D object that the slices it reaches show,
narrowing away from its centre; what a model that reads a slice with its neighbours learns from."""

from __future__ import annotations

import json

import numpy as np
import pydicom
import pytest

from vit_ct.sim.anatomy import HEAD_HEIGHT_MM
from vit_ct.sim.cohort import CohortConfig, simulate_cohort_patient
from vit_ct.sim.cohort_scan import simulate_cohort_scan
from vit_ct.sim.pretraining import write_pretraining_set

SMALL = CohortConfig(size=96, bleed_fraction=1.0)


@pytest.fixture(scope="module")
def scans():
    return [simulate_cohort_scan(3, index, 14, SMALL, spacing_mm=5.0, acquire=False) for index in range(12)]


def test_slices_lie_at_the_spacing_through_one_head_and_scanner(scans):
    for index, scan in enumerate(scans):
        heights = np.array([s.level for s in scan]) * HEAD_HEIGHT_MM
        np.testing.assert_allclose(np.diff(heights), 5.0, atol=1e-9)
        assert heights[0] >= 0.0 and heights[-1] <= HEAD_HEIGHT_MM
        # the patient's head and scanner are the cohort's patient of that index
        spread = simulate_cohort_patient(3, index, 1, SMALL, acquire=False)[0]
        scanner = {k: v for k, v in scan[0].settings.items() if k != "motion_mm"}  # motion: the slice's own
        assert scanner == {k: v for k, v in spread.settings.items() if k != "motion_mm"}
        assert scan[0].pixel_spacing_mm == spread.pixel_spacing_mm


def test_a_bleed_spans_a_run_of_neighbouring_slices(scans):
    spans = []
    for scan in scans:
        labels = np.array([s.label for s in scan])
        positive = np.flatnonzero(labels)
        if not positive.size:
            continue
        assert (np.diff(positive) == 1).all(), labels  # one bleed: one unbroken run of slices
        kinds = {s.bleed_type for s in scan if s.label}
        assert len(kinds) == 1
        spans.append(len(positive))
    assert len(spans) >= 8 and max(spans) >= 3  # every patient has a bleed (bleed_fraction 1); most span slices


def test_the_same_arguments_give_the_same_scan_and_a_scan_taller_than_the_head_is_refused():
    a = simulate_cohort_scan(5, 2, 6, SMALL, spacing_mm=2.5, acquire=False)
    b = simulate_cohort_scan(5, 2, 6, SMALL, spacing_mm=2.5, acquire=False)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.hu, y.hu)
        np.testing.assert_array_equal(x.mask, y.mask)
    with pytest.raises(ValueError, match="must fit the head's 100 mm"):
        simulate_cohort_scan(5, 2, 30, SMALL, spacing_mm=5.0)


def test_the_pretraining_writer_writes_whole_scans_with_their_positions(tmp_path):
    config = CohortConfig(size=64)
    manifest = write_pretraining_set(tmp_path / "scans", n_patients=8, slices_per_patient=6, config=config,
                                     scan_spacing_mm=4.0, progress=False)  # fmt: skip
    assert json.loads((tmp_path / "scans" / "generator.json").read_text())["scan_spacing_mm"] == 4.0
    patient = sorted((tmp_path / "scans" / "images").iterdir())[0]
    z = [float(pydicom.dcmread(p).ImagePositionPatient[2]) for p in sorted(patient.glob("*.dcm"))]
    np.testing.assert_allclose(np.diff(z), 4.0, atol=2e-3)
    assert manifest.is_file()
    # a set written without scans records no scan spacing, as sets written before the option existed
    write_pretraining_set(tmp_path / "spread", n_patients=8, slices_per_patient=6, config=config, progress=False)
    assert "scan_spacing_mm" not in json.loads((tmp_path / "spread" / "generator.json").read_text())
