"""What a ``vit-ct`` command prints when it does not simply succeed: an error in one line naming the input at fault
(``--debug`` or ``VIT_CT_DEBUG=1``: the traceback), an interruption in one line saying what was left; and Lightning's
lines a user can do nothing about, filtered out. Standard library only: the command's fast paths (``--help``) use it
before torch is imported. (A bad option value is named in one line by the parser: ``vit_ct.run.command``.)"""

from __future__ import annotations

import logging
import signal
import sys
import traceback
import warnings
from pathlib import Path

from vit_ct.run.interrupts import EXIT_STATUS, received_signal

DEBUG = "VIT_CT_DEBUG"  # set (or `--debug`): errors print their full traceback


class _NoNoise(logging.Filter):
    """Lines of Lightning's that say nothing a user can act on: a tip to install its own cloud logger (on every run
    without it) and, when SIGTERM stopped the command, that a "KeyboardInterrupt" was detected (vit-ct's own line
    says what happened)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "litlogger" in message:
            return False
        return not (received_signal() is not None and ("KeyboardInterrupt" in message or "SIGTERM" in message))


def quiet_lightning() -> None:
    """Filters out of Lightning's output what a vit-ct user cannot act on (:class:`_NoNoise`, the warnings below)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.pytorch.trainer.connectors.signal_connector"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoNoise) for f in logger.filters):  # once, however many commands a process runs
            logger.addFilter(_NoNoise())
    # Lightning's own pytree helper uses a torch API that torch >= 2.10 deprecates, on every predict and test
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    # predict runs without the checkpoint's ModelCheckpoint on purpose (it writes no checkpoints)
    warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`, callbacks used to create")
    # The model summary knows no size for mixed precision and counts 32 bits a parameter, which is what mixed
    # precision keeps its weights in: the estimate is right and the warning (on every bf16 / fp16 run) is not.
    warnings.filterwarnings("ignore", message=r"Precision \S+-mixed is not supported by the model summary")


def counted(n: int, noun: str) -> str:
    """``1 scan``, ``2 scans``: a count and its noun (regular plurals)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def print_interrupted(signum: signal.Signals, subcommand: list[str]) -> int:
    """One line saying what an interrupted command left; returns the exit status (128 + the signal)."""
    left = {
        "fit": "the checkpoints written so far are kept (resume with --ckpt_path RUN/checkpoints/last.ckpt)",
        "predict": "--output_dir is as it was before this run",
    }.get(subcommand[0] if subcommand else "", "nothing half-written is left")
    name = "Ctrl-C" if signum == signal.SIGINT else signum.name
    print(f"vit-ct: interrupted ({name}): {left}", file=sys.stderr)
    return EXIT_STATUS.get(signum, 1)


def print_error(err: Exception) -> int:
    """The error's message and the line that raised it, on stderr; returns the exit status."""
    err = innermost(err)
    frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    where = f" at {frame.filename}:{frame.lineno}" if frame else ""
    kind = "" if isinstance(err, ValueError) else f"{type(err).__name__}: "  # a ValueError's message names the input
    print(f"vit-ct: error: {kind}{err}", file=sys.stderr)
    print(f"  ({type(err).__name__}{where}; the full traceback: rerun with --debug or {DEBUG}=1)", file=sys.stderr)
    return 1


def innermost(err: BaseException) -> BaseException:
    """The error vit-ct itself raised, when a library wrapped it: jsonargparse reports a bad ``--data.*`` value that
    the data module refused inside a dump of every subtype it tried, with vit-ct's ValueError as the cause."""
    found = err
    while found.__cause__ is not None:
        found = found.__cause__
        if isinstance(found, ValueError) and any(
            "vit_ct" in Path(frame.filename).parts for frame in traceback.extract_tb(found.__traceback__)
        ):
            return found
    return err
