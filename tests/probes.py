"""Test probes a `vit-ct` subprocess can load (``--trainer.callbacks+=probes.PauseAtBatch`` with this folder on
PYTHONPATH): they make a run stop, fail or record at a known point, so that a test can signal it there or read what
it saw. They live here, not in the test modules that use them: a subprocess has only this folder on its path, not the
room folder a test module sits in."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import torch
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


class HostSyncs(Callback):
    """Counts, per training step (from one step's end to the next one's: reading the batch, moving and augmenting
    it, the step, logging, callbacks), the tensor operations that make the host wait for the device where the
    tensors live on a GPU: reading a value (``.item()``, ``bool()``, ``float()``), ``nonzero`` and boolean masks,
    whose output size depends on the values. Those inside the model's own step (``model.losses``, the backward pass,
    the optimizer step) are the model's, the same in any loop, and counted apart. Writes ``path`` (JSON) when training
    ends: ``{"loop": [per step], "model": [per step], "where": {...}}``."""

    SYNCS = ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "item")

    def __init__(self, path: str) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        probe = self

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if probe._syncs(func, args):
                    part = "model" if probe.inside else "loop"
                    probe.counts[part] += 1
                    if part == "loop":
                        probe.where[_caller()] = probe.where.get(_caller(), 0) + 1
                return func(*args, **kwargs)

        self.path, self.mode_type, self.mode = Path(path), Count, None
        self.inside, self.counts, self.steps, self.where = 0, {"loop": 0, "model": 0}, [], {}

    def _syncs(self, func, args) -> bool:
        import torch

        name = func.__name__.split(".")[0]
        if name in self.SYNCS:
            return True
        indices = args[1] if name in ("index", "index_put", "index_put_") and len(args) > 1 else ()
        return any(getattr(i, "dtype", None) == torch.bool for i in indices or ())

    def _enter_model(self, method):
        def wrapped(*args, **kwargs):
            self.inside += 1
            try:
                return method(*args, **kwargs)
            finally:
                self.inside -= 1

        return wrapped

    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.losses = self._enter_model(pl_module.losses)
        for optimizer in trainer.optimizers:
            optimizer.register_step_pre_hook(lambda *_: setattr(self, "inside", self.inside + 1))
            optimizer.register_step_post_hook(lambda *_: setattr(self, "inside", self.inside - 1))
        self.mode = self.mode_type()
        self.mode.__enter__()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.inside += 1

    def on_after_backward(self, trainer, pl_module) -> None:
        self.inside -= 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(dict(self.counts, epoch=trainer.current_epoch))
        self.counts = {"loop": 0, "model": 0}

    def on_train_end(self, trainer, pl_module) -> None:
        self.mode.__exit__(None, None, None)
        steps = self.steps[1:]  # the first step's count began at on_train_start, not at a step's end
        record = {key: [s[key] for s in steps] for key in ("loop", "model", "epoch")} | {"where": self.where}
        self.path.write_text(json.dumps(record))


def _caller() -> str:
    """Where a counted operation came from: the innermost frames outside torch."""
    import traceback

    frames = [
        f for f in traceback.extract_stack() if not any(s in f.filename for s in ("/torch/", "probes.py", "apply_func"))
    ]
    return " < ".join(
        f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-3:]) if "apply_func" not in f.filename
    )


class CacheProbe(Callback):
    """Test probe: writes, per rank, what its check read and cached, and each training slice's image sum."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self.sums: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for index, image in zip(batch["index"].tolist(), batch["image"], strict=True):
            self.sums[index] = float(image.double().sum())

    def on_train_end(self, trainer, pl_module) -> None:
        data = trainer.datamodule
        record = {
            "read": data.check_record.added,
            "cached": data.slice_cache.written,
            "cache": str(data.slice_cache.folder),
            "sums": self.sums,
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


class FailAtBatch(Callback):
    """Test probe: raises at the start of batch ``batch`` of training or prediction."""

    def __init__(self, batch: int = 0) -> None:
        self.batch = batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.batch:
            raise RuntimeError("probe: failing on purpose")

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if batch_idx == self.batch:
            raise RuntimeError("probe: failing on purpose")


class PauseInValidation(Callback):
    """Test probe: in the second epoch's validation, before its metrics sync, every rank writes ``folder/rank<r>``
    (its pid) and rank ``rank`` sleeps ``seconds``, so that the others wait for it in the next collective."""

    def __init__(self, folder: str, rank: int = 0, seconds: float = 300.0) -> None:
        self.folder, self.rank, self.seconds = Path(folder), rank, seconds

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or trainer.current_epoch != 1:
            return
        (self.folder / f"rank{trainer.global_rank}").write_text(str(os.getpid()))
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)


class StallAtStep(Callback):
    """Test probe: stops making progress (without exiting) once ``step`` optimizer steps are done."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, Path(marker)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.marker.write_text(str(batch_idx))
            time.sleep(300)  # the test kills it long before


class RecordIndices(Callback):
    """Test probe: writes, per rank and stage, the slice indices it ran on (with ``valid``) and the final metrics."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self.seen: dict[str, list] = {}

    def _record(self, stage: str, batch: dict) -> None:
        pairs = zip(batch["index"].tolist(), batch["valid"].tolist(), strict=True)
        self.seen.setdefault(stage, []).extend(pairs)

    def on_train_start(self, trainer, pl_module) -> None:
        torch.set_num_threads(1)  # two processes share the two cores

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._record("train", batch)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking:
            self._record("val", batch)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        record = {"world_size": trainer.world_size, "seen": self.seen, "metrics": metrics}
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"{trainer.state.fn.value}-rank{trainer.global_rank}.json"
        (self.folder / name).write_text(json.dumps(record))


class FillDisk(Callback):
    """Test probe: at the start of the second epoch, fills the disk holding ``folder`` to its last byte."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 1:
            with open(self.folder / "filler", "wb", buffering=0) as filler:
                try:
                    while True:
                        filler.write(b"\0" * 4096)
                except OSError as err:
                    assert err.errno == errno.ENOSPC
