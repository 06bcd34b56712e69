"""The ``vit-ct`` command: a LightningCLI (fit / validate / test / predict) with W&B tracking and checkpoints.

Runs go to ``runs/<project>/<run id>/`` (checkpoints, config.yaml, summary.json; :mod:`vit_ct.runs`); ``runs/latest``
points at the newest fit that wrote a checkpoint. An error prints its message and where it was raised, and exits 1;
``--debug`` (or ``VIT_CT_DEBUG=1``) prints the full traceback instead.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path

import torch
import yaml
from jsonargparse import Namespace, lazy_instance
from lightning.fabric.plugins.io import CheckpointIO, TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from rich.console import Console

from vit_ct.callbacks import BadFilesReport, RolloutOverlayCallback
from vit_ct.checkpoint import (
    AtomicCheckpointIO,
    BestAndLastCheckpoint,
    ResumeState,
    read_checkpoint,
    read_wandb_run_id,
)
from vit_ct.checkpoint_input import SPECIAL_CKPT_PATHS, follow_checkpoint
from vit_ct.compat import subcommand_defaults, summarise_parser_error, wandb_init_arguments
from vit_ct.data.datamodule import CTSliceDataModule
from vit_ct.hardware import accelerator_name, describe_machine, resolve_precision, use_usable_cpus
from vit_ct.interrupts import EXIT_STATUS, received_signal, stop_on_sigterm
from vit_ct.model import ViTClassifier
from vit_ct.progress import EpochLines
from vit_ct.runs import remove_run_without_checkpoint, run_dir, write_summary
from vit_ct.scan_metrics import ScanAUROC
from vit_ct.trainer import Trainer as AutoPrecisionTrainer


class _NoNoise(logging.Filter):
    """Lines of Lightning's that say nothing a user can act on: a tip to install its own cloud logger (on every run
    without it) and, when SIGTERM stopped the command, that a "KeyboardInterrupt" was detected (vit-ct's own line
    says what happened)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "litlogger" in message:
            return False
        return not (received_signal() is not None and ("KeyboardInterrupt" in message or "SIGTERM" in message))


for _name in ("lightning.pytorch.utilities.rank_zero", "lightning.pytorch.trainer.connectors.signal_connector"):
    logging.getLogger(_name).addFilter(_NoNoise())
