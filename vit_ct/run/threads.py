"""Threads and OpenMP waiting, chosen by what shares the cores. A run alone keeps OpenMP's default waiting (its
threads spin briefly between parallel regions: on cores of its own the fastest), with one thread per usable CPU.
The ranks of a DDP job on one machine split the CPUs, and the ones it starts wait passively. DataLoader workers and
the simulator's worker processes run one thread each (torch's default for DataLoader workers; the simulator sets it),
so no OpenMP team of theirs spins. A value the user sets (``OMP_NUM_THREADS``, ``OMP_WAIT_POLICY``) always wins.

Why not passive waiting everywhere: a demo fit alone on 2 cores is slower with it (benchmarks/wait_policy.py, its
record and docs/benchmarks.md).
"""

from __future__ import annotations

import os

import torch

from vit_ct.run.hardware import usable_cpus

THREADS, WAIT_POLICY = "OMP_NUM_THREADS", "OMP_WAIT_POLICY"
# What the user set before vit-ct was imported (a DDP rank started by vit-ct sees its parent's choice here).
USER_SET = {name: os.environ.get(name) for name in (THREADS, WAIT_POLICY)}


def threads_per_process(processes: int = 1) -> int:
    """Usable CPUs shared out between ``processes`` processes of one job on this machine, at least 1 each."""
    return max(1, usable_cpus() // max(1, processes))


def use_threads(processes: int = 1) -> int:
    """Sets torch's intra-op threads to this process's share of the usable CPUs (all of them for a run alone), unless
    the user chose them (``OMP_NUM_THREADS``); returns the threads in use."""
    if not USER_SET[THREADS]:
        torch.set_num_threads(threads_per_process(processes))
    return torch.get_num_threads()


def share_cores_with_children(processes: int) -> None:
    """Before a job starts its other ``processes - 1`` processes (DDP ranks), put into the environment they inherit
    their share of the CPUs and passive waiting (OpenMP reads both when torch loads), unless the user set them."""
    for name, value in ((THREADS, str(threads_per_process(processes))), (WAIT_POLICY, "PASSIVE")):
        if not USER_SET[name]:
            os.environ[name] = value
