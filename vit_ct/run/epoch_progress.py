"""Progress for runs whose output goes to a file (SLURM, nohup, CI): Rich's progress bar draws nothing when stdout is
not a terminal (only its last frame, which vit-ct leaves out too), so a line per epoch is printed instead."""

from __future__ import annotations

import sys
import time

import torch
from lightning.pytorch.callbacks import Callback, RichProgressBar
from lightning.pytorch.utilities import rank_zero_only

from vit_ct.progress import headless_flag, in_jupyter_kernel

# Shown in this order when logged; other epoch metrics are left to the logger.
KEYS = ("train/loss_epoch", "train/loss", "val/loss", "val/auroc", "val/scan_auroc")


class LoggedLossBar(RichProgressBar):
    """Lightning's rich progress bar, showing the training loss as it stood at the latest logging step (every
    ``trainer.log_every_n_steps``). A value logged with ``prog_bar=True`` is read (``.item()``) at every step, which on
    a GPU makes the host wait for the device each step; this reads one at the interval the logs use."""

    def __init__(self) -> None:
        super().__init__()
        self._loss: dict[str, float] = {}

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        if trainer.training and (not self._loss or trainer.global_step % max(1, trainer.log_every_n_steps) == 0):
            loss = trainer.callback_metrics.get("train/loss")
            if loss is not None:
                self._loss = {"train/loss": float(loss)}
        return {**metrics, **self._loss} if trainer.training else metrics


def progress_bar() -> RichProgressBar:
    """Lightning's rich progress bar (:class:`LoggedLossBar`) where someone watches it draw (a terminal, a Jupyter
    kernel that is not headless); elsewhere a disabled one. Written to a file, rich draws nothing while a stage runs
    and prints its last frame when it ends, with every figure logged to the bar (a fit's validation figures, again);
    :class:`EpochLines` prints a line per epoch there instead."""
    bar = LoggedLossBar()
    if not (sys.stdout.isatty() or (in_jupyter_kernel() and headless_flag() is not True)):
        bar.disable()  # still the trainer's progress bar: Lightning adds no default one of its own
    return bar


class EpochLines(Callback):
    """After each training epoch (its validation included), when stdout is not a terminal: ``epoch 3/20
    train/loss 0.512 val/loss 0.498 val/auroc 0.871 42.1 s``, flushed at once; the ``val/`` figures only on the epochs
    that validated (with ``check_val_every_n_epoch`` > 1 the others would repeat the last ones as if measured).

    Args:
        always: Print also on a terminal (beside the progress bar).
    """

    def __init__(self, *, always: bool = False) -> None:
        self.always = always
        self._start = time.monotonic()
        self._validated = False  # whether this epoch measured val/ figures (check_val_every_n_epoch > 1 skips some)

    def _enabled(self) -> bool:
        return self.always or not sys.stdout.isatty()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._start = time.monotonic()
        self._validated = False

    def on_validation_end(self, trainer, pl_module) -> None:
        self._validated = self._validated or not trainer.sanity_checking

    @rank_zero_only
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not self._enabled() or trainer.sanity_checking:
            return
        metrics = trainer.callback_metrics
        parts = [f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}"]
        shown = [k for k in KEYS if k in metrics and not (k == "train/loss" and "train/loss_epoch" in metrics)]
        shown = [k for k in shown if self._validated or not k.startswith("val/")]  # an earlier epoch's, not this one's
        for key in shown:
            value = metrics[key]
            if torch.is_tensor(value) and value.numel() == 1:
                parts.append(f"{key.removesuffix('_epoch')} {float(value):.4f}")
        parts.append(f"{time.monotonic() - self._start:.1f} s")
        print("  ".join(parts), flush=True)
