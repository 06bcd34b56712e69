"""A real Orthanc (Debian's, with its DICOMweb plugin) on a loopback port for the PACS tests (benchmarks/orthanc.py
starts it): skipped where it is missing, failed under ``CI``; and a synthetic study to store in it."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.orthanc import IN_CI, INSTALL, MISSING, running_orthanc
from vit_ct.sim.phantom import PhantomConfig
from vit_ct.sim.synthetic import simulate_patient, write_slices

USERS = {"reader": "right-password"}
needs_orthanc = pytest.mark.skipif(
    bool(MISSING) and not IN_CI, reason=f"needs {' and '.join(MISSING)} ({INSTALL}); CI fails instead"
)


def require_orthanc():
    """Under CI a missing Orthanc fails the test (elsewhere ``needs_orthanc`` skipped it already)."""
    if MISSING:
        pytest.fail(f"CI is set and {' and '.join(MISSING)} is not installed: CI must run the PACS tests; install it"
                    f" ({INSTALL}; .ci/run does), or unset CI to skip them", pytrace=False)  # fmt: skip


@pytest.fixture(scope="module")
def orthanc(tmp_path_factory):
    """An Orthanc without authentication: its DICOMweb root URL."""
    require_orthanc()
    with running_orthanc(tmp_path_factory.mktemp("orthanc")) as url:
        yield url


@pytest.fixture(scope="module")
def orthanc_with_user(tmp_path_factory):
    """An Orthanc that asks for basic auth (user ``reader``)."""
    require_orthanc()
    with running_orthanc(tmp_path_factory.mktemp("orthanc-auth"), users=USERS) as url:
        yield url


def write_study(folder: Path, patient: str, n_slices: int = 3, seed: int = 7) -> list[Path]:
    """The simulator's DICOM series of one synthetic patient (its own study): the CT files, lowest slice first."""
    index = int(patient.rsplit("-", 1)[1])
    slices = simulate_patient(seed, index, n_slices, PhantomConfig(size=64, pixel_spacing_mm=3.6))
    write_slices(slices, seed=seed, pid=patient, images=folder / "images", masks=folder / "masks")
    return sorted((folder / "images").glob("*.dcm"))
