"""Start-up of the commands that need no model, each in a fresh process: ``vit-ct --help``, ``vit-ct manifest
--help``, ``python -m vit_ct.model.shipped list`` and ``import vit_ct``, beside ``vit-ct fit --help`` (the full
LightningCLI parser, which needs torch, Lightning and timm) and a bare ``python`` (the interpreter's own start).
Each command runs ``--repeats`` times, commands alternated, and reports its fastest and median wall time (from
starting the process to its exit); then ``python -X importtime`` once per command: the seconds spent importing, and
torch's, Lightning's and timm's share of them. With ``--baseline REV`` the same commands run the code of another
commit (checked out in a temporary git worktree, put first on ``PYTHONPATH``), alternated with this tree's, so that a
busy machine slows both alike.

    python -m benchmarks.startup [--repeats 7] [--baseline 21b1848]

Run as a script it writes its record, ``benchmarks/records/startup.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
VIT_CT = str(Path(PYTHON).with_name("vit-ct"))
# the console script's own two lines, for code on PYTHONPATH (a baseline's worktree) instead of the installed package
VIT_CT_FROM_PATH = ["-c", "import sys; from vit_ct.cli import main; sys.exit(main())"]
COMMANDS = {  # name -> (the record's key, the program, its arguments)
    "vit-ct --help": ("help", "vit-ct", ["--help"]),
    "vit-ct manifest --help": ("manifest_help", "vit-ct", ["manifest", "--help"]),
    "python -m vit_ct.model.shipped list": ("shipped_list", "python", ["-m", "vit_ct.model.shipped", "list"]),
    'python -c "import vit_ct"': ("import_vit_ct", "python", ["-c", "import vit_ct"]),
    "vit-ct fit --help": ("fit_help", "vit-ct", ["fit", "--help"]),
    'python -c "pass"': ("python", "python", ["-c", "pass"]),
}
PACKAGES = ("torch", "lightning", "timm")
# The commands run here: `python -c` and `-m` put the working folder first on sys.path, which in the checkout would
# import this tree's vit_ct for the baseline too.
NEUTRAL = Path(tempfile.gettempdir())


def command(name: str, code: Path | None) -> list[str]:
    """The command line of ``name`` (after ``python``); ``code`` None: this tree, through the installed ``vit-ct``."""
    _, program, args = COMMANDS[name]
    if program == "python":
        return args
    return [*(VIT_CT_FROM_PATH if code is not None else [VIT_CT]), *args]


def environment(code: Path | None) -> dict[str, str]:
    env = {**os.environ, "WANDB_MODE": "offline"}
    if code is not None:  # before the editable install's finder, which Python consults after PYTHONPATH
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), env.get("PYTHONPATH")]))
    return env


def wall_time(name: str, code: Path | None) -> float:
    """Seconds from starting the command's process to its exit; the command must succeed."""
    start = time.perf_counter()
    run = subprocess.run([PYTHON, *command(name, code)], env=environment(code), cwd=NEUTRAL, capture_output=True,
                         text=True)  # fmt: skip
    seconds = time.perf_counter() - start
    if run.returncode != 0:
        raise RuntimeError(f"{name} failed ({run.returncode}): {run.stderr[-2000:]}")
    return seconds


def import_times(name: str, code: Path | None) -> dict[str, float]:
    """``python -X importtime``'s report of one run of the command: every import's own time summed (``imports``) and
    the cumulative time of each of :data:`PACKAGES` where it was imported (0 when it was not), in seconds."""
    run = subprocess.run([PYTHON, "-X", "importtime", *command(name, code)], env=environment(code), cwd=NEUTRAL,
                         capture_output=True, text=True)  # fmt: skip
    own, cumulative = 0, {}
    for line in run.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cumulative_us, module = (part.strip() for part in line.removeprefix("import time:").split("|"))
        own += int(self_us)
        cumulative.setdefault(module, int(cumulative_us))
    return {"imports": own / 1e6, **{package: cumulative.get(package, 0) / 1e6 for package in PACKAGES}}


