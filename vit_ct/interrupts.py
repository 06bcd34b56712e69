"""SIGTERM (what ``kill``, ``timeout`` and schedulers send) stops a ``vit-ct`` command as Ctrl-C does: the running
trainer shuts down through its exception hooks (a predict's partial outputs removed, a fit's checkpoints kept), and
the command exits with a one-line message instead of finishing its work or dying in a DataLoader worker.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

EXIT_STATUS = {signal.SIGTERM: 128 + signal.SIGTERM, signal.SIGINT: 128 + signal.SIGINT}  # the shell's convention


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when the process receives SIGTERM. A ``KeyboardInterrupt``, so that it passes every
    ``except Exception`` (a file check must not record it as a bad file) and Lightning shuts the trainer down as for
    Ctrl-C."""


_state = {"main_pid": None, "received": None, "deferred": 0, "pending": False}


def _on_sigterm(signum: int, frame) -> None:
    if os.getpid() != _state["main_pid"]:
        # A forked DataLoader worker: its parent decides (workers end when their loader shuts down or their parent
        # dies); raising here would surface in the parent as a crashed worker instead of an interrupted command.
        return
    _state["received"] = signal.Signals(signum)
    if _state["deferred"]:
        _state["pending"] = True  # raised when the protected block ends
        return
    raise Terminated(f"received {signal.Signals(signum).name}")


def stop_on_sigterm() -> None:
    """Makes SIGTERM raise :class:`Terminated` in this (the main) process; its forked workers ignore it."""
    _state["main_pid"] = os.getpid()
    signal.signal(signal.SIGTERM, _on_sigterm)


def received_signal() -> signal.Signals | None:
    """The signal that interrupted this process (SIGTERM), if one did."""
    return _state["received"]


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """A block that a SIGTERM must not cut in two (e.g. swapping an output folder in with two renames): the signal
    takes effect when the block ends."""
    _state["deferred"] += 1
    try:
        yield
    finally:
        _state["deferred"] -= 1
        if not _state["deferred"] and _state["pending"]:
            _state["pending"] = False
            raise Terminated(f"received {_state['received'].name}")
