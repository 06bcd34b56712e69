"""The run folder, in one place: ``runs/<project>/<run id>/`` (checkpoints, config.yaml, summary.json, bad_files.csv)
and ``runs/latest``, a link to the newest run that finished fitting with a checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import yaml
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info

from vit_ct.files import atomic_write
from vit_ct.run.summary import LATEST_SUMMARY  # noqa: F401 (where runs/latest's summary is: read by the review)


def run_dir(trainer: Trainer) -> Path:
    """Folder of this run: ``<save_dir>/<project>/<run id>`` for W&B (where Lightning puts the checkpoints), the
    logger's own folder for other loggers, ``default_root_dir`` without a logger."""
    logger = trainer.logger
    if isinstance(logger, WandbLogger):
        return Path(logger.save_dir or trainer.default_root_dir) / str(logger.name) / str(logger.version)
    # `Trainer.log_dir` without its broadcast: this runs in rank-0-only code, where a collective call hangs DDP.
    if logger is None:
        return Path(trainer.default_root_dir)
    return Path(getattr(logger, "log_dir", None) or logger.save_dir or trainer.default_root_dir)


def latest_link(trainer: Trainer) -> Path | None:
    """``<save_dir>/latest`` beside the W&B project folders; None for other loggers or none (no runs tree)."""
    logger = trainer.logger
    if isinstance(logger, WandbLogger):
        return Path(logger.save_dir or trainer.default_root_dir) / "latest"
    return None


def write_summary(trainer: Trainer, summary: dict) -> Path:
    """``summary.json`` into the run folder (atomically), then ``latest`` pointed at the run (atomically too, so it
    always points at a complete run) if the run has a checkpoint (``best_checkpoint`` or ``last_checkpoint``). Rank 0
    only."""
    folder = run_dir(trainer)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "summary.json"
    with atomic_write(path) as tmp:
        tmp.write_text(json.dumps(summary, indent=2))
    latest = latest_link(trainer)
    has_checkpoint = any(summary.get(k) and Path(summary[k]).is_file() for k in ("best_checkpoint", "last_checkpoint"))
    if has_checkpoint and latest is not None and (latest.is_symlink() or not latest.exists()):  # never a real folder
        tmp = latest.with_name(f".latest.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(folder.resolve(), target_is_directory=True)
        tmp.replace(latest)
    return path


def remove_run_without_checkpoint(folder: Path) -> bool:
    """Delete a failed run's folder if it holds no checkpoint (only its config.yaml and reports); True if removed.
    A folder with a checkpoint (e.g. a resumed run's) is always kept."""
    if not folder.is_dir() or any(folder.rglob("*.ckpt")):
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return True


class BadFilesReport(Callback):
    """Writes the manifest rows the data module skipped (``on_bad_file="skip"``) to ``bad_files.csv`` in the run
    folder, on rank 0, once the run (and so its folder) exists: after the data module's ``setup``."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        report = getattr(trainer.datamodule, "report_bad_rows", None)
        if report is not None and trainer.is_global_zero:
            report(run_dir(trainer))


class LoggedConfigCallback(SaveConfigCallback):
    """Writes the full CLI config into the run folder and sends it to the logger (W&B), on rank 0 only. If the run
    fails before it wrote a checkpoint, the folder it made (holding only that config) is removed again."""

    created: Path | None = None  # the run folder, when this callback made it

    def save_config(self, trainer: Trainer, pl_module, stage: str) -> None:
        if stage != "fit" and trainer.logger is None:  # no run folder (predict: the outputs are in --output_dir);
            return  # the working folder is not one: its own config.yaml (perhaps the --config) is the user's
        folder = run_dir(trainer)
        self.created = None if folder.exists() else folder
        folder.mkdir(parents=True, exist_ok=True)
        self.parser.save(self.config, folder / self.config_filename, skip_none=False, overwrite=True)
        if trainer.logger is not None:
            config = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
            trainer.logger.log_hyperparams(config)

    def on_exception(self, trainer: Trainer, pl_module, exception: BaseException) -> None:
        if trainer.is_global_zero and self.created is not None and remove_run_without_checkpoint(self.created):
            rank_zero_info(f"the failed run wrote no checkpoint: its folder {self.created} was removed")
