"""Test probes a `vit-ct` subprocess can load (``--trainer.callbacks+=probes.PauseAtBatch`` with this folder on
PYTHONPATH): they make a run stop at a known point, so that a test can signal it there."""

from __future__ import annotations

import json
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


class RecordThreads(Callback):
    """At the start of training, writes ``folder/rank<r>.json``: torch's intra-op threads, and ``OMP_WAIT_POLICY`` as
    it was when the process started (what its OpenMP runtime read as torch loaded)."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_start(self, trainer, pl_module) -> None:
        import json

        import torch

        from vit_ct.run.threads import USER_SET

        record = {"threads": torch.get_num_threads(), "wait_policy": USER_SET["OMP_WAIT_POLICY"]}
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


class RecordLabels(Callback):
    """At every training batch, appends each slice's ``label``, ``scan_label`` and ``scan`` to ``path`` (JSON lines):
    what the losses were given; at each training epoch's end, the names of the figures logged so far."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        record = {key: batch[key].tolist() for key in ("label", "scan_label", "scan") if key in batch}
        with self.path.open("a") as f:
            f.write(json.dumps({"epoch": trainer.current_epoch, "batch": batch_idx, **record}) + "\n")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"logged": sorted(trainer.callback_metrics)}) + "\n")


class RecordScanMemory(Callback):
    """At the end of training, writes ``folder/rank<r>.json``: the training rows this rank's scan-bag memory holds
    evidence of, and the validation's scan AUROC."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_end(self, trainer, pl_module) -> None:
        memory = pl_module.scan_bags.memory
        rows = [] if memory.evidence is None else memory.evidence[:, 0].isfinite().nonzero().squeeze(1).tolist()
        scan_auroc = trainer.callback_metrics.get("val/scan_auroc")
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {"rows": rows, "scan_auroc": None if scan_auroc is None else float(scan_auroc)}
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