@contextlib.contextmanager
def worktree(revision: str | None) -> Iterator[Path | None]:
    """The code of ``revision`` in a temporary git worktree (None: this tree's), removed afterwards."""
    if revision is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="vit-ct-startup-") as folder:
        path = Path(folder) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(path), revision], cwd=ROOT, check=True,
                       capture_output=True)  # fmt: skip
        try:
            found = subprocess.run([PYTHON, "-c", "import vit_ct; print(vit_ct.__file__)"], env=environment(path),
                                   cwd=NEUTRAL, capture_output=True, text=True).stdout.strip()  # fmt: skip
            if not found.startswith(str(path)):
                raise RuntimeError(f"the baseline imports vit_ct from {found!r}, not from its worktree {path}")
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True)


def main(argv: list[str] | None = None, records: Path | None = None) -> dict:
    """Measure and print the table; with ``records`` (a folder) also write the record ``startup.json`` there."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="runs of each command (and of each side)")
    parser.add_argument("--baseline", help="a commit to measure beside this tree, e.g. the one before a change")
    parser.add_argument("--commands", nargs="+", choices=list(COMMANDS), default=list(COMMANDS), metavar="NAME")
    args = parser.parse_args(argv)
    from benchmarks.recording import command_line, describe, git_state, machine, markdown_table, table, write_record

    git, started = git_state(), time.monotonic()
    sides = {"now": None, "baseline": args.baseline} if args.baseline else {"now": None}
    times: dict[tuple[str, str], list[float]] = {(side, name): [] for side in sides for name in args.commands}
    imports: dict[tuple[str, str], dict[str, float]] = {}
    with worktree(args.baseline) as baseline:
        trees = {"now": None, "baseline": baseline}
        for name in args.commands:  # a first, unmeasured run of each: the files in the page cache for both sides
            for side in sides:
                wall_time(name, trees[side])
        for _ in range(args.repeats):
            for name in args.commands:
                for side in sides:
                    times[side, name].append(wall_time(name, trees[side]))
        for name in args.commands:
            for side in sides:
                imports[side, name] = import_times(name, trees[side])
    columns = ["command", "min s", "median s", "imports s", "torch / Lightning / timm s"]
    rows = []
    for name in args.commands:
        for side in sides:
            label = name if side == "now" else f"{name} at {args.baseline}"
            found = imports[side, name]
            packages = " / ".join(f"{found[p]:.2f}" for p in PACKAGES)
            rows.append([label, min(times[side, name]), statistics.median(times[side, name]), found["imports"],
                         packages])  # fmt: skip
    startup = table(columns, rows, [None, ".2f", ".2f", ".2f", None])
    print(f"\nStart-up on {describe(machine())}; {args.repeats} runs of each, alternated\n")
    print(markdown_table(startup))
    figures = {}
    for name in args.commands:
        key = COMMANDS[name][0]
        figures[f"{key}_min_s"] = round(min(times["now", name]), 3)
        figures[f"{key}_median_s"] = round(statistics.median(times["now", name]), 3)
        figures[f"{key}_imports_s"] = round(imports["now", name]["imports"], 3)
        if args.baseline:
            figures[f"{key}_baseline_median_s"] = round(statistics.median(times["baseline", name]), 3)
    if records is not None:
        notes = {"repeats": args.repeats, "baseline": args.baseline, "times_s": {
            f"{side} | {name}": [round(t, 3) for t in found] for (side, name), found in times.items()},
            "imports_s": {f"{side} | {name}": found for (side, name), found in imports.items()}}  # fmt: skip
        write_record("startup", figures, command=command_line("benchmarks.startup", argv),
                     tables={"startup": startup}, seconds=time.monotonic() - started, notes=notes, folder=records,
                     git=git)  # fmt: skip
    return figures


if __name__ == "__main__":
    from benchmarks.recording import RECORDS

    main(records=RECORDS)
