"""glibc's allocator as vit-ct sets it: a block a step frees is kept for the next step instead of being handed back to
the kernel and faulted in again, page by page; and never over the user's own allocator settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vit_ct.run import allocator

# 48 MiB blocks, above glibc's largest automatic mmap threshold (32 MiB): by default each is mapped fresh and
# unmapped on free, so every pass faults its pages in again
PASSES = """
import json, resource, sys, torch
from vit_ct.run.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "vit-ct" else False
faults = []
for _ in range(24):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.empty(12 * 2**20).fill_(1.0)  # 48 MiB, every page touched
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults[1:]}))
"""


def _passes(setting: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PASSES, setting], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.medium
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    default, kept = _passes("default"), _passes("vit-ct")
    pages = 48 * 2**20 // os.sysconf("SC_PAGE_SIZE")
    assert kept["kept"] is True
    assert min(default["faults"]) > pages // 2  # the defaults map each block afresh, every time
    # vit-ct's settings: after a few blocks the heap holds freed ones that fit (aligned blocks of one size need a
    # few to settle: seven passes once, on a loaded machine, so 23 are watched), and from then on no pass faults
    assert max(kept["faults"][-4:]) < pages // 20, kept["faults"]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MALLOC_ARENA_MAX", "2"),
        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"),
        ("LD_PRELOAD", "libjemalloc.so.2"),
    ],
)
def test_the_users_allocator_settings_win(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert allocator.keep_freed_memory() is False
