"""The training-pace benchmark's accounting (benchmarks/training_pace.py): a hand-made step log of known durations
comes back cause by cause, and the causes add up to the wall time."""

from __future__ import annotations

import pytest


def _log() -> list[dict]:
    """Two epochs of three steps. Every step: read 0.010 s, augment 0.020 s, then 0.500 s in the step: losses 0.150
    (training_step 0.160: 0.010 of logging), backward 0.300, optimizer 0.020, Lightning 0.020. Epoch 1 opens after
    an epoch end of 0.100 s beyond its first batch's reading and augmentation."""
    steps, clock, faults = [], 0.0, 0
    for epoch in range(2):
        for i in range(3):
            clock += 0.010 + 0.020 + (0.100 if epoch == 1 and i == 0 else 0.0)
            start, clock = clock, clock + 0.500
            faults += 1000
            steps.append({"epoch": epoch, "start": start, "end": clock, "augment": 0.020, "losses": 0.150,
                          "training_step": 0.160, "backward": 0.300, "optimizer": 0.020, "faults": faults})  # fmt: skip
    steps[-1]["peak_rss_mib"] = 900.0
    return steps


def test_fit_causes_returns_each_known_duration_and_they_add_up():
    from benchmarks import training_pace as pace

    ms = pace.fit_causes(_log(), batch_size=32)
    expected = {"forward": 150, "backward": 300, "optimizer": 20, "read": 10, "augment": 20, "logging": 10, "loop": 20,
                "epoch_end": 100 / 3}  # fmt: skip
    for key, value in expected.items():
        assert ms[key] == pytest.approx(value, abs=1e-6), key
    assert ms["total"] == pytest.approx(sum(ms[key] for key, _ in pace.CAUSES), abs=1e-6)
    assert ms["total"] == pytest.approx(530 + 100 / 3, abs=1e-6)
    assert ms["images_per_s"] == pytest.approx(32 / (ms["total"] / 1000))
    assert ms["page_faults"] == 1000 and ms["peak_rss_mib"] == 900.0


@pytest.mark.medium
def test_a_launched_process_reads_its_own_peak_memory_not_its_parents():
    """The table's peak memory is each run's own: a child of a process holding 3 GiB reads what it used itself (about
    0.9 GiB: torch, Lightning and vit-ct imported), where ``ru_maxrss`` starts from the parent's high-water mark (every
    row of a record read the benchmark's 2.3 GiB)."""
    import subprocess
    import sys

    import numpy as np

    held = np.ones(3 * 1024**3 // 8)  # 3 GiB resident in this process
    code = ("import resource; from benchmarks.training_pace import peak_resident_kib;"
            " print(peak_resident_kib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")  # fmt: skip
    own, inherited = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                             check=True).stdout.split())  # fmt: skip
    assert held.sum() == 3 * 1024**3 // 8
    assert inherited > 3 * 1024**2  # KiB: the kernel's ru_maxrss carries the parent's 3 GiB
    assert own < 2 * 1024**2, own  # its own imports only
