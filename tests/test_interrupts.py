"""SIGTERM (a scheduler's, `timeout`'s or `kill`'s) stops fit, test and predict like Ctrl-C: a one-line message, exit
status 143, and the outputs as they were (a predict's OUT untouched, a fit's last.ckpt kept for resuming)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from npy_manifest import manifest_args, write_npy_manifest

from vit_ct.checkpoint import read_checkpoint

TESTS = Path(__file__).resolve().parent
NO_LOGGER = ["--trainer.logger", "false"]
PAUSE = ["--trainer.callbacks+=probes.PauseAtBatch", "--trainer.callbacks.batch", "1"]


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


VIT_CT = str(Path(sys.executable).with_name("vit-ct"))


def _completed(*args: str, cwd: Path) -> None:
    """Runs `vit-ct ARGS` to its end, which must succeed."""
    run = subprocess.run([VIT_CT, *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def _run(args: list[str], cwd: Path, *, ready: Path) -> subprocess.Popen:
    """`vit-ct ARGS` in its own process group, with the probes importable."""
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "VIT_CT_PROBE_READY": str(ready)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    return subprocess.Popen([VIT_CT, *args], cwd=cwd, env=env, start_new_session=True, **pipes)


def _terminate_when_ready(process: subprocess.Popen, ready: Path, *, group: bool = False) -> tuple[int, str]:
    """Send SIGTERM once the probe says the run is mid-way (to the whole process group with ``group``)."""
    deadline = time.monotonic() + 300
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            out, err = process.communicate()
            pytest.fail(f"the run ended before the probe was reached:\n{out[-2000:]}\n{err[-3000:]}")
        time.sleep(0.2)
    if group:
        os.killpg(process.pid, signal.SIGTERM)
    else:
        process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    return process.returncode, out + err


@pytest.fixture
def data(tmp_path):
    manifest = write_npy_manifest(tmp_path / "data", train=4, val=3, test=4)
    return manifest


def _interrupted_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("vit-ct:")]
    assert lines, output[-3000:]
    return lines[-1]


@pytest.mark.slow
@pytest.mark.parametrize("group", [False, True], ids=["kill PID", "kill the process group, DataLoader workers too"])
def test_sigterm_stops_predict_and_leaves_the_output_folder_as_it_was(data, tmp_path, group):
    out = tmp_path / "out"
    common = ["predict", *manifest_args(data), *NO_LOGGER, "--output_dir", str(out)]
    # a checkpoint, and a first predict whose outputs must survive the interrupted one
    _completed("fit", *manifest_args(data), *NO_LOGGER, "--trainer.max_epochs", "1", "--trainer.default_root_dir",
               str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    ckpt = str(tmp_path / "run" / "checkpoints" / "last.ckpt")
    _completed(*common, "--ckpt_path", ckpt, "--data.init_args.predict_split", "val", cwd=tmp_path)
    before = _files(out)
    workers = ["--data.init_args.num_workers", "1", "--data.init_args.cache", "false"] if group else []
    ready = tmp_path / "ready"
    process = _run([*common, "--ckpt_path", ckpt, "--overwrite", "true", "--data.init_args.batch_size", "1", *workers,
                    *PAUSE], tmp_path, ready=ready)  # fmt: skip
    status, output = _terminate_when_ready(process, ready, group=group)
    assert status == 128 + signal.SIGTERM, output[-3000:]
    assert _interrupted_line(output) == "vit-ct: interrupted (SIGTERM): --output_dir is as it was before this run"
    assert "Traceback" not in output and "DataLoader worker" not in output
    assert _files(out) == before  # OUT untouched, and no partial folder left beside it
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert len(pd.read_csv(out / "predictions.csv")) == 3


@pytest.mark.slow
def test_sigterm_stops_fit_and_keeps_its_last_checkpoint(data, tmp_path):
    ready = tmp_path / "ready"
    root = tmp_path / "run"
    process = _run(["fit", *manifest_args(data), *NO_LOGGER, "--trainer.max_epochs", "3",
                    "--trainer.default_root_dir", str(root), *PAUSE], tmp_path, ready=ready)  # fmt: skip
    status, output = _terminate_when_ready(process, ready)
    assert status == 128 + signal.SIGTERM, output[-3000:]
    assert _interrupted_line(output).startswith("vit-ct: interrupted (SIGTERM): the checkpoints written so far")
    assert "Traceback" not in output
    last = read_checkpoint(root / "checkpoints" / "last.ckpt")  # whole, and at the end of the first epoch
    assert last["epoch"] == 0 and last["global_step"] == 2


@pytest.mark.slow
def test_sigterm_stops_test(data, tmp_path):
    ready = tmp_path / "ready"
    _completed("fit", *manifest_args(data), *NO_LOGGER, "--trainer.max_epochs", "1", "--trainer.default_root_dir",
               str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    process = _run(["test", *manifest_args(data, batch_size=1), *NO_LOGGER, "--ckpt_path",
                    str(tmp_path / "run" / "checkpoints" / "last.ckpt"), *PAUSE], tmp_path, ready=ready)  # fmt: skip
    status, output = _terminate_when_ready(process, ready)
    assert status == 128 + signal.SIGTERM, output[-3000:]
    assert _interrupted_line(output) == "vit-ct: interrupted (SIGTERM): nothing half-written is left"
