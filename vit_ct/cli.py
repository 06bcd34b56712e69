"""The ``vit-ct`` command: a LightningCLI (fit / validate / test / predict) with W&B tracking and checkpoints.

Runs go to ``runs/<project>/<run id>/`` (checkpoints, config.yaml, summary.json; :mod:`vit_ct.run.runs`);
``runs/latest`` points at the newest fit that wrote a checkpoint. An error prints its message and where it was raised,
and exits 1; ``--debug`` (or ``VIT_CT_DEBUG=1``) prints the full traceback instead.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from jsonargparse import Namespace, lazy_instance
from lightning.fabric.plugins.io import CheckpointIO, TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from rich.console import Console

from vit_ct.data.slice_module import SliceDataModule
from vit_ct.model import ViTClassifier
from vit_ct.run.checkpoint import (
    AtomicCheckpointIO,
    BestAndLastCheckpoint,
    ResumeState,
    read_checkpoint,
    read_wandb_run_id,
)
from vit_ct.run.checkpoint_input import SPECIAL_CKPT_PATHS, follow_checkpoint
from vit_ct.run.compat import subcommand_defaults
from vit_ct.run.console import DEBUG, CommandParser, print_error, print_interrupted, quiet_lightning
from vit_ct.run.hardware import accelerator_name, describe_machine, resolve_precision
from vit_ct.run.interrupts import received_signal, stop_on_sigterm
from vit_ct.run.progress import EpochLines
from vit_ct.run.runs import BadFilesReport, LoggedConfigCallback, run_dir, write_summary
from vit_ct.run.scan_auroc import ScanAUROC
from vit_ct.run.threads import share_cores_with_children, use_threads
from vit_ct.run.trainer import Trainer as AutoPrecisionTrainer
from vit_ct.run.wandb_media import RolloutOverlayCallback
from vit_ct.run.wandb_runs import (
    drop_unset_anonymous,
    finish_wandb_run,
    place_wandb_runs,
    use_wandb_offline_unless_configured,
    wandb_dir,
)

quiet_lightning()


class VitCTCLI(LightningCLI):
    """LightningCLI with the data-to-model links, checkpointing on ``val/auroc`` and a run summary."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(BestAndLastCheckpoint, "checkpoint")
        parser.set_defaults({"data": {"class_path": "vit_ct.CTSliceDataModule"}})  # a config may name another
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/auroc",
                "checkpoint.mode": "max",
                "checkpoint.save_last": True,
                "checkpoint.filename": "best-epoch{epoch:02d}-auroc{val/auroc:.4f}",
                "checkpoint.auto_insert_metric_name": False,
            }
        )
        parser.link_arguments("data.init_args.img_size", "model.img_size")
        parser.link_arguments(
            "data", "model.in_chans", compute_fn=lambda data: data.num_channels, apply_on="instantiate"
        )
        # Multi-label data (`label_columns`) makes a multi-label model with one named output per column. For
        # single-label data `model.num_classes` stays settable; the labels are checked against it before a run.
        parser.link_arguments("data.init_args.label_columns", "model.multilabel", compute_fn=_is_given)
        parser.link_arguments("data.init_args.label_columns", "model.class_names")
        parser.add_argument("--test_after_fit", type=bool, default=False, help="fit: test the best checkpoint after.")
        parser.add_argument("--output_dir", type=str | None, default=None, help="predict: folder of the outputs.")
        parser.add_argument(
            "--overwrite", type=bool, default=False, help="predict: replace a non-empty --output_dir (nothing kept)."
        )

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        for line in follow_checkpoint(config, self.subcommand or "fit", command_line=self.command_line):
            rank_zero_info(line)
        self._resolve_precision(config)
        self._continue_wandb_run(config)
        if config.trainer.get("enable_progress_bar") is False:  # Lightning refuses a progress bar callback then
            callbacks = [c for c in self.trainer_defaults["callbacks"] if not isinstance(c, ProgressBar)]
            self.trainer_defaults = {**self.trainer_defaults, "callbacks": callbacks}
        if self.subcommand == "predict":
            self._predict_without_default_logger(config)
        place_wandb_runs(config)

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        self.command_line = list(args) if isinstance(args, (list, tuple)) else sys.argv[1:]
        super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        """Check ``--ckpt_path`` before Lightning reads the model's hyper-parameters from it: a missing, truncated or
        foreign file is named with what was expected, where torch would raise an error without the file's name."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and str(ckpt_path).split(":")[0] not in SPECIAL_CKPT_PATHS and "://" not in str(ckpt_path):
            read_checkpoint(ckpt_path)
        super()._parse_ckpt_path()

    def _predict_without_default_logger(self, config: Namespace) -> None:
        """``predict`` logs nothing (its results are files in ``--output_dir``): the default W&B logger would open an
        empty run, so it is dropped; a logger the user configured stays."""
        # the predict subcommand's own parser holds its defaults (jsonargparse keeps it in the subcommands action)
        defaults = subcommand_defaults(self.parser, "predict").trainer.logger
        if config.trainer.logger == defaults:
            config.trainer.logger = False

    @staticmethod
    def _resolve_precision(config: Namespace) -> None:
        """``precision: auto`` becomes the machine's choice in the config itself, so that the run's saved config (and
        W&B) records the precision the run really used."""
        precision, reason = resolve_precision(config.trainer.precision, accelerator_name(config.trainer.accelerator))
        if reason is not None:
            config.trainer.precision = precision
            rank_zero_info(f"precision: {precision} (auto: {reason}; --trainer.precision chooses another)")

    def _continue_wandb_run(self, config: Namespace | None) -> None:
        """``fit --ckpt_path K``: continue K's W&B run (its id, ``resume="allow"``) unless the command names a run."""
        ckpt_path = config.get("ckpt_path") if config is not None else None
        if self.subcommand != "fit" or not ckpt_path or not Path(ckpt_path).is_file():
            return
        run_id = read_wandb_run_id(ckpt_path)
        loggers = config.trainer.logger if isinstance(config.trainer.logger, list) else [config.trainer.logger]
        for logger in loggers:
            is_wandb = isinstance(logger, Namespace) and str(logger.get("class_path", "")).endswith("WandbLogger")
            if run_id and is_wandb and not logger.init_args.get("id") and not logger.init_args.get("version"):
                logger.init_args.id = run_id
                logger.dict_kwargs = {**(logger.get("dict_kwargs") or {}), "resume": "allow"}

    def instantiate_trainer(self, **kwargs) -> Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        if trainer.num_devices > 1:  # this machine's ranks share its CPUs: each its share, the children passive
            use_threads(trainer.num_devices)
            share_cores_with_children(trainer.num_devices)
        # Atomic, weights-only checkpoint files, unless the user chose a CheckpointIO (--trainer.plugins).
        plugins = self._get(self.config_init, "trainer", default={}).get("plugins") or []
        chosen = any(isinstance(p, CheckpointIO) for p in (plugins if isinstance(plugins, list) else [plugins]))
        if not chosen and type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if not trainer.loggers:  # `--trainer.logger false`: the LR monitor would refuse to start
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, LearningRateMonitor)]
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                drop_unset_anonymous(logger)
        return trainer

    def _check_data(self, stage: str) -> None:
        """Read and check the manifest (rows, files, labels vs ``num_classes``) before the trainer starts, so bad
        input fails before a W&B run or a checkpoint exists."""
        check = getattr(self.datamodule, "check", None)
        if check is not None:
            check(stage, num_classes=self.model.hparams.num_classes)

    def _refuse_predict_options(self) -> None:
        """``--output_dir`` and ``--overwrite`` exist for every subcommand (LightningCLI shares its extra arguments)
        but only predict uses them: elsewhere they would be silently ignored."""
        config = self.config_init[self.subcommand]
        for name in ("output_dir", "overwrite"):
            if config.get(name):
                raise ValueError(
                    f"--{name} is an option of `vit-ct predict`, not of `vit-ct {self.subcommand}`, which writes its"
                    f" run to runs/<project>/<run id>/ (runs/latest for the newest fit): drop --{name}"
                )

    def before_fit(self) -> None:
        self._refuse_predict_options()
        self._check_data("fit")
        self.test_after_fit = bool(self.config_init[self.subcommand].get("test_after_fit")) and self._has_test_rows()

    def _has_test_rows(self) -> bool:
        """Whether the data has a test split to test on after fitting; says so now, before training, if it has not."""
        manifest = getattr(self.datamodule, "manifest", None)  # None: simulated data, whose test set always exists
        if manifest is None or len(self.datamodule.split_table("test")):
            return True
        rank_zero_info(f"test_after_fit: {manifest} has no rows in split 'test'; fitting without the test after it")
        return False

    def before_validate(self) -> None:
        self._refuse_predict_options()
        self._check_data("validate")

    def before_test(self) -> None:
        self._refuse_predict_options()
        self._check_data("test")

    def before_predict(self) -> None:
        config = self.config_init[self.subcommand]
        if config.get("output_dir") is None:
            raise ValueError("vit-ct predict needs --output_dir OUT (where predictions.csv and maps are written)")
        from vit_ct.predict.scans import ScanResultsWriter
        from vit_ct.predict.writer import PredictionWriter

        inputs = [p for p in (config.get("ckpt_path"), getattr(self.datamodule, "manifest", None)) if p]
        # before reading any slice: a non-empty OUT is refused at once
        writer = PredictionWriter(config["output_dir"], overwrite=bool(config.get("overwrite")), inputs=inputs)
        self._check_data("predict")
        # predict writes no checkpoints (without the callback, restoring its state cannot warn about its folder),
        # and its skip list goes into OUT, written by the PredictionWriter, not into a run folder
        self.trainer.callbacks = [
            c for c in self.trainer.callbacks if not isinstance(c, ModelCheckpoint | BadFilesReport)
        ]
        self.trainer.callbacks.append(writer)
        self.trainer.callbacks.append(ScanResultsWriter(writer))  # runs after it: reads its predictions.csv

    def after_fit(self) -> None:
        if self.test_after_fit:
            checkpoint = self.trainer.checkpoint_callback
            last = getattr(checkpoint, "last_model_path", "")
            self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=_checkpoint_to_test(checkpoint))
            if checkpoint is not None:  # loading "best" put back the callback's state as of that epoch
                checkpoint.last_model_path = last
        self._summarise()

    @rank_zero_only
    def _summarise(self) -> None:
        trainer = self.trainer
        folder = run_dir(trainer)
        checkpoint = trainer.checkpoint_callback
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
        summary = {
            "run_dir": str(folder.resolve()),  # absolute: the summary is read from other folders too
            "best_checkpoint": _absolute(getattr(checkpoint, "best_model_path", "")),
            "last_checkpoint": _absolute(getattr(checkpoint, "last_model_path", "")),
            "wandb_dir": wandb_dir(trainer),
            "machine": describe_machine(),
            "precision": str(trainer.precision),
            "localisation_tolerance_mm": self.model.hparams.localisation_tolerance_mm,
            "metrics": metrics,
        }
        write_summary(trainer, summary)
        console = Console()
        if not summary["best_checkpoint"] and not summary["last_checkpoint"]:
            console.print("[bold]no checkpoint was written[/]: runs/latest does not point at this run")
        console.print(f"[bold]best checkpoint[/]  {summary['best_checkpoint']}")
        console.print(f"[bold]last checkpoint[/]  {summary['last_checkpoint']}")
        console.print(f"[bold]run folder[/]       {folder}")
        if summary["wandb_dir"]:
            console.print(f"[bold]W&B run[/]          {summary['wandb_dir']}")
        for key in sorted(k for k in metrics if k.startswith(("test/", "val/"))):
            console.print(f"  {key:<24} {metrics[key]:.4f}")


