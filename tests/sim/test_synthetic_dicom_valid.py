"""The simulator's CT files pass dciodvfy (dicom3tools) without errors: a user may load them into a PACS."""

from __future__ import annotations

import pydicom
from dicom_validation import dciodvfy_findings


def test_simulated_ct_files_pass_dciodvfy_without_errors(synthetic_set):
    files = sorted((synthetic_set.parent / "images").glob("*/*.dcm"))
    assert len(files) == 24  # 6 patients x 4 slices
    for path in files[:4] + files[-4:]:  # two patients: a file takes dciodvfy ~0.1 s
        errors, warnings = dciodvfy_findings(path)
        assert errors == [], f"{path}: {errors}"
        assert warnings == [], f"{path}: {warnings}"
    ds = pydicom.dcmread(files[0])
    assert (ds.PatientPosition, ds.AcquisitionNumber, ds.PositionReferenceIndicator) == ("HFS", 1, "")
