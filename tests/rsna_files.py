"""Slices as the RSNA 2019 challenge ships them, written by pydicom: a minimal CT file of given HU, a real test file
under another patient, a round head phantom."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pydicom

from benchmarks.ct_files import write_ct


def write_ct_dicom(path: Path, hu: np.ndarray, patient_id: str) -> None:
    """A minimal CT Image Storage file: int16 stored = HU + 1024, intercept -1024."""
    write_ct(path, hu, patient_id)


def copy_with_patient(source: str, path: Path, patient_id: str) -> None:
    ds = pydicom.dcmread(source)
    ds.PatientID = patient_id
    ds.save_as(path)


def phantom_hu(size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size] - (size - 1) / 2
    return np.where(np.hypot(yy, xx) < 0.4 * size, 35.0, -1000.0) + rng.normal(0, 5, (size, size)).round()