def _checkpoint_to_test(checkpoint) -> str | None:
    """``best`` when there is a best checkpoint; else the last checkpoint, or the weights in memory, said in one line
    (without validation, or with ``val/auroc`` never defined, no checkpoint is best)."""
    if checkpoint is not None and checkpoint.best_model_path:
        return "best"
    last = getattr(checkpoint, "last_model_path", "") or None
    chosen = f"the last checkpoint {last}" if last else "the final weights in memory (no checkpoint was written)"
    rank_zero_info(f"test_after_fit: no best checkpoint (no validation, or val/auroc undefined): testing {chosen}")
    return last


def _is_given(value) -> bool:
    return value is not None


def _absolute(path: str | None) -> str | None:
    return str(Path(path).resolve()) if path else None


def main(args: list[str] | None = None, *, run: bool = True) -> VitCTCLI | None:
    """Entry point of ``vit-ct`` and ``python -m vit_ct``; ``run=False`` only parses and instantiates.

    Returns the CLI object when given ``args`` (from Python, where errors are raised as they are), else None: the
    console script exits with the return value, and anything but None would be exit status 1. From the command line
    an error prints its message and where it was raised and exits 1; ``--debug`` or ``VIT_CT_DEBUG=1``: the full
    traceback. SIGTERM and Ctrl-C stop the command with one line and exit status 143 / 130
    (:mod:`vit_ct.run.interrupts`).
    """
    if (sys.argv[1:] if args is None else args)[:1] == ["manifest"]:
        from vit_ct.predict.manifest import main as manifest_main

        manifest_main((sys.argv[1:] if args is None else args)[1:])
        return None
    if args is not None:
        return _cli(args, run)
    if "--debug" in sys.argv[1:]:
        sys.argv.remove("--debug")  # not a LightningCLI option; the variable reaches DDP's other ranks too
        os.environ[DEBUG] = "1"
    stop_on_sigterm()
    try:
        _cli(None, run)
    except (KeyboardInterrupt, SystemExit) as err:
        # Lightning turns an interrupt inside a trainer into SystemExit(1) after its shutdown hooks ran
        signum = received_signal()
        if signum is None and not isinstance(err, KeyboardInterrupt):
            raise
        sys.exit(print_interrupted(signum or signal.SIGINT, sys.argv[1:2]))
    except Exception as err:
        if received_signal() is not None:  # e.g. a DataLoader worker killed by the same SIGTERM
            sys.exit(print_interrupted(received_signal(), sys.argv[1:2]))
        if os.environ.get(DEBUG, "") not in ("", "0"):
            raise
        sys.exit(print_error(err))
    return None


