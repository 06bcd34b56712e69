"""The manifest check's worker processes die with the process that started them: a check killed with SIGKILL left its
two workers re-parented, blocked on a pipe with a copy of the parent's memory, until killed by hand."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from npy_manifest import write_npy_manifest

# The real check with 2 workers on 400 slices made slow to read (25 ms each: ~5 s), so that the kill finds it busy.
_CHECK = """
import sys, time
from vit_ct.data.manifests import manifest_files
from vit_ct.data.manifests.manifest import read_manifest, validate_manifest_files

real = manifest_files.read_ct_slice
def slow(*args, **kwargs):
    time.sleep(0.025)
    return real(*args, **kwargs)

manifest_files.read_ct_slice = slow
print("checking", flush=True)
validate_manifest_files(read_manifest(sys.argv[1]), progress=False, workers=2)
print("done", flush=True)
"""


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def alive(pid: int) -> bool:
    """Running or sleeping; a zombie (dead, waiting to be reaped by whoever adopted it) is not alive."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.medium
def test_killing_the_check_with_sigkill_leaves_no_worker(tmp_path):
    manifest = write_npy_manifest(tmp_path / "data", train=300, val=100, test=0, size=16)
    check = subprocess.Popen([sys.executable, "-c", _CHECK, str(manifest)], stdout=subprocess.PIPE, text=True)
    try:
        assert check.stdout.readline().strip() == "checking"
        deadline = time.monotonic() + 120
        while len(workers := children(check.pid)) < 2:  # the pool starts its workers with the first jobs
            assert time.monotonic() < deadline and check.poll() is None, "the check never started its workers"
            time.sleep(0.05)
        time.sleep(1.0)  # mid-check
        assert check.poll() is None, "the check ended before it could be killed: make it slower"
        check.kill()
        check.wait()
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        survivors = [pid for pid in workers if alive(pid)]
    finally:
        for pid in children(check.pid) if check.poll() is None else []:
            os.kill(pid, signal.SIGKILL)
    for pid in survivors:  # leave nothing behind even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert survivors == [], f"check workers {survivors} outlived their parent"


_WATCHED = """
import os, sys, time
from vit_ct.data.manifests import check_workers
check_workers._POLL_SECONDS = 0.05
parent = os.getppid()
if os.fork() == 0:  # a grandchild bound to this process by the portable watchdog alone (no prctl)
    check_workers.sys.platform = "other"
    check_workers.die_with_parent(parent=os.getppid())
    print(os.getpid(), flush=True)
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""


@pytest.mark.medium
def test_the_portable_watchdog_ends_a_worker_whose_parent_died():
    """Where prctl does not exist (macOS, Windows): a thread that polls the parent's pid."""
    middle = subprocess.Popen([sys.executable, "-c", _WATCHED], stdout=subprocess.PIPE, text=True)
    worker = int(middle.stdout.readline())
    assert alive(worker)
    middle.kill()
    middle.wait()
    deadline = time.monotonic() + 5
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(worker):
        os.kill(worker, signal.SIGKILL)
        raise AssertionError("the watchdog did not end the orphaned worker")


@pytest.mark.medium
def test_die_with_parent_ends_at_once_when_the_parent_is_already_gone():
    """The parent may die between the fork and the request for the signal: the worker then ends by itself."""
    script = (
        "import os; from vit_ct.data.manifests.check_workers import die_with_parent;"
        " die_with_parent(os.getppid() + 10**6)"
    )
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == 1
