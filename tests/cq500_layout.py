"""CQ500 as its archive unpacks (``CQ500CT<N> CQ500CT<N>/Unknown Study/CT <series>/CT<6 digits>.dcm``, real CT DICOM
written by pydicom, several series per study, and reads.csv with its 43 columns), for the tests of the converter and
of the README's own-data path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydicom.uid import generate_uid

from benchmarks.ct_files import write_ct

FINDINGS = ["ICH", "IPH", "IVH", "SDH", "EDH", "SAH", "BleedLocation-Left", "BleedLocation-Right", "ChronicBleed",
            "Fracture", "CalvarialFracture", "OtherFracture", "MassEffect", "MidlineShift"]  # fmt: skip
HEADER = ["name", "Category", *(f"R{r}:{f}" for r in (1, 2, 3) for f in FINDINGS)]
READS = {  # study -> (category, {finding: reads of R1, R2, R3}); findings not named are 0 for all three
    0: ("B1", {"ICH": (1, 1, 0), "IPH": (1, 0, 0), "SDH": (0, 1, 0), "Fracture": (1, 1, 0)}),
    1: ("B1", {"ICH": (0, 0, 1)}),
    2: ("B2", {"ICH": (1, 1, 1), "SDH": (1, 0, 1), "EDH": (0, 1, 0), "MidlineShift": (1, 1, 1)}),
    3: ("B2", {"ICH": (1, 1, 0), "SAH": (1, 1, 1), "IVH": (0, 1, 1)}),
}
# study -> series: (folder under "Unknown Study", slice thickness mm, images, ConvolutionKernel, extra tags)
SERIES = {
    0: [("CT PLAIN THIN", 0.625, 16, "H30s", {}), ("CT Plain", 5.0, 12, "H30s", {}), ("CT 5mm", 5.0, 12, "H70h", {})],
    1: [("CT 2.55mm", 2.5, 14, "STANDARD", {}), ("CT 5mm", 5.0, 11, "STANDARD", {}),
        ("CT 5mm POST CONTRAST", 2.5, 14, "STANDARD", {"ContrastBolusAgent": "OMNIPAQUE"})],
    2: [("CT Thin Plain", 0.625, 20, "SOFT", {}), ("CT Thin Bone", 0.625, 20, "BONE", {}),
        ("CT PRE CONTRAST BONE", 5.0, 12, "BONE", {}), ("CT SCOUT", 1.0, 2, "STANDARD", {"ImageType": "LOCALIZER"})],
    3: [("CT 5mm", 5.0, 12, "STANDARD", {}), ("CT 5mm-2", 5.0, 13, "STANDARD", {})],
}  # fmt: skip


def write_series(folder: Path, study: int, study_uid: str, thickness: float, images: int, kernel: str, extra) -> None:
    """Axial CT slices, files numbered against the slice order (the converter must order by position); the pixel
    (0, 0) of the k-th slice along the scan is 100 + k HU, the rest air and brain; stored HU + 1024, intercept -1024."""
    folder.mkdir(parents=True)
    series_uid = generate_uid()
    for k in range(images):
        hu = np.full((16, 14), 30, np.int16)
        hu[:, :2] = -1000
        hu[0, 0] = 100 + k
        attributes = {
            "ImageType": ["ORIGINAL", "PRIMARY", extra.get("ImageType", "AXIAL")],
            **({"ContrastBolusAgent": extra["ContrastBolusAgent"]} if "ContrastBolusAgent" in extra else {}),
        }
        write_ct(folder / f"CT{images - 1 - k:06d}.dcm", hu, f"CQ500-CT-{study}", StudyInstanceUID=study_uid,
                 SeriesInstanceUID=series_uid, SeriesDescription=folder.name.removeprefix("CT "),
                 ConvolutionKernel=kernel, SliceThickness=thickness,
                 ImagePositionPatient=[-60.0, -70.0, -40.0 + k * thickness], ImageOrientationPatient=[1, 0, 0, 0, 1, 0],
                 PixelSpacing=[0.45, 0.45], InstanceNumber=images - k, **attributes)  # fmt: skip


def write_reads(path: Path, studies) -> None:
    rows = []
    for study in studies:
        category, reads = READS.get(study, ("B1", {}))
        cells = [str(reads.get(f, (0, 0, 0))[r]) for r in range(3) for f in FINDINGS]
        rows.append(",".join([f"CQ500-CT-{study}", category, *cells]))
    path.write_text("\n".join([",".join(HEADER), *rows]) + "\n")


@pytest.fixture
def cq500_root(tmp_path) -> Path:
    return write_cq500(tmp_path / "cq500")


def write_cq500(root: Path) -> Path:
    """CQ500 as downloaded and unpacked under ``root``: SERIES' studies and their reads.csv; returns ``root``."""
    for study, series in SERIES.items():
        folder = root / f"CQ500CT{study} CQ500CT{study}"
        if study == 3:  # unpacked into a folder of its own archive's name
            folder = root / "CQ500-CT-3" / folder.name
        study_uid = generate_uid()
        for name, thickness, images, kernel, extra in series:
            write_series(folder / "Unknown Study" / name, study, study_uid, thickness, images, kernel, extra)
    write_reads(root / "reads.csv", SERIES)
    return root
