"""Checkpoints you can trust: written atomically, loaded without executing code, and holding what an exact resume
needs beyond Lightning's own state (random-number generators, the W&B run id).

Resuming: ``vit-ct fit --config C --ckpt_path runs/vit-ct/<id>/checkpoints/last.ckpt`` restores the weights, optimizer,
LR schedule, epoch and step (Lightning), the data order in the epoch (:mod:`vit_ct.data.loading.distributed`), the RNG
states and the W&B run (same id, ``resume="allow"``); checkpoints keep going to the same run folder. Arguments on
resume: ``--model.*`` values come from the checkpoint (LightningCLI reads its hyper-parameters over the command line),
so the network cannot change; ``--trainer.*`` and ``--data.*`` values come from the command, e.g. a larger
``--trainer.max_epochs`` trains on (the restored optimizer keeps its state; the cosine schedule is recomputed for the
new length from the current step).
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_warn

from vit_ct.data.cache.cache_folder import is_out_of_space
from vit_ct.files import atomic_write, remove_leftovers
from vit_ct.model.weights_input import read_checkpoint
from vit_ct.run.compat import load_pending_loader_states, save_last_checkpoint, saves_on_train_epoch_end

WANDB_RUN_ID = "wandb_run_id"  # top-level checkpoint key
SLICE_MONITOR, SCAN_MONITOR = "val/auroc", "val/scan_auroc"  # the default monitor, and its stand-in on scan labels


class CheckpointDiskFullError(OSError):
    """A checkpoint did not fit on its disk (or in the user's quota, or under the file size limit). The message names
    the checkpoint, the free space and what was kept: the file at that path is as it was before (written atomically).
    """


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``torch.save`` / ``torch.load`` checkpoint I/O, made safe for local files.

    Saving writes a hidden temporary file in the target folder, flushes it to disk and renames it over the target
    (``os.replace`` is atomic on POSIX and Windows), so a killed job leaves either the old or the new checkpoint,
    never a torn one; a full disk raises :class:`CheckpointDiskFullError`. Loading always uses ``weights_only=True``:
    a checkpoint cannot run code.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):  # remote (fsspec) paths keep Lightning's writer
            return super().save_checkpoint(checkpoint, path, storage_options)
        remove_leftovers(Path(path).parent)  # temporary files of a killed earlier save
        try:
            # Through a Python file, not a path: torch's own file writer ignores a failed write and then fails on a
            # position check ("[enforce fail at inline_container.cc:672]"); a Python file raises the OS's error.
            with atomic_write(path, durable=True) as tmp, open(tmp, "wb") as file:
                torch.save(checkpoint, file)
        except Exception as err:
            full = _out_of_space_cause(err)
            if full is None:
                raise
            raise disk_full_error(Path(path), full, needed=tensor_bytes(checkpoint)) from err

    def load_checkpoint(self, path, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None):
        if weights_only is False:
            raise ValueError(f"vit-ct loads checkpoints with weights_only=True only (asked to unpickle {path})")
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)


def _out_of_space_cause(err: BaseException) -> OSError | None:
    """The out-of-space OSError behind ``err``, if any: torch.save, failing to finish its archive after a write
    failed, raises its own RuntimeError with the OS's error as the context."""
    while err is not None:
        if is_out_of_space(err):
            return err
        err = err.__cause__ or err.__context__
    return None


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in a (nested) checkpoint: what its file needs, to within its small pickle."""
    if isinstance(value, torch.Tensor):
        return value.untyped_storage().nbytes()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


def disk_full_error(path: Path, error: OSError, *, needed: int) -> CheckpointDiskFullError:
    """The error for a checkpoint that did not fit: the path, the OS's reason, the free space, what was kept."""
    try:
        disk = os.statvfs(path.parent)
        free = f"{disk.f_bavail * disk.f_frsize / 1e6:.1f} MB free in {path.parent}"
    except OSError:
        free = f"free space in {path.parent} unknown"
    kept = f"the previous {path.name} is intact" if path.exists() else f"nothing was written at {path}"
    last = path.parent / "last.ckpt"
    resume = f"--ckpt_path {last}" if last.is_file() else "--ckpt_path and the last checkpoint"
    full = CheckpointDiskFullError(
        f"checkpoint {path} was not written: {error.strerror or error} ({free}; the checkpoint needs about"
        f" {needed / 1e6:.1f} MB); {kept}, and the folder's other checkpoints are untouched (checkpoints are written"
        f" whole or not at all). Free some space, or write the run to another disk (--trainer.default_root_dir),"
        f" and resume with {resume}"
    )
    full.errno = error.errno
    return full


def read_wandb_run_id(path: str | Path) -> str | None:
    """The W&B run id stored in a vit-ct checkpoint (None for other checkpoints); never executes code from it."""
    run_id = read_checkpoint(path).get(WANDB_RUN_ID)
    return str(run_id) if run_id else None


def _rng_states() -> dict[str, Any]:
    """Global RNG states as tensors and plain Python values (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()  # noqa: NPY002 (the legacy global state is saved)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "python": random.getstate(),
    }


def _set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))  # noqa: NPY002
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))


class ResumeState(Callback):
    """Stores the RNG states and the W&B run id in every checkpoint; restores the RNG states when training resumes.

    The states are put back at ``on_train_start``, after the sanity check and the data loaders' set-up, so the
    resumed steps draw the same dropout and drop-path masks as an uninterrupted run.
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"rng": _rng_states()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict.get("rng")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning 2.6 restores a stateful training loader only if it builds the loader after the restore, but
        # `configure_optimizers` asking for `estimated_stepping_batches` builds it before. Apply the saved loader state
        # now: the first batch is not drawn yet (data/loading/distributed.py: its loader starts iterating lazily).
        load_pending_loader_states(trainer.fit_loop)
        if self._pending is not None:
            _set_rng_states(self._pending)
            self._pending = None

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        for logger in trainer.loggers:
            # On rank 0 `version` is the live run's id; other ranks write no checkpoint file.
            if isinstance(logger, WandbLogger) and trainer.is_global_zero and logger.version:
                checkpoint[WANDB_RUN_ID] = str(logger.version)


class BestAndLastCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``last.ckpt`` is always the latest validated state.

    Lightning 2.6 refreshes ``last.ckpt`` only on validations that also wrote a top-k checkpoint, so an epoch that ties
    or trails the best one left ``last.ckpt`` at an older epoch, and resuming from it would silently repeat epochs.
    Here every validation (and every epoch end when there is no validation) refreshes ``last.ckpt``, at whichever of
    the two hooks Lightning saves checkpoints for this trainer: the train epoch's end when validation runs once per
    epoch, the validation's end when it runs every N steps or every N epochs.

    A NaN monitored value (``val/auroc`` of a validation split holding one class, where AUROC is undefined) never makes
    a best checkpoint; Lightning would rank NaN as the worst score and still keep it while fewer than ``save_top_k``
    exist.
    """

    _warned_nan = False
    _writing_last = False  # inside Lightning's _save_last_checkpoint
    _written: tuple[int, str, str] | None = None  # the last save: (step, last_model_path in its state, the file)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero and self.dirpath:
            remove_leftovers(self.dirpath)  # temporary files of a run killed while saving (resumed into this folder)

    def format_checkpoint_name(self, metrics: dict, filename: str | None = None, ver=None, prefix=None) -> str:
        """Lightning's name, except that a metric that was not measured (absent, e.g. without validation, or NaN,
        e.g. AUROC on a split of one class) is written ``na``, where Lightning writes 0: a name never claims a score
        that does not exist (``final-epoch00-aurocna.ckpt``, not ``...-auroc0.0000.ckpt``)."""

        def unmeasured(match: re.Match) -> str:
            name = match.group(1)
            value = metrics.get(name)
            if name in ("epoch", "step") or (value is not None and not torch.isnan(torch.as_tensor(value).float())):
                return match.group(0)
            return f"{name}{self.CHECKPOINT_EQUALS_CHAR}na" if self.auto_insert_metric_name else "na"

        template = filename or self.filename
        if template:
            template = re.sub(r"\{([^{}:]+)(?::[^{}]*)?\}", unmeasured, template)
        return super().format_checkpoint_name(metrics, filename=template, ver=ver, prefix=prefix)

    def _save_monitor_checkpoint(self, trainer: Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        current = monitor_candidates.get(self.monitor)
        scans = monitor_candidates.get(SCAN_MONITOR)
        # scan labels: slice AUROC undefined, and no best chosen on it yet
        if (
            self.monitor == SLICE_MONITOR
            and _nan(current)
            and scans is not None
            and not _nan(scans)
            and not self.best_model_path
        ):
            rank_zero_warn(
                f"{SLICE_MONITOR} is NaN (a validation split labelled by scan has no slice labels of lesions): the best"
                f" checkpoint is chosen on {SCAN_MONITOR}"
            )
            self.monitor, current = SCAN_MONITOR, scans
        if current is not None and _nan(current):
            if not self._warned_nan:
                rank_zero_warn(
                    f"{self.monitor} is NaN (undefined on this validation): no best checkpoint is chosen on it;"
                    " last.ckpt is still written"
                )
                self._warned_nan = True
            return
        super()._save_monitor_checkpoint(trainer, monitor_candidates)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if saves_on_train_epoch_end(self, trainer):
            self._refresh_last(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not saves_on_train_epoch_end(self, trainer):
            self._refresh_last(trainer)

    def _refresh_last(self, trainer: Trainer) -> None:
        if self.save_last:
            save_last_checkpoint(self, trainer)

    def _save_last_checkpoint(self, trainer: Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        self._writing_last = True
        try:
            super()._save_last_checkpoint(trainer, monitor_candidates)
        finally:
            self._writing_last = False

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        """Lightning's, except for ``last.ckpt`` at a step where this callback has just written the same state (the
        epoch's checkpoint without validation, or a new best): then ``last.ckpt`` is a second name for that file, a
        hard link made atomically, instead of a second serialisation and flush of the same bytes. The two states are
        the same when the first one already named this ``last.ckpt`` (``last_model_path``), as from the second epoch
        on. Only with vit-ct's own checkpoint writer (local, synchronous), else Lightning saves as usual."""
        written = self._written
        same_state = written is not None and written[:2] == (trainer.global_step, filepath)
        if self._writing_last and same_state and type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO:
            if trainer.is_global_zero:
                link_or_copy(Path(written[2]), Path(filepath))
            trainer.strategy.barrier("BestAndLastCheckpoint.link")
            self._last_global_step_saved, self._last_checkpoint_saved = trainer.global_step, filepath
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.after_save_checkpoint(self)
            return
        super()._save_checkpoint(trainer, filepath)
        self._written = (trainer.global_step, self.last_model_path, filepath)


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` becomes another name of ``source`` (a copy where the file system has no hard links), replacing it
    atomically and durably: a crash leaves the old ``target`` or the new one."""
    with atomic_write(target, durable=True) as tmp:
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)


def _nan(value) -> bool:
    return value is not None and bool(torch.isnan(torch.as_tensor(value).float()).item())
