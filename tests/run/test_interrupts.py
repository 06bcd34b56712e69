"""SIGTERM (a scheduler's, `timeout`'s or `kill`'s) and Ctrl-C stop fit, test and predict: a one-line message, exit
status 143 (130 for Ctrl-C), and the outputs as they were (a predict's OUT untouched, a fit's last.ckpt kept for
resuming). DDP: tests/run/test_ddp_signals.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
from npy_manifest import manifest_args, write_npy_manifest
from signalled import PAUSE, VIT_CT, signal_when_ready, start_vit_ct

from vit_ct.files import signals_held
from vit_ct.run import interrupts
from vit_ct.run.checkpoint import read_checkpoint
from vit_ct.run.interrupts import LEADER_PID, Interrupted, received_signal, stop_on_signals

TESTS = Path(__file__).resolve().parents[1]
NO_LOGGER = ["--trainer.logger", "false"]


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


def _completed(*args: str, cwd: Path) -> None:
    """Runs `vit-ct ARGS` to its end, which must succeed."""
    run = subprocess.run([VIT_CT, *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.fixture
def data(tmp_path):
    manifest = write_npy_manifest(tmp_path / "data", train=4, val=3, test=4)
    return manifest


def _interrupted_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("vit-ct:")]
    assert lines, output[-3000:]
    return lines[-1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("group", "signum"),
    [(False, signal.SIGTERM), (True, signal.SIGTERM), (True, signal.SIGINT)],
    ids=["kill PID", "kill the process group, DataLoader workers too", "Ctrl-C (SIGINT to the process group)"],
)
def test_a_signal_stops_predict_and_leaves_the_output_folder_as_it_was(data, tmp_path, group, signum):
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
    process = start_vit_ct([*common, "--ckpt_path", ckpt, "--overwrite", "true", "--data.init_args.batch_size", "1",
                            *workers, *PAUSE], tmp_path, ready=ready)  # fmt: skip
    status, output = signal_when_ready(process, ready, group=group, signum=signum)
    assert status == 128 + signum, output[-3000:]
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert _interrupted_line(output) == f"vit-ct: interrupted ({name}): --output_dir is as it was before this run"
    assert "Traceback" not in output and "DataLoader worker" not in output
    assert _files(out) == before  # OUT untouched, and no partial folder left beside it
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert len(pd.read_csv(out / "predictions.csv")) == 3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("group", "signum"),
    [(False, signal.SIGTERM), (True, signal.SIGINT)],
    ids=["kill PID", "Ctrl-C (SIGINT to the process group)"],
)
def test_a_signal_stops_fit_and_keeps_its_last_checkpoint(data, tmp_path, group, signum):
    ready = tmp_path / "ready"
    root = tmp_path / "run"
    process = start_vit_ct(["fit", *manifest_args(data), *NO_LOGGER, "--trainer.max_epochs", "3",
                    "--trainer.default_root_dir", str(root), *PAUSE], tmp_path, ready=ready)  # fmt: skip
    status, output = signal_when_ready(process, ready, group=group, signum=signum)
    assert status == 128 + signum, output[-3000:]  # 130 for Ctrl-C: Lightning alone exits 1
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert _interrupted_line(output).startswith(f"vit-ct: interrupted ({name}): the checkpoints written so far")
    assert "Traceback" not in output and "Detected KeyboardInterrupt" not in output  # vit-ct's line, not Lightning's
    last = read_checkpoint(root / "checkpoints" / "last.ckpt")  # whole, and at the end of the first epoch
    assert last["epoch"] == 0 and last["global_step"] == 2


@pytest.mark.slow
def test_sigterm_stops_test(data, tmp_path):
    ready = tmp_path / "ready"
    _completed("fit", *manifest_args(data), *NO_LOGGER, "--trainer.max_epochs", "1", "--trainer.default_root_dir",
               str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    process = start_vit_ct(["test", *manifest_args(data, batch_size=1), *NO_LOGGER, "--ckpt_path",
                    str(tmp_path / "run" / "checkpoints" / "last.ckpt"), *PAUSE], tmp_path, ready=ready)  # fmt: skip
    status, output = signal_when_ready(process, ready)
    assert status == 128 + signal.SIGTERM, output[-3000:]
    assert _interrupted_line(output) == "vit-ct: interrupted (SIGTERM): nothing half-written is left"


@pytest.fixture
def own_handlers(monkeypatch):
    """vit-ct's handlers installed in this process for one test, and pytest's put back after it."""
    monkeypatch.setattr(interrupts, "_state", {**interrupts._state, "received": None, "leader": None})
    monkeypatch.setenv(LEADER_PID, "")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    # as in a terminal: a background job of a script (pytest started with `&`) starts with SIGINT ignored, which
    # vit-ct keeps ignored (test_a_sigint_ignored_at_start_up_stays_ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stop_on_signals()
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def _deliver(signum: signal.Signals) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.2)  # the handler runs at the next bytecode; an exception it raises surfaces here


def test_a_second_signal_soon_after_the_first_does_not_cut_the_shutdown_short(own_handlers):
    with pytest.raises(Interrupted):
        _deliver(signal.SIGTERM)
    assert received_signal() == signal.SIGTERM
    _deliver(signal.SIGTERM)  # another rank's copy, or the scheduler's second: the shutdown goes on
    _deliver(signal.SIGINT)
    assert received_signal() == signal.SIGTERM
    interrupts._state["at"] -= interrupts.REPEAT_WINDOW_S  # later on, a signal interrupts again (a stuck shutdown)
    with pytest.raises(Interrupted):
        _deliver(signal.SIGINT)
    assert received_signal() == signal.SIGINT


def test_ctrl_c_is_deferred_like_sigterm_in_a_protected_block(own_handlers):
    with pytest.raises(Interrupted), signals_held():
        _deliver(signal.SIGINT)
        done = True  # the block runs to its end
    assert done and received_signal() == signal.SIGINT


# A DDP rank's main thread blocked in C, as in a collective: a second lock of a glibc mutex by its holder waits for
# ever, with the GIL released and through signals, so no Python handler can run. A forked child stands for a
# DataLoader worker.
RANK = textwrap.dedent("""
    import ctypes, os, time
    from vit_ct.run.interrupts import stop_on_signals
    stop_on_signals()
    if os.fork() == 0:
        print(os.getpid(), flush=True)  # the worker, running: its fork hooks are done
        time.sleep(60)
        os._exit(0)
    libc, mutex = ctypes.CDLL(None), ctypes.create_string_buffer(64)  # zeros: PTHREAD_MUTEX_INITIALIZER
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)
""")


@pytest.mark.medium
@pytest.mark.parametrize("local_rank", ["1", "0"], ids=["a rank the leader started", "a vit-ct started by a leader"])
def test_a_rank_started_by_a_vit_ct_leader_passes_its_signals_to_the_leader_at_once(local_rank):
    """This test process plays the leader: the rank's SIGTERM and SIGINT must reach it while the rank's main thread
    is blocked; a signal to the rank's forked worker must not; and the rank carries on until the leader ends it."""
    received = []
    saved = {s: signal.signal(s, lambda n, frame: received.append(n)) for s in (signal.SIGTERM, signal.SIGINT)}
    env = {**os.environ, LEADER_PID: str(os.getpid()), "LOCAL_RANK": local_rank}
    rank = subprocess.Popen([sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE, text=True)
    worker = int(rank.stdout.readline())
    try:
        os.kill(worker, signal.SIGTERM)
        time.sleep(1)
        os.kill(rank.pid, signal.SIGTERM)
        os.kill(rank.pid, signal.SIGINT)
        deadline = time.monotonic() + (10 if local_rank == "1" else 2)
        while len(received) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(received) == ([signal.SIGINT, signal.SIGTERM] if local_rank == "1" else [])
        assert rank.poll() is None  # carries on; here only the leader ends a rank
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        for pid in (worker, rank.pid):
            os.kill(pid, signal.SIGKILL)
        rank.wait()


def test_a_sigint_ignored_at_start_up_stays_ignored(own_handlers):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell starts a background job
    stop_on_signals()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
