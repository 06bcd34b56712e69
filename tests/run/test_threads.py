"""Threads and OpenMP waiting by what shares the cores: a run alone keeps OpenMP's default and every usable CPU, the
ranks of a CPU DDP job split the CPUs and the ranks it starts wait passively, DataLoader workers run one thread,
and the user's OMP_NUM_THREADS / OMP_WAIT_POLICY win."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from npy_manifest import manifest_args, write_npy_manifest
from torch.utils.data import Dataset

from vit_ct import CTSliceDataModule
from vit_ct.run import threads
from vit_ct.run.hardware import usable_cpus

TESTS = Path(__file__).resolve().parents[1]
OPENMP = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")


def _environment(**chosen: str) -> dict[str, str]:
    """This environment without the OpenMP variables (as a user who set none), plus ``chosen``."""
    env = {k: v for k, v in os.environ.items() if k not in OPENMP}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", **chosen)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    return env


def _recorded_fit(tmp_path: Path, *extra: str, **chosen: str) -> list[dict]:
    manifest = write_npy_manifest(tmp_path / "data", train=4, val=2)
    probe = ["--trainer.callbacks+=probes.RecordThreads", "--trainer.callbacks.folder", str(tmp_path / "rec")]
    command = [str(Path(sys.executable).with_name("vit-ct")), "fit", *manifest_args(manifest), "--trainer.logger",
               "false", "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "0", *probe, *extra]  # fmt: skip
    run = subprocess.run(command, cwd=tmp_path, env=_environment(**chosen), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted((tmp_path / "rec").glob("rank*.json"))]


def test_importing_vit_ct_leaves_openmp_waiting_alone():
    code = "import os, vit_ct; print(os.environ.get('OMP_WAIT_POLICY'))"
    result = subprocess.run([sys.executable, "-c", code], env=_environment(), capture_output=True, text=True)
    assert result.stdout.strip() == "None", result.stderr


def test_the_cpus_are_shared_out_between_the_processes_of_a_job(monkeypatch):
    monkeypatch.setattr(threads, "usable_cpus", lambda: 8)
    assert [threads.threads_per_process(n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]


@pytest.mark.slow
def test_a_fit_alone_uses_every_usable_cpu_and_openmps_default_waiting(tmp_path):
    assert _recorded_fit(tmp_path) == [{"threads": usable_cpus(), "wait_policy": None}]


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_ranks_split_the_cpus_and_the_rank_it_starts_waits_passively(tmp_path):
    ddp = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    share = max(1, usable_cpus() // 2)
    # rank 0 is the command itself: OpenMP was loaded (with its default waiting) before the job knew it had 2 ranks
    assert _recorded_fit(tmp_path, *ddp) == [{"threads": share, "wait_policy": None},
                                             {"threads": share, "wait_policy": "PASSIVE"}]  # fmt: skip


@pytest.mark.slow
@pytest.mark.ddp
def test_the_users_openmp_values_win(tmp_path):
    ddp = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    recorded = _recorded_fit(tmp_path, *ddp, OMP_NUM_THREADS="2", OMP_WAIT_POLICY="ACTIVE")
    assert recorded == [{"threads": 2, "wait_policy": "ACTIVE"}] * 2


class _Threads(Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        return torch.get_num_threads()


def test_dataloader_workers_of_the_data_module_run_one_thread(tmp_path):
    data = CTSliceDataModule(str(tmp_path / "m.csv"), num_workers=1)
    assert torch.get_num_threads() >= 1
    assert [int(t) for batch in data._loader(_Threads()) for t in batch] == [1, 1]


def test_use_threads_takes_the_share_unless_the_user_chose(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
        monkeypatch.setitem(threads.USER_SET, "OMP_NUM_THREADS", None)
        assert threads.use_threads() == 2 and threads.use_threads(2) == 1
        monkeypatch.setitem(threads.USER_SET, "OMP_NUM_THREADS", "2")  # the user's value: left to torch
        torch.set_num_threads(2)
        assert threads.use_threads(2) == 2
    finally:
        torch.set_num_threads(before)
