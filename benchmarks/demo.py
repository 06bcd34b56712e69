"""The demo's record: ``make demo`` as a user runs it, in a copy of this checkout with an empty ``data/`` (the set is
built, the ViT trained, tested and predicted, the report printed), timed from the command to the report, its printed
report and figures written to ``benchmarks/records/demo.json`` for the README (``make docs``). The copy is a git
repository of its own, so the run also checks that ``make demo`` changes no tracked file and leaves no file git would
see. The installed ``.venv`` is reused (no install is timed) and the copy's code is the one imported; with
``--install`` the copy gets a ``.venv`` of its own, installed by ``make demo`` as on a fresh clone, and the install is
timed with the rest.

    python -m benchmarks.demo [--install]  # 7-15 min on 2 CPU cores; run it alone (flock /tmp/team/training.lock ...)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.recording import RECORDS, ROOT, command_line, git_state, write_record

EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+) .* ([0-9.]+) s$")  # a fit's line per epoch without a terminal
REPORT_START = "vit-ct demo: done"
MAKE_LINE = re.compile(r"^make(\[\d+\])?: ")  # make -C's "Leaving directory" lines, not the report's


def copy_checkout(destination: Path) -> None:
    """The files of this checkout a clone would hold plus the ones not yet committed (tracked and untracked, never
    ignored ones such as data/, runs/ or .venv), as a git repository with one commit."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # a file deleted but not yet committed is listed too
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    git = ["git", "-c", "user.name=demo", "-c", "user.email=demo@localhost"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the checkout as it was"]):
        subprocess.run([*git, *command], cwd=destination, check=True, capture_output=True)


def run_demo(checkout: Path, venv: Path | None, args: str = "") -> tuple[float, str]:
    """``make demo`` in ``checkout`` with the installed ``venv`` (never reinstalled; None: the copy's own ``.venv``,
    installed by ``make`` first) and the Makefile's ``ARGS``; wall seconds and its output."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}  # the copy's code, not the editable install's
    env.pop("VIRTUAL_ENV", None)
    command = ["make", "-C", str(checkout), "demo", f"ARGS={args}"]
    if venv is not None:
        command += [f"VENV={venv}", "-o", f"{venv}/.installed"]
    start = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"make demo failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return seconds, result.stdout


def report_of(output: str) -> str:
    """The report ``make demo`` printed last."""
    lines = output.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == REPORT_START]
    if not starts:
        raise RuntimeError(f"make demo printed no report (no line {REPORT_START!r}):\n{output[-3000:]}")
    return "\n".join(line for line in lines[starts[-1] :] if not MAKE_LINE.match(line)).rstrip()


def main(argv: list[str] | None = None, records: Path | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=Path(sys.executable).parent.parent, help="the installed venv")
    parser.add_argument("--keep", type=Path, help="build the copy here and keep it (default: a temporary folder)")
    parser.add_argument("--args", default="", help="make demo's ARGS (tests: tiny sizes); such a run writes no record")
    parser.add_argument("--install", action="store_true", help="a fresh .venv in the copy: the install is timed too")
    args = parser.parse_args(argv)
    folder = args.keep or Path(tempfile.mkdtemp(prefix="vit-ct-demo-"))
    checkout = folder / "vit-ct"
    if checkout.exists():
        raise ValueError(f"--keep {folder}: {checkout} exists already; the demo starts from an empty copy")
    git = git_state()
    try:
        copy_checkout(checkout)
        seconds, output = run_demo(checkout, None if args.install else args.venv.resolve(), args.args)
        report = report_of(output).replace(f"{checkout}/", "")  # paths as from the clone's folder, where it ran
        status = subprocess.run(["git", "status", "--porcelain"], cwd=checkout, capture_output=True, text=True)
        summary = json.loads((checkout / "runs" / "latest" / "summary.json").read_text())
        outputs = checkout / "outputs" / "demo"
        counts = {name: len((outputs / f"{name}.csv").read_text().splitlines()) - 1
                  for name in ("predictions", "scans") if (outputs / f"{name}.csv").is_file()}  # fmt: skip
    finally:
        if args.keep is None:
            shutil.rmtree(folder, ignore_errors=True)
    epochs = [float(m.group(3)) for line in output.splitlines() if (m := EPOCH_LINE.match(line.strip()))]
    metrics = {key: value for key, value in summary.get("metrics", {}).items() if isinstance(value, (int, float))}
    figures = {**metrics, "epochs": len(epochs), "epoch_s_min": min(epochs, default=None),
               "epoch_s_max": max(epochs, default=None), "install_included": int(args.install)}  # fmt: skip
    notes = {"report": report, "summary": summary, "rows": counts, "epoch_seconds": epochs,
             "tracked_files_unchanged": not status.stdout.strip(), "git_status_after": status.stdout}  # fmt: skip
    if status.stdout.strip():
        print(f"make demo changed the checkout:\n{status.stdout}", file=sys.stderr)
    print(report)
    if records is not None and args.args:
        print(f"--args {args.args}: not the demo as a user runs it, so no record is written", file=sys.stderr)
    elif records is not None:
        notes["recorded_by"] = command_line("benchmarks.demo", argv)
        write_record("demo", figures, command="make demo", seconds=seconds, notes=notes, folder=records, git=git)
        print(f"{command_line('benchmarks.demo', argv)}: make demo took {seconds:.0f} s", file=sys.stderr)
    return figures


if __name__ == "__main__":
    main(records=RECORDS)
