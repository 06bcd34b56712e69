"""How long the test tiers take on a clean clone, as records for the README: the commit is cloned into a temporary
folder (``git clone``: tracked files only, no ``.venv``, no ``data/``), its virtual environment made and the package
installed (timed apart: the package index, or pip's cache, is needed), then each target timed in turn and its pytest
summary and slowest tests kept. ``CI=true``, as ``.ci/run`` sets it: a missing Orthanc or Chromium fails its tests.
Run it on a quiet machine: the figures are wall times.

    python -m benchmarks.suite_time                          # make check, make test -> records make_check, make_test
    python -m benchmarks.suite_time --targets floors         # make floors -> benchmarks/records/make_floors.json
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.recording import RECORDS, ROOT, command_line, git_state, write_record

# pytest's last line: "=== 573 passed, 1 skipped in 812.3s ===" ("573 passed, 1 skipped in 812.3s" with -q)
SUMMARY = re.compile(r"^=* ?(\d+ \w+(?:, \d+ \w+)*) in [0-9.]+s", re.M)
DURATION = re.compile(r"^\s*([0-9.]+)s (call|setup|teardown)\s+(\S+)", re.M)  # pytest --durations lines
SLOWEST = 20


def counts(output: str) -> dict[str, int]:
    """Every pytest summary line's counts, summed: ``{"passed": 573, "skipped": 1}``."""
    total: dict[str, int] = {}
    for summary in SUMMARY.findall(output):
        for number, what in re.findall(r"(\d+) (\w+)", summary):
            total[what] = total.get(what, 0) + int(number)
    return total


def slowest(output: str, n: int = SLOWEST) -> list[dict]:
    """The ``n`` slowest phases pytest's ``--durations`` listed: ``{"seconds", "phase", "test"}``, slowest first."""
    found = [{"seconds": float(s), "phase": phase, "test": test} for s, phase, test in DURATION.findall(output)]
    return sorted(found, key=lambda row: -row["seconds"])[:n]


def timed(command: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    return time.perf_counter() - start, result


def main(argv: list[str] | None = None, records: Path | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="+", choices=("check", "test", "floors"), default=["check", "test"],
                        help="the make targets timed, in this order")  # fmt: skip
    parser.add_argument("--python", default=sys.executable, help="the Python that makes the clone's venv")
    args = parser.parse_args(argv)
    git = git_state()
    if git["dirty"]:
        print("the checkout has uncommitted changes: the clone times the last commit, without them", file=sys.stderr)
    env = {**os.environ, "CI": "true"}
    folder = Path(tempfile.mkdtemp(prefix="vit-ct-suite-"))
    clone = folder / "vit-ct"
    results: dict[str, dict] = {}
    try:
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)], check=True)
        make = ["make", "-C", str(clone), f"PYTHON={args.python}"]
        install_s, installed = timed([*make, ".venv/.installed"], env)
        if installed.returncode != 0:
            raise RuntimeError(f"the install failed:\n{(installed.stdout + installed.stderr)[-3000:]}")
        print(f"install: {install_s:.0f} s", flush=True)
        for target in args.targets:
            seconds, result = timed([*make, target], env)
            output = result.stdout + result.stderr
            figures = {"returncode": result.returncode, "minutes": seconds / 60, **counts(output)}
            print(output[-1500:])
            print(f"make {target}: {seconds:.0f} s, {figures}", flush=True)
            results[target] = figures
            if records is not None:
                write_record(f"make_{target}", figures, command=f"make {target}", seconds=seconds,
                             notes={"recorded_by": command_line("benchmarks.suite_time", argv), "clean_clone": True,
                                    "install_s": round(install_s, 1), "install_included": target == "floors",
                                    "slowest": slowest(output), "tail": output[-1500:]},
                             folder=records, git={"commit": git["commit"], "dirty": False})  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return results


if __name__ == "__main__":
    main(records=RECORDS)
