"""Hand-built CT files for the benchmarks and the tests: a minimal CT Image Storage DICOM (int16, HU + 1024 stored,
intercept -1024, as most scanners and RSNA's files store it) and the first rows of a manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid


def ct_dataset(hu: np.ndarray, patient_id: str, **attributes: Any) -> Dataset:
    """A CT Image Storage dataset of the 2D array ``hu`` (rounded to whole HU; -1024 is the floor int16 + 1024 keeps),
    with ``attributes`` (e.g. ``PixelSpacing``, ``ImagePositionPatient``) set on it."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = CTImageStorage, generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = CTImageStorage, meta.MediaStorageSOPInstanceUID
    ds.Modality, ds.PatientID = "CT", patient_id
    for name, value in attributes.items():
        setattr(ds, name, value)
    ds.Rows, ds.Columns = hu.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
    ds.RescaleSlope, ds.RescaleIntercept = 1, -1024
    ds.PixelData = np.clip(np.round(np.asarray(hu, np.float64) + 1024), -32768, 32767).astype("<i2").tobytes()
    return ds


def write_ct(path: str | Path, hu: np.ndarray, patient_id: str, **attributes: Any) -> Path:
    """:func:`ct_dataset` saved as a DICOM file at ``path``."""
    ct_dataset(hu, patient_id, **attributes).save_as(path, enforce_file_format=True)
    return Path(path)


def head_of(manifest: Path, n: int, prefix: str = "manifest") -> Path:
    """A manifest of the first ``n`` rows of ``manifest``, beside it as ``<prefix>_<n>.csv`` (its own check record and
    cache)."""
    path = manifest.with_name(f"{prefix}_{n}.csv")
    path.write_text("\n".join(manifest.read_text().splitlines()[: n + 1]) + "\n")
    return path
