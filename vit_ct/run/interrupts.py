"""SIGTERM (what ``kill``, ``timeout`` and schedulers send) and SIGINT (Ctrl-C) stop a ``vit-ct`` command the same
way: the running trainer shuts down through its exception hooks (a predict's partial outputs removed, a fit's
checkpoints kept), and the command exits with one line and status 128 + the signal (143, 130).

Under DDP the leader (the process the user started; Lightning's launcher starts the other ranks from it) stops the
job. A signal that reaches another rank is passed on to the leader at once, even while that rank waits in a
collective, and the rank carries on in step with the others until the leader ends it. No rank runs a collective
because of a signal, so every rank is either stopping or still in step, and none is left waiting on another. The
leader acts when its main thread next runs Python: at once, or, while it waits in a collective, as soon as the other
ranks reach that collective (within a step).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time

EXIT_STATUS = {signal.SIGTERM: 128 + signal.SIGTERM, signal.SIGINT: 128 + signal.SIGINT}  # the shell's convention
LEADER_PID = "VIT_CT_LEADER_PID"  # environment: the pid of the vit-ct command that started this process
REPEAT_WINDOW_S = 10.0  # a signal this soon after the first (another rank's copy, a key pressed twice) is ignored

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread when the process receives SIGTERM or SIGINT. A ``KeyboardInterrupt``, so that it
    passes every ``except Exception`` (a file check must not record it as a bad file) and Lightning shuts the trainer
    down as for Ctrl-C."""


_state = {"main_pid": None, "leader": None, "received": None, "at": 0.0}


def _on_signal(signum: int, frame) -> None:
    if os.getpid() != _state["main_pid"]:
        # A forked DataLoader worker: its parent decides (workers end when their loader shuts down or their parent
        # dies); raising here would surface in the parent as a crashed worker instead of an interrupted command.
        return
    if is_led_rank():
        return  # the watcher thread passed it on to the leader, which ends this rank
    now = time.monotonic()
    if _state["received"] is not None and now - _state["at"] < REPEAT_WINDOW_S:
        return  # the shutdown the first one started is running: let it finish
    _state["received"], _state["at"] = signal.Signals(signum), now
    raise Interrupted(f"received {signal.Signals(signum).name}")


def is_led_rank() -> bool:
    """Whether this process is a DDP rank that a vit-ct leader started (Lightning's launcher) and that leader is
    still running: its SIGTERM and SIGINT go to the leader, which stops the job and ends this rank."""
    return _state["leader"] is not None and os.getppid() == _state["leader"]


def _pass_signals_to_leader(wakeup_fd: int) -> None:
    """Sends the leader every SIGTERM and SIGINT this process receives, as it arrives: Python runs signal handlers
    only between bytecodes of the main thread, which may be waiting in a collective for the leader itself."""
    while True:
        select.select([wakeup_fd], [], [])
        with contextlib.suppress(BlockingIOError):
            for signum in os.read(wakeup_fd, 512):  # one byte per signal, written by Python's C-level handler
                if signum in _SIGNALS and is_led_rank():
                    os.kill(_state["leader"], signum)


def _forget_wakeup_fd() -> None:
    with contextlib.suppress(ValueError):  # raised where the fork was made outside the main thread
        signal.set_wakeup_fd(-1)  # a forked DataLoader worker's signals are its own, not its rank's


def stop_on_signals() -> None:
    """Makes SIGTERM and SIGINT raise :class:`Interrupted` in this (the main) process; its forked workers ignore them,
    and a DDP rank started by a vit-ct leader passes them on to the leader. Call it from the main thread.

    SIGINT stays ignored where it was ignored at start-up (a background job of a shell script), as Python's own
    handler does.
    """
    _state["main_pid"] = os.getpid()
    leader = os.environ.get(LEADER_PID, "")
    led = leader.isdigit() and int(leader) == os.getppid() and os.environ.get("LOCAL_RANK", "0") != "0"
    _state["leader"] = int(leader) if led else None
    os.environ[LEADER_PID] = str(os.getpid())  # inherited by the ranks Lightning's launcher starts
    signal.signal(signal.SIGTERM, _on_signal)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _on_signal)
    if led:
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        os.register_at_fork(after_in_child=_forget_wakeup_fd)
        threading.Thread(target=_pass_signals_to_leader, args=(read,), name="vit-ct-signals", daemon=True).start()


def received_signal() -> signal.Signals | None:
    """The signal that interrupted this process (SIGTERM or SIGINT), if one did."""
    return _state["received"]