# Lightning's own pytree helper uses a torch API that torch >= 2.10 deprecates, on every predict and test
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
# predict runs without the checkpoint's ModelCheckpoint on purpose (it writes no checkpoints)
warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`, callbacks used to create")


def use_wandb_offline_unless_configured() -> None:
    """Keep W&B offline unless the user set ``WANDB_MODE``, ``WANDB_API_KEY`` or logged in (``~/.netrc``)."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return
    os.environ["WANDB_MODE"] = "offline"


DEBUG = "VIT_CT_DEBUG"  # set (or `--debug`): errors print their full traceback


class LoggedConfigCallback(SaveConfigCallback):
    """Writes the full CLI config into the run folder and sends it to the logger (W&B), on rank 0 only. If the run
    fails before it wrote a checkpoint, the folder it made (holding only that config) is removed again."""

    created: Path | None = None  # the run folder, when this callback made it

    def save_config(self, trainer: Trainer, pl_module, stage: str) -> None:
        if stage == "predict" and trainer.logger is None:  # no run folder: the outputs are in --output_dir
            return
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


class CommandParser(LightningArgumentParser):
    """LightningCLI's parser, whose error for a bad option value ends in one line naming the option, the value and
    what was expected, instead of ~100 lines of usage (``--debug`` shows jsonargparse's own report)."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error or os.environ.get(DEBUG, "") not in ("", "0"):
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"{prog}: error: {summarise_parser_error(message)} (`{prog} --help` lists the options)\n")
        sys.exit(2)


class VitCTCLI(LightningCLI):
    """LightningCLI with the data-to-model links, checkpointing on ``val/auroc`` and a run summary."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(BestAndLastCheckpoint, "checkpoint")
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
        # Atomic, weights-only checkpoint files, unless the user chose a CheckpointIO (--trainer.plugins).
        plugins = self._get(self.config_init, "trainer", default={}).get("plugins") or []
        chosen = any(isinstance(p, CheckpointIO) for p in (plugins if isinstance(plugins, list) else [plugins]))
        if not chosen and type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if not trainer.loggers:  # `--trainer.logger false`: the LR monitor would refuse to start
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, LearningRateMonitor)]
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                _drop_unset_anonymous(logger)
        return trainer

    def _check_data(self, stage: str) -> None:
        """Read and check the manifest (rows, files, labels vs ``num_classes``) before the trainer starts, so bad
        input fails before a W&B run or a checkpoint exists."""
        check = getattr(self.datamodule, "check", None)
        if check is not None:
            check(stage, num_classes=self.model.hparams.get("num_classes"))

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
        from vit_ct.prediction import PredictionWriter
        from vit_ct.scan_results import ScanResultsWriter

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
            "wandb_dir": _wandb_dir(trainer),
            "machine": describe_machine(),
            "precision": str(trainer.precision),
            "localisation_tolerance_mm": self.model.hparams.get("localisation_tolerance_mm"),
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


def _drop_unset_anonymous(logger: WandbLogger) -> None:
    """Lightning's WandbLogger always passes ``anonymous`` to ``wandb.init`` (None when unset), and W&B (>= 0.19)
    warns about the deprecated setting whenever it is passed at all; leave it out unless the user set it."""
    arguments = wandb_init_arguments(logger)
    if arguments.get("anonymous", "set") is None:
        del arguments["anonymous"]


def place_wandb_runs(config: Namespace) -> None:
    """A W&B logger without ``save_dir`` saves its run (and Lightning the checkpoints) under
    ``--trainer.default_root_dir``, else under ``runs/``; an explicit ``save_dir`` (or ``dir``) wins."""
    loggers = config.trainer.logger if isinstance(config.trainer.logger, list) else [config.trainer.logger]
    for logger in loggers:
        is_wandb = isinstance(logger, Namespace) and str(logger.get("class_path", "")).endswith("WandbLogger")
        if is_wandb and logger.init_args.get("save_dir") is None and logger.init_args.get("dir") is None:
            # absolute: W&B writes its files from another thread, which must not follow a later change of directory
            logger.init_args.save_dir = os.path.abspath(config.trainer.get("default_root_dir") or "runs")


def _is_given(value) -> bool:
    return value is not None


def _absolute(path: str | None) -> str | None:
    return str(Path(path).resolve()) if path else None


def _wandb_dir(trainer: Trainer) -> str | None:
    logger = trainer.logger
    if isinstance(logger, WandbLogger):
        run = logger.experiment
        return getattr(run, "dir", None) and str(Path(run.dir).parent.resolve())
    return None


def main(args: list[str] | None = None, *, run: bool = True) -> VitCTCLI | None:
    """Entry point of ``vit-ct`` and ``python -m vit_ct``; ``run=False`` only parses and instantiates.

    Returns the CLI object when given ``args`` (from Python, where errors are raised as they are), else None: the
    console script exits with the return value, and anything but None would be exit status 1. From the command line
    an error prints its message and where it was raised and exits 1; ``--debug`` or ``VIT_CT_DEBUG=1``: the full
    traceback. SIGTERM and Ctrl-C stop the command with one line and exit status 143 / 130 (:mod:`vit_ct.interrupts`).
    """
    if (sys.argv[1:] if args is None else args)[:1] == ["manifest"]:
        from vit_ct.scan_manifest import main as manifest_main

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
        sys.exit(_print_interrupted(signum or signal.SIGINT, sys.argv[1:2]))
    except Exception as err:
        if received_signal() is not None:  # e.g. a DataLoader worker killed by the same SIGTERM
            sys.exit(_print_interrupted(received_signal(), sys.argv[1:2]))
        if os.environ.get(DEBUG, "") not in ("", "0"):
            raise
        sys.exit(_print_error(err))
    return None


def _print_interrupted(signum: signal.Signals, subcommand: list[str]) -> int:
    """One line saying what an interrupted command left; returns the exit status (128 + the signal)."""
    left = {
        "fit": "the checkpoints written so far are kept (resume with --ckpt_path RUN/checkpoints/last.ckpt)",
        "predict": "--output_dir is as it was before this run",
    }.get(subcommand[0] if subcommand else "", "nothing half-written is left")
    name = "Ctrl-C" if signum == signal.SIGINT else signum.name
    print(f"vit-ct: interrupted ({name}): {left}", file=sys.stderr)
    return EXIT_STATUS.get(signum, 1)


def _print_error(err: Exception) -> int:
    """The error's message and the line that raised it, on stderr; returns the exit status."""
    err = _innermost(err)
    frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    where = f" at {frame.filename}:{frame.lineno}" if frame else ""
    kind = "" if isinstance(err, ValueError) else f"{type(err).__name__}: "  # a ValueError's message names the input
    print(f"vit-ct: error: {kind}{err}", file=sys.stderr)
    print(f"  ({type(err).__name__}{where}; the full traceback: rerun with --debug or {DEBUG}=1)", file=sys.stderr)
    return 1


def _innermost(err: BaseException) -> BaseException:
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


def _cli(args: list[str] | None, run: bool) -> VitCTCLI:
    use_wandb_offline_unless_configured()
    use_usable_cpus()
    torch.set_float32_matmul_precision("high")
    try:
        cli = VitCTCLI(
            ViTClassifier,
            CTSliceDataModule,
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
        _finish_wandb_run(exit_code=1)
        raise
    if run:
        _finish_wandb_run(exit_code=0)
    return cli


def _finish_wandb_run(exit_code: int) -> None:
    """A command's W&B run ends with the command. Otherwise the next ``main()`` in the same Python process (a notebook,
    a script running several commands) would log into it: Lightning's WandbLogger reuses an active run."""
    import wandb

    if wandb.run is not None:
        wandb.finish(exit_code=exit_code)
