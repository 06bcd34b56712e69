"""Lightning's signal connector, less the collective its SIGTERM handler runs under DDP (see
:mod:`vit_ct.run.interrupts` for how a signal stops a vit-ct command and its ranks)."""

from __future__ import annotations

import contextlib
import subprocess

from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

from vit_ct.run.interrupts import is_led_rank, received_signal

RANK_EXIT_WAIT_S = 30.0  # a SIGKILLed rank is gone within milliseconds; this only bounds a stuck kernel


class SignalConnector(_SignalConnector):
    """Lightning's connector (SLURM requeue, the handlers restored at teardown) whose SIGTERM handler runs no
    collective and sends nothing on to the other ranks.

    Lightning (2.5.2 and later) broadcasts from rank 0 inside its SIGTERM handler. A handler runs wherever the main
    thread was, e.g. between two all-gathers of a metric's sync while another rank already waits in the second: rank
    0 then waits in the broadcast and the other rank in the all-gather, for ever (2 times in 6 on a CPU fit). Lightning
    also sends the signal on to the ranks it started, which would then stop by themselves; its child-process
    observer kills the leader as soon as one of them exits with an error, cutting the leader's shutdown short. Under
    vit-ct the leader stops the job instead, and ends the ranks it started once its own trainer has shut down.
    """

    def _sigterm_notifier_fn(self, signum, frame) -> None:
        # A led rank carries on until the leader ends it; elsewhere Lightning's loops read the flag (a trainer used
        # from Python, where vit-ct's handlers are not installed, stops at the end of the batch).
        if not is_led_rank():
            self.received_sigterm = True

    def teardown(self) -> None:
        if received_signal() is not None:
            end_started_ranks(self.trainer.strategy.launcher)
        super().teardown()


def end_started_ranks(launcher) -> None:
    """SIGKILL the ranks Lightning's launcher started from this process, and wait for them. They hold nothing to
    save (the leader writes the checkpoints and the outputs), and they may be waiting in a collective for a leader
    that will never join it. Taken out of the launcher's list first, which its child-process observer shares: the
    observer kills this process when a rank it watches exits with an error."""
    if not isinstance(launcher, _SubprocessScriptLauncher):
        return
    ranks = list(launcher.procs)
    launcher.procs.clear()
    for rank in ranks:
        rank.kill()
    for rank in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            rank.wait(timeout=RANK_EXIT_WAIT_S)
