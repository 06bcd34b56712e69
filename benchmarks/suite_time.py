"""How long ``make test`` (and ``make floors``) take on a clean clone, install included, as a record for the README:
the commit is cloned into a temporary folder (``git clone``: tracked files only, no ``.venv``, no ``data/``), the
target run there from scratch (it creates its own virtual environment and installs the package: the package index, or
pip's cache, is needed), timed, and its pytest summary kept. Run it on a quiet machine: the figure is a wall time.

    python benchmarks/suite_time.py                  # make test  -> benchmarks/records/make_test.json
    python benchmarks/suite_time.py --target floors  # make floors -> benchmarks/records/make_floors.json
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vit_ct.run.records import RECORDS, ROOT, command_line, git_state, write_record

SUMMARY = re.compile(r"=+ (.*?) in [0-9.]+s")  # pytest's last line: "=== 573 passed, 1 skipped in 812.3s ==="


def counts(output: str) -> dict[str, int]:
    """Every pytest summary line's counts, summed: ``{"passed": 573, "skipped": 1}``."""
    total: dict[str, int] = {}
    for summary in SUMMARY.findall(output):
        for number, what in re.findall(r"(\d+) (\w+)", summary):
            total[what] = total.get(what, 0) + int(number)
    return total


def main(argv: list[str] | None = None, records: Path | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=("test", "floors"), default="test", help="the make target timed")
    parser.add_argument("--python", default=sys.executable, help="the Python that makes the clone's venv")
    args = parser.parse_args(argv)
    git = git_state()
    if git["dirty"]:
        print("the checkout has uncommitted changes: the clone times the last commit, without them", file=sys.stderr)
    folder = Path(tempfile.mkdtemp(prefix="vit-ct-suite-"))
    try:
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(folder / "vit-ct")], check=True)
        start = time.perf_counter()
        result = subprocess.run(["make", "-C", str(folder / "vit-ct"), args.target, f"PYTHON={args.python}"],
                                capture_output=True, text=True)  # fmt: skip
        seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    output = result.stdout + result.stderr
    figures = {"returncode": result.returncode, **counts(output)}
    print(output[-2000:])
    print(f"make {args.target}: {seconds:.0f} s, {figures}")
    if records is not None:
        write_record(f"make_{args.target}", figures, command=f"make {args.target}", seconds=seconds,
                     notes={"recorded_by": command_line("benchmarks/suite_time.py", argv), "clean_clone": True,
                            "install_included": True, "tail": output[-1500:]},
                     folder=records, git={"commit": git["commit"], "dirty": False})  # fmt: skip
    return figures


if __name__ == "__main__":
    main(records=RECORDS)
