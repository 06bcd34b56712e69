"""Test probes a `vit-ct` subprocess can load (``--trainer.callbacks+=probes.PauseAtBatch`` with this folder on
PYTHONPATH): they make a run stop at a known point, so that a test can signal it there."""

from __future__ import annotations

import os
import time
from pathlib import Path

from lightning.pytorch import Callback


class PauseAtBatch(Callback):
    """At the start of batch ``batch`` of training, testing or prediction, touches the file named by the environment
    variable ``VIT_CT_PROBE_READY`` and sleeps ``seconds`` (a signal sent meanwhile interrupts it there)."""

    def __init__(self, batch: int = 0, seconds: float = 120.0) -> None:
        self.batch = batch
        self.seconds = seconds

    def _pause(self, batch_idx: int) -> None:
        if batch_idx == self.batch:
            Path(os.environ["VIT_CT_PROBE_READY"]).touch()
            time.sleep(self.seconds)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.current_epoch == 1:  # after the first epoch wrote its checkpoints
            self._pause(batch_idx)

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._pause(batch_idx)

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._pause(batch_idx)
