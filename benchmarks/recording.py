"""A measurement's record: the figures a benchmark, the demo or the card export measured, with the command, the commit
(and whether the tree had changes), the date and the machine, as one JSON file under ``benchmarks/records/``. The
README and docs state only figures a record holds: ``benchmarks/docs.py`` writes them in (``make docs``) and a test
keeps them equal.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks import processes
from benchmarks.processes import timed_vit_ct  # noqa: F401  (the benchmarks import it from here)
from vit_ct.files import atomic_write
from vit_ct.run.hardware import cpu_has_native_bf16, cpu_model, usable_cpus

ROOT = Path(__file__).resolve().parents[1]  # the checkout (benchmarks only run from one)
RECORDS = ROOT / "benchmarks" / "records"
NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")
# The files that write, format and check records: they measure nothing, so no record's code includes them (an edit of
# how a table is formatted does not make a measurement stale). What times a command lives in benchmarks/processes.py.
RECORD_KEEPING = frozenset({"benchmarks/recording.py", "benchmarks/docs.py"})


def machine() -> dict[str, Any]:
    """What a figure was measured on: the CPU model, the CPUs this process may use, native bf16, the torch build, the
    GPU if any, and the load average when the record is written (others' work on shared cores slows a timing)."""
    return {
        "cpu": cpu_model(),
        "cpus_usable": usable_cpus(),
        "native_bf16": cpu_has_native_bf16(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def describe(machine: dict[str, Any]) -> str:
    """``machine()`` in one line, as the docs print it beside a table."""
    bf16 = "yes" if machine["native_bf16"] else "no"
    text = f"{machine['cpu']}, {machine['cpus_usable']} CPUs usable, native bf16: {bf16}"
    if machine.get("gpu"):
        text += f", GPU {machine['gpu']}"
    return text + f", torch {machine['torch']}"


def git_state(folder: Path = ROOT) -> dict[str, Any]:
    """The commit checked out and whether tracked files differ from it (None for both outside a git checkout)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=folder,
                                capture_output=True, text=True, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def code_fingerprint(command: str, root: Path = ROOT) -> dict[str, str]:
    """The code a measurement ran, file by file (path relative to the checkout -> the first 16 hex digits of its
    SHA-256): every ``vit_ct`` and ``benchmarks`` module this process imported (the benchmark's helpers too), those
    the commands it ran through :func:`~benchmarks.processes.timed_vit_ct` imported, the configs the command names
    (``--config``) and the benchmark it runs (``-m benchmarks.NAME``). A command a benchmark starts another way (its
    own ``subprocess``) adds nothing, so this is the code to compare, not a proof: :func:`changed_code` says which of
    these files differ since. The record keeping itself (:data:`RECORD_KEEPING`) is left out."""
    files = {Path(m.__file__) for name, m in list(sys.modules.items())
             if name.split(".")[0] in ("vit_ct", "benchmarks") and getattr(m, "__file__", None)}  # fmt: skip
    files |= processes.CHILD_CODE
    words = shlex.split(command)
    files |= {root / b for a, b in zip(words, words[1:], strict=False) if a == "--config"}
    files |= {root / (b.replace(".", "/") + ".py") for a, b in zip(words, words[1:], strict=False)
              if a == "-m" and b.startswith("benchmarks.")}  # fmt: skip
    found = {}
    for path in sorted(files):
        path = path.resolve()
        if path.is_file() and path.is_relative_to(root) and path.relative_to(root).as_posix() not in RECORD_KEEPING:
            found[path.relative_to(root).as_posix()] = _digest(path)
    return found


def changed_code(record: dict[str, Any], root: Path = ROOT) -> list[str] | None:
    """The files of a record's :func:`code_fingerprint` that differ now (or are gone); None for a record written
    before records kept one. The record keeping that older records list (:data:`RECORD_KEEPING`) is not compared."""
    if "code" not in record:
        return None
    return sorted(relative for relative, digest in record["code"].items() if relative not in RECORD_KEEPING
                  and (not (root / relative).is_file() or _digest(root / relative) != digest))  # fmt: skip


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def command_line(module: str, argv: list[str] | None = None) -> str:
    """The command as a reader would type it again in the checkout: ``python -m MODULE ARGS`` (``argv`` None: this
    process's)."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def table(columns: list[str], rows: list[list[Any]], formats: list[str | None] | None = None) -> dict[str, Any]:
    """A table as a record keeps it: the raw values, and per column how the docs print them.

    Args:
        columns: the header.
        rows: one list of cells per row (numbers stay numbers; None prints as an empty cell).
        formats: per column, a format spec (``".1f"``), a template (``"{:.2f}x"``) or None (``str``). Columns whose
            format is given are right-aligned.
    """
    formats = list(formats) if formats is not None else [None] * len(columns)
    if len(formats) != len(columns) or any(len(row) != len(columns) for row in rows):
        raise ValueError(f"every row and the formats need {len(columns)} cells, one per column {columns}")
    return {"columns": list(columns), "formats": formats, "rows": [list(row) for row in rows]}


def cell(value: Any, spec: str | None) -> str:
    """One value as the docs print it."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if spec is None or isinstance(value, str):
        return str(value)
    if spec == "duration":
        return duration(value)
    return spec.format(value) if "{" in spec else format(value, spec)


def duration(seconds: float) -> str:
    """``448`` -> ``7 min 28 s``; under a minute ``52 s``; over an hour ``1 h 22 min``."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def markdown_table(table: dict[str, Any]) -> str:
    """A record's table as GitHub Markdown."""
    formats = table["formats"]
    lines = ["| " + " | ".join(table["columns"]) + " |"]
    lines.append("|" + "|".join("---:" if spec else "---" for spec in formats) + "|")
    for row in table["rows"]:
        lines.append("| " + " | ".join(cell(v, spec) for v, spec in zip(row, formats, strict=True)) + " |")
    return "\n".join(lines)


def write_record(
    name: str,
    figures: dict[str, Any],
    *,
    command: str,
    tables: dict[str, dict[str, Any]] | None = None,
    seconds: float | None = None,
    notes: dict[str, Any] | None = None,
    folder: Path = RECORDS,
    git: dict[str, Any] | None = None,
) -> Path:
    """Write ``folder/<name>.json`` (replacing an earlier record of that name, atomically) and return its path.

    Args:
        name: the record's name (lower case, digits, ``-``, ``_``), the file's stem that the docs refer to.
        figures: the headline figures, name -> number (or a short string).
        command: the command that measured them, as a reader types it (:func:`command_line`).
        tables: named tables (:func:`table`) the docs print whole.
        seconds: how long the measurement took, wall-clock.
        notes: anything else a reader needs to judge the figures (sizes, settings, what was left out).
        folder: where records are kept.
        git: the commit and whether the tree had changes when the measurement started (default: :func:`git_state`
            now); a long measurement takes it at its start, since others may commit meanwhile.

    Raises:
        ValueError: a bad name; or, for the project's records (``benchmarks/records/``), a tree with uncommitted
            changes, since the docs state figures of committed code only. The record keeps the code it ran
            (:func:`code_fingerprint`), so that ``benchmarks/docs.py --check`` can list what changed since.
    """
    if not NAME.fullmatch(name):
        raise ValueError(f"record name {name!r}: expected lower case letters, digits, '-' and '_'")
    git = git or git_state()
    if git.get("dirty") and Path(folder).resolve() == RECORDS.resolve():
        raise ValueError(
            f"record {name}: the checkout had uncommitted changes when the measurement started; a record the docs"
            " state measures committed code: commit, then measure again"
        )
    record = {
        "name": name,
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **git,
        "code": code_fingerprint(command),
        "machine": machine(),
        "seconds": None if seconds is None else round(float(seconds), 1),
        "figures": figures,
        "tables": tables or {},
        "notes": notes or {},
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    text = json.dumps(record, indent=1, allow_nan=True, default=_plain) + "\n"
    with atomic_write(path) as tmp:
        tmp.write_text(text)
    print(f"record written: {path}", file=sys.stderr)
    return path


def _plain(value: Any) -> Any:
    """numpy and torch scalars as Python numbers."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"a record holds numbers, strings, lists and dicts; got {type(value).__name__}")


def read_record(name: str, folder: Path = RECORDS) -> dict[str, Any]:
    """The record ``folder/<name>.json``.

    Raises:
        ValueError: no such record, or not a record (naming the file).
    """
    path = folder / f"{name}.json"
    if not path.is_file():
        there = sorted(p.stem for p in folder.glob("*.json"))
        raise ValueError(f"{path}: no such record (there are {there}); run the command that writes it")
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(record, dict) or not {"figures", "command", "machine"} <= set(record):
        raise ValueError(f"{path} is not a record: expected the keys figures, command and machine")
    return record