def _cli(args: list[str] | None, run: bool) -> VitCTCLI:
    use_wandb_offline_unless_configured()
    use_threads()  # a run alone: every usable CPU (DDP ranks get their share in instantiate_trainer)
    torch.set_float32_matmul_precision("high")
    try:
        cli = VitCTCLI(
            ViTClassifier,
            SliceDataModule,
            trainer_class=AutoPrecisionTrainer,
            parser_class=CommandParser,
            parser_kwargs={"prog": "vit-ct"},  # also from `python -m vit_ct` and in-process main()
            subclass_mode_data=True,
            save_config_callback=LoggedConfigCallback,
            save_config_kwargs={"overwrite": True, "save_to_log_dir": False},
            seed_everything_default=0,
            auto_configure_optimizers=False,
            trainer_defaults={
                # save_dir None: runs/ or --trainer.default_root_dir (place_wandb_runs)
                "logger": lazy_instance(WandbLogger, project="vit-ct", save_dir=None),
                "callbacks": [
                    RichProgressBar(),
                    EpochLines(),
                    ScanAUROC(),
                    LearningRateMonitor(logging_interval="epoch"),
                    RolloutOverlayCallback(),
                    BadFilesReport(),
                    ResumeState(),
                ],
            },
            args=args,
            run=run,
        )
    except BaseException:
        finish_wandb_run(exit_code=1)
        raise
    if run:
        finish_wandb_run(exit_code=0)
    return cli
