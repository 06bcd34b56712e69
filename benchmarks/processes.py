"""Commands a benchmark times as a user runs them: ``python -m vit_ct ARGS`` in a fresh process on this checkout's
code, whose imported ``vit_ct`` modules join the record's code (:func:`benchmarks.recording.code_fingerprint`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout

# `python -m vit_ct ARGS` that, as it exits, writes the files of the vit_ct modules it imported to the path it is
# given first: the code a command started as a process ran, for this process's record (code_fingerprint)
_LISTING_VIT_CT = """
import atexit, json, os, runpy, sys
listing = sys.argv.pop(1)
def write():
    files = {getattr(m, "__file__", None) for n, m in list(sys.modules.items()) if n.split(".")[0] == "vit_ct"}
    files.add(os.path.join(os.path.dirname(sys.modules["vit_ct"].__file__), "__main__.py"))  # run as __main__
    with open(listing, "w") as out:
        json.dump(sorted(f for f in files if f), out)
atexit.register(write)
runpy.run_module("vit_ct", run_name="__main__", alter_sys=True)
"""
CHILD_CODE: set[Path] = set()  # the vit_ct files the commands timed_vit_ct ran imported, in this process's run


def timed_vit_ct(*args: str) -> float:
    """Wall seconds of ``python -m vit_ct ARGS`` in a fresh process running this checkout's code (first on
    PYTHONPATH), as a benchmark times a command a user runs; raises with the end of its stderr if it fails. The
    modules it imported join the record's code (:data:`CHILD_CODE`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="vit-ct-imports-") as folder:
        listing = Path(folder) / "modules.json"
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", _LISTING_VIT_CT, str(listing), *args], env=env,
                                capture_output=True, text=True)  # fmt: skip
        seconds = time.perf_counter() - start
        if listing.is_file():  # (a process killed hard writes none: its code is then what this one imported)
            CHILD_CODE.update(Path(f) for f in json.loads(listing.read_text()))
    if result.returncode != 0:
        raise RuntimeError(f"vit-ct {args[0]} failed ({result.returncode}): {result.stderr[-3000:]}")
    return seconds
