"""A checkpoint that does not fit on its disk: a named error (the checkpoint, the free space, what was kept) where torch
raised "[enforce fail at inline_container.cc:672] . unexpected pos", and the previous checkpoint intact.

The disk is really full: a 2-8 MB tmpfs mounted for the test (root with CAP_SYS_ADMIN; skipped, saying so, elsewhere),
or, on any Linux, the temporary file's name pointing at /dev/full, whose every write fails with ENOSPC from the kernel.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from npy_manifest import manifest_args, write_npy_manifest

from vit_ct.run.checkpoint import AtomicCheckpointIO, CheckpointDiskFullError, read_checkpoint

TESTS = Path(__file__).resolve().parents[1]
VIT_CT = str(Path(sys.executable).with_name("vit-ct"))


def _checkpoint(n_values: int, fill: float) -> dict:
    return {"state_dict": {"w": torch.full((n_values,), fill)}, "epoch": int(fill)}


def _mount_tmpfs(folder: Path, size: str) -> None:
    folder.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mount.returncode:
        pytest.skip(f"mounting a {size} tmpfs needs root with CAP_SYS_ADMIN: {mount.stderr.decode().strip()}")


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB disk of its own (a tmpfs), unmounted after the test."""
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "2m")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _assert_full_disk_error(error: CheckpointDiskFullError, path: Path, *, kept: bool) -> None:
    message = str(error)
    assert error.errno == errno.ENOSPC
    assert message.startswith(f"checkpoint {path} was not written: No space left on device (")
    assert f"MB free in {path.parent}; the checkpoint needs about 4.0 MB)" in message
    other = "and the folder's other checkpoints are untouched (checkpoints are written whole or not at all)"
    if kept:
        assert f"the previous last.ckpt is intact, {other}" in message
        assert message.endswith(f"and resume with --ckpt_path {path}")
    else:
        assert f"nothing was written at {path}, {other}" in message
    assert not [p.name for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_a_checkpoint_on_a_full_disk_is_a_named_error_and_the_previous_one_is_intact(small_disk):
    io = AtomicCheckpointIO()
    path = small_disk / "checkpoints" / "last.ckpt"
    io.save_checkpoint(_checkpoint(1000, 1.0), path)  # 4 kB: fits
    with pytest.raises(CheckpointDiskFullError) as caught:
        io.save_checkpoint(_checkpoint(1_000_000, 2.0), path)  # 4 MB on a 2 MB disk
    _assert_full_disk_error(caught.value, path, kept=True)
    free = float(re.search(r"\(([0-9.]+) MB free", str(caught.value)).group(1))
    assert 1.9 <= free <= 2.1  # the 2 MiB disk (2.1 MB) less the old 4 kB file
    old = read_checkpoint(path)
    assert old["epoch"] == 1 and torch.equal(old["state_dict"]["w"], torch.ones(1000))


def test_a_first_checkpoint_on_a_full_disk_says_nothing_was_written(small_disk):
    path = small_disk / "last.ckpt"
    with pytest.raises(CheckpointDiskFullError) as caught:
        AtomicCheckpointIO().save_checkpoint(_checkpoint(1_000_000, 2.0), path)
    _assert_full_disk_error(caught.value, path, kept=False)
    assert not path.exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_enospc_from_the_kernel_on_any_disk(tmp_path):
    """Where no tmpfs can be mounted: the temporary file the save writes is a link to /dev/full."""
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint(_checkpoint(1000, 1.0), path)
    (tmp_path / f".last.ckpt.{os.getpid()}.tmp").symlink_to("/dev/full")  # atomic_write's temporary name
    with pytest.raises(CheckpointDiskFullError) as caught:
        io.save_checkpoint(_checkpoint(1_000_000, 2.0), path)
    _assert_full_disk_error(caught.value, path, kept=True)
    assert read_checkpoint(path)["epoch"] == 1


@pytest.mark.slow
def test_fit_on_a_disk_that_fills_up_stops_with_the_named_error_and_keeps_last_ckpt(tmp_path):
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "8m")  # the first epoch's checkpoints fit
    try:
        manifest = write_npy_manifest(tmp_path / "data", train=4, val=2)
        fill = ["--trainer.callbacks+=probes.FillDisk", "--trainer.callbacks.folder", str(disk)]
        args = ["fit", *manifest_args(manifest), "--trainer.logger", "false", "--trainer.max_epochs", "2",
                "--trainer.default_root_dir", str(disk / "run"), *fill]  # fmt: skip
        env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
        run = subprocess.run([VIT_CT, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
        error = [line for line in run.stderr.splitlines() if line.startswith("vit-ct: error:")]
        assert len(error) == 1 and "inline_container" not in run.stderr, run.stderr[-3000:]
        checkpoints = disk / "run" / "checkpoints"
        assert error[0].startswith(f"vit-ct: error: CheckpointDiskFullError: checkpoint {checkpoints}/")
        assert "No space left on device (0.0 MB free in" in error[0]
        assert error[0].endswith(f"and resume with --ckpt_path {checkpoints / 'last.ckpt'}")
        last = read_checkpoint(checkpoints / "last.ckpt")  # whole, as the first epoch left it
        assert last["epoch"] == 0
        assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".")]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
