"""glibc's allocator set for training loops: the blocks a step frees are kept for the next step.

With glibc's defaults a training step hands much of the memory it frees back to the kernel (large blocks are
``mmap``-ed and unmapped on free; the top of the heap is trimmed), and the next step takes it back page by page, as
fresh zeroed pages: ``benchmarks/training_pace.py`` counts the page faults of the demo's fit per step. Keeping freed
blocks in the heap (a fixed, higher ``mmap`` threshold and no trimming below 2 GiB of free top) removes those
faults; the peak memory a step needs is unchanged, and the process keeps what it has used until it exits. Only on
Linux with glibc, and never over the user's own ``MALLOC_*`` or ``GLIBC_TUNABLES`` settings (or another allocator
they preload).
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 256 * 2**20  # blocks below this come from the heap (glibc's own default grows up to 32 MiB)
MMAP_THRESHOLD_FALLBACK = 32 * 2**20  # the largest every glibc accepts
TRIM_THRESHOLD = 2**31 - 1  # free memory at the top of the heap kept up to 2 GiB


def keep_freed_memory() -> bool:
    """Set glibc's thresholds for this process (see the module); returns whether they were set: False off glibc,
    where the user set the allocator's variables, or when another allocator is preloaded."""
    if not sys.platform.startswith("linux") or _user_chose_allocator():
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl and others have no such symbol)
    except (OSError, AttributeError):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mapped = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) or mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_FALLBACK)
    return bool(mapped and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def _user_chose_allocator() -> bool:
    preloaded = os.environ.get("LD_PRELOAD", "")
    return (
        any(name.startswith("MALLOC_") for name in os.environ)
        or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")
        or any(name in preloaded for name in ("jemalloc", "tcmalloc", "mimalloc"))
    )
