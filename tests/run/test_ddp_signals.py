"""A signal to any process of a DDP fit (the leader, another rank, or the whole process group) stops the whole job:
one line, exit status 143 (130 for Ctrl-C), no rank left waiting, last.ckpt intact.

Lightning's own SIGTERM handler ran a broadcast wherever the signal found rank 0; during validation, with rank 1
already waiting in the next all-gather, the two waited in different collectives for ever (the map metrics' sync,
2 times in 6). The end-to-end test stops a real 2-process CPU fit inside validation, with one rank held back by a
probe so that the other is waiting in a collective when the signal lands.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from npy_manifest import manifest_args, write_npy_manifest

from vit_ct.run.checkpoint import read_checkpoint
from vit_ct.run.signal_connector import end_started_ranks

TESTS = Path(__file__).resolve().parents[1]
VIT_CT = str(Path(sys.executable).with_name("vit-ct"))
BOUND_S = 60  # from the signal to the command's exit, on a busy 2-core machine (measured: 3-15 s)
LEFT = "the checkpoints written so far are kept (resume with --ckpt_path RUN/checkpoints/last.ckpt)"


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return "zombie" in status.read().lower()  # ended, not yet reaped by its new parent
    except FileNotFoundError:
        return True


# (who gets the signal, which rank the probe holds back, the signal, seconds after both ranks reached the probe)
CASES = [
    pytest.param("leader", 0, signal.SIGTERM, 0.2, id="leader-1 (the leader in Python, rank 1 in a collective)"),
    pytest.param("leader", 0, signal.SIGTERM, 1.0, id="leader-2"),
    pytest.param("leader", 0, signal.SIGTERM, 2.0, id="leader-3"),
    pytest.param("leader", 1, signal.SIGTERM, 0.5, id="leader-4 (the leader in a collective, rank 1 busy 5 s)"),
    pytest.param("leader", 1, signal.SIGTERM, 1.5, id="leader-5"),
    pytest.param("rank 1", 0, signal.SIGTERM, 0.5, id="rank 1 (rank 1 in a collective, the leader in Python)"),
    pytest.param("rank 1", 1, signal.SIGTERM, 0.5, id="rank 1 (the leader in a collective, rank 1 busy 5 s)"),
    pytest.param("group", 0, signal.SIGTERM, 0.5, id="the process group"),
    pytest.param("group", 1, signal.SIGINT, 0.5, id="the process group, Ctrl-C"),
]


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize(("target", "held", "signum", "delay"), CASES)
def test_a_signal_to_any_ddp_process_during_validation_stops_every_rank(tmp_path, target, held, signum, delay):
    manifest = write_npy_manifest(tmp_path / "data", train=4, val=4)
    root, probe = tmp_path / "run", tmp_path / "probe"
    probe.mkdir()
    # The leader held in Python is interrupted where it sleeps; a held rank 1 carries on (the leader ends it), so it
    # is held only as long as a slow step.
    seconds = 300 if held == 0 else 5
    args = [
        "fit", *manifest_args(manifest), "--trainer.logger", "false", "--trainer.max_epochs", "3",
        "--trainer.default_root_dir", str(root),
        "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp",
        "--trainer.callbacks+=probes.PauseInValidation", "--trainer.callbacks.folder", str(probe),
        "--trainer.callbacks.rank", str(held), "--trainer.callbacks.seconds", str(seconds),
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    process = subprocess.Popen(
        [VIT_CT, *args], cwd=tmp_path, env=env, start_new_session=True, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a Ctrl-C reaches it, as in a terminal
    )  # fmt: skip
    pids = {}
    try:
        deadline = time.monotonic() + 300
        while len(pids) < 2:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the fit ended before the probe was reached:\n{process.communicate()[0][-5000:]}")
            pids = {r: int((probe / f"rank{r}").read_text()) for r in (0, 1) if (probe / f"rank{r}").is_file()}
            time.sleep(0.1)
        time.sleep(delay)  # the rank not held back is now waiting in the validation's next collective
        sent = time.monotonic()
        if target == "group":
            os.killpg(process.pid, signum)
        else:
            os.kill(pids[0 if target == "leader" else 1], signum)
        try:
            output = process.communicate(timeout=BOUND_S + (0 if held == 0 else seconds))[0]
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {time.monotonic() - sent:.0f} s after the signal (ranks: {pids})")
        while not all(_gone(pid) for pid in pids.values()) and time.monotonic() - sent < BOUND_S:
            time.sleep(0.1)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        for pid in pids.values():
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    assert [pid for pid in pids.values() if not _gone(pid)] == [], "a rank was left running"
    assert process.returncode == 128 + signum, output[-5000:]
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    lines = [line for line in output.splitlines() if line.startswith("vit-ct:")]
    assert lines == [f"vit-ct: interrupted ({name}): {LEFT}"], output[-5000:]  # the leader's line, once
    assert "Traceback" not in output, output[-5000:]
    checkpoints = root / "checkpoints"
    assert read_checkpoint(checkpoints / "last.ckpt")["epoch"] == 0  # whole, as the first epoch left it
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".")]  # no temporary file


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


@pytest.mark.parametrize("end", ["vit-ct's end_started_ranks", "Lightning's launcher.kill (the reference)"])
def test_ending_the_ranks_keeps_lightnings_process_observer_from_killing_the_leader(end):
    """Lightning's child-process observer SIGKILLs the leader when a rank it watches exits with an error: ending the
    ranks after a signal must not cut the leader's own shutdown (its W&B run, its one line) short."""
    leader = _sleeper()  # stands in for the leader: the observer signals this pid, not the test's
    launcher = _SubprocessScriptLauncher(LightningEnvironment(), num_processes=3, num_nodes=1)
    ranks = [_sleeper(), _sleeper()]
    launcher.procs = list(ranks)  # the observer watches this very list, as Lightning's launcher sets it up
    observer = _ChildProcessObserver(main_pid=leader.pid, child_processes=launcher.procs, sleep_period=0.05)
    observer.start()
    try:
        if end.startswith("vit-ct"):
            end_started_ranks(launcher)
        else:
            launcher.kill(signal.SIGKILL)
        assert [rank.wait(timeout=10) for rank in ranks] == [-signal.SIGKILL] * 2
        observer.join(timeout=5)  # the observer stops once it has seen every rank
        assert not observer.is_alive()
        if end.startswith("vit-ct"):
            assert leader.poll() is None
        else:
            assert leader.wait(timeout=5) == -signal.SIGKILL  # what the test would see without vit-ct's way
    finally:
        for process in (leader, *ranks):
            process.kill()
            process.wait()
