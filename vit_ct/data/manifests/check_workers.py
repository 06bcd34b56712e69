"""The manifest check's worker processes: one per CPU, one thread each, bound to the process that started them, so
that a check killed outright (``kill -9``, the OOM killer) leaves no worker behind, re-parented and blocked on its
pipe while holding a copy of the parent's memory.
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor

import torch

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_SECONDS = 0.5  # how often the portable watchdog looks for its parent

_WORKER: dict = {}  # what a worker process was started with: the job function and its shared arguments


def available_cpus() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def die_with_parent(parent: int) -> None:
    """End this process as soon as process ``parent`` ends: on Linux the kernel's parent-death signal (SIGKILL,
    `prctl(PR_SET_PDEATHSIG)`), elsewhere a daemon thread that looks for the parent every half second.

    The kernel sends the signal when the *thread* that forked this process exits: the check's pool is made and used
    by one thread for its whole life, so that thread ends only with the check.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                if os.getppid() != parent:  # the parent died before the signal was asked for
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass  # no prctl to call: the watchdog below
    threading.Thread(target=_watch_parent, args=(parent,), name="vit-ct parent watchdog", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_POLL_SECONDS)
    os._exit(1)  # nothing to flush: a worker's unfinished slots are not committed, the next check redoes them


def _start_worker(parent: int, read_job: Callable, shared: tuple) -> None:
    die_with_parent(parent)
    torch.set_num_threads(1)  # processes, not threads, share the cores (as DataLoader workers do)
    _WORKER.update(read_job=read_job, shared=shared)


def _read_jobs(jobs: list) -> list:
    return [_WORKER["read_job"](job, *_WORKER["shared"]) for job in jobs]


def run_jobs(jobs: Sequence, read_job: Callable, shared: tuple, workers: int) -> Iterator[tuple]:
    """Yields (job, ``read_job(job, *shared)``) as the jobs finish: in this process for a few jobs, else in
    ``workers`` processes that die with this one."""
    if workers <= 1 or len(jobs) < 2 * workers:
        for job in jobs:
            yield job, read_job(job, *shared)
        return
    chunk = max(1, min(64, math.ceil(len(jobs) / (8 * workers))))  # fewer messages, but a bar that moves
    chunks = [jobs[i : i + chunk] for i in range(0, len(jobs), chunk)]
    # fork: no re-import of torch per worker (spawn where fork does not exist)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context(method),
        initializer=_start_worker,
        initargs=(os.getpid(), read_job, shared),
    ) as pool:
        for part, results in zip(chunks, pool.map(_read_jobs, chunks), strict=True):
            yield from zip(part, results, strict=True)
