"""W&B runs of a command: offline unless the user configured W&B, placed beside the run folders, started without
deprecated arguments or warnings, quiet (vit-ct prints a run's figures itself), and ended with the command."""

from __future__ import annotations

import os
from pathlib import Path

from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import WandbLogger

from vit_ct.run.compat import wandb_init_arguments


def use_wandb_offline_unless_configured() -> None:
    """Keep W&B offline unless the user set ``WANDB_MODE``, ``WANDB_API_KEY`` or logged in (``~/.netrc``)."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return
    os.environ["WANDB_MODE"] = "offline"


def quiet_wandb_unless_configured() -> None:
    """W&B's quiet mode unless the user chose W&B's verbosity (``WANDB_QUIET``, ``WANDB_SILENT``): W&B then still
    says where the run is (and online, its URL), but not its run history and summary at the end, which would print
    the figures a second time after vit-ct's own list (and cut to 10 rows)."""
    if not os.environ.get("WANDB_QUIET") and not os.environ.get("WANDB_SILENT"):
        os.environ["WANDB_QUIET"] = "true"


def configured_wandb_loggers(config: Namespace) -> list[Namespace]:
    """The W&B loggers a parsed command names in ``--trainer.logger`` (one logger or a list), as ``class_path`` /
    ``init_args`` namespaces still to be instantiated."""
    loggers = config.trainer.logger if isinstance(config.trainer.logger, list) else [config.trainer.logger]
    return [
        logger
        for logger in loggers
        if isinstance(logger, Namespace) and str(logger.get("class_path", "")).endswith("WandbLogger")
    ]


def place_wandb_runs(config: Namespace) -> None:
    """A W&B logger without ``save_dir`` saves its run (and Lightning the checkpoints) under
    ``--trainer.default_root_dir``, else under ``runs/``; an explicit ``save_dir`` (or ``dir``) wins."""
    for logger in configured_wandb_loggers(config):
        if logger.init_args.get("save_dir") is None and logger.init_args.get("dir") is None:
            # absolute: W&B writes its files from another thread, which must not follow a later change of directory
            logger.init_args.save_dir = os.path.abspath(config.trainer.get("default_root_dir") or "runs")


def make_wandb_dirs(trainer: Trainer) -> None:
    """Make each W&B logger's folder before its run starts. W&B reads the code's git commit from that folder, and
    warns ("git root ... does not exist") instead when it is not there yet, as ``runs/`` is before a first fit."""
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and logger.save_dir:
            Path(logger.save_dir).mkdir(parents=True, exist_ok=True)


def drop_unset_anonymous(logger: WandbLogger) -> None:
    """Lightning's WandbLogger always passes ``anonymous`` to ``wandb.init`` (None when unset), and W&B (>= 0.19)
    warns about the deprecated setting whenever it is passed at all; leave it out unless the user set it."""
    arguments = wandb_init_arguments(logger)
    if arguments.get("anonymous", "set") is None:
        del arguments["anonymous"]


def wandb_dir(trainer: Trainer) -> str | None:
    logger = trainer.logger
    if isinstance(logger, WandbLogger):
        run = logger.experiment
        return getattr(run, "dir", None) and str(Path(run.dir).parent.resolve())
    return None


def finish_wandb_run(exit_code: int) -> None:
    """A command's W&B run ends with the command. Otherwise the next ``main()`` in the same Python process (a notebook,
    a script running several commands) would log into it: Lightning's WandbLogger reuses an active run."""
    import wandb

    if wandb.run is not None:
        wandb.finish(exit_code=exit_code)
