"""dciodvfy (Debian ``dicom3tools``), the standard validator of DICOM objects, run on written files. Under CI (``CI``
set, as CI services and .ci/run do) a missing dciodvfy fails the test that needs it; elsewhere that test is skipped,
saying what to install."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
INSTALL = "Debian/Ubuntu: apt-get install dicom3tools"


def dciodvfy() -> str:
    """Path of dciodvfy; skips the calling test without it, or fails it under CI."""
    path = shutil.which("dciodvfy")
    if path is None:
        if IN_CI:
            pytest.fail(
                f"CI={os.environ.get('CI')} and dciodvfy not on PATH: CI must validate the DICOM objects; install it"
                f" ({INSTALL}; .ci/run does), or unset CI to skip it",
                pytrace=False,
            )
        pytest.skip(f"needs dciodvfy on PATH ({INSTALL}); CI fails instead")
    return path


def dciodvfy_findings(path: Path) -> tuple[list[str], list[str]]:
    """``(errors, warnings)``: dciodvfy's lines on ``path``, ``Error``/``Abort`` lines as errors (an ``Abort`` is a
    file it could not read to the end)."""
    run = subprocess.run([dciodvfy(), str(path)], capture_output=True, text=True, timeout=60)
    lines = (run.stdout + run.stderr).splitlines()
    errors = [line for line in lines if line.startswith(("Error", "Abort"))]
    warnings = [line for line in lines if line.startswith("Warning")]
    return errors, warnings
