"""``vit-ct`` as a process stopped by a signal mid-way: started in its own process group with the probes of
``probes.py`` importable, signalled once a probe says the run is where the test wants it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
VIT_CT = str(Path(sys.executable).with_name("vit-ct"))
PAUSE = ["--trainer.callbacks+=probes.PauseAtBatch", "--trainer.callbacks.batch", "1"]


def start_vit_ct(args: list[str], cwd: Path, *, ready: Path) -> subprocess.Popen:
    """`vit-ct ARGS` in its own process group, with the probes importable."""
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "VIT_CT_PROBE_READY": str(ready)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    return subprocess.Popen(
        [VIT_CT, *args], cwd=cwd, env=env, start_new_session=True, preexec_fn=_default_sigint, **pipes
    )


def _default_sigint() -> None:
    """In the child: Ctrl-C reaches the command, as in a terminal, even where this test's runner ignores it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_when_ready(
    process: subprocess.Popen, ready: Path, *, group: bool = False, signum: signal.Signals = signal.SIGTERM
) -> tuple[int, str]:
    """Send ``signum`` once the probe says the run is mid-way (to the whole process group with ``group``, as a
    terminal sends Ctrl-C)."""
    deadline = time.monotonic() + 300
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            out, err = process.communicate()
            pytest.fail(f"the run ended before the probe was reached:\n{out[-2000:]}\n{err[-3000:]}")
        time.sleep(0.2)
    if group:
        os.killpg(process.pid, signum)
    else:
        process.send_signal(signum)
    out, err = process.communicate(timeout=120)
    return process.returncode, out + err
