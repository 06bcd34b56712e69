"""The LightningCLI behind ``vit-ct fit / validate / test / predict``: each subcommand with its own options, the
data-to-model links, checkpoints on ``val/auroc``, a run summary, and the figures of a run printed once.

Runs go to ``runs/<project>/<run id>/`` (checkpoints, config.yaml, summary.json; :mod:`vit_ct.run.runs`);
``runs/latest`` points at the newest fit that wrote a checkpoint. ``vit_ct/cli.py`` builds it, with the callbacks that
predict writes its outputs with (the ``predict`` room sits above this one).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from jsonargparse import Namespace
from lightning.fabric.plugins.io import CheckpointIO, TorchCheckpointIO
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichModelSummary
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from rich.console import Console
from rich.markup import escape

from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.explain.map_reading import DEFAULT_READING, MapReading
from vit_ct.model.weights_input import is_checkpoint_file, read_lightning_checkpoint
from vit_ct.run.checkpoint import AtomicCheckpointIO, BestAndLastCheckpoint, read_wandb_run_id
from vit_ct.run.checkpoint_input import follow_checkpoint
from vit_ct.run.compat import missing_required, model_summary_depth, subcommand_defaults, summarise_parser_error
from vit_ct.run.console import DEBUG
from vit_ct.run.hardware import accelerator_name, describe_machine, resolve_precision
from vit_ct.run.help import DESCRIPTION, SUBCOMMANDS
from vit_ct.run.model_summary import ModelSummaryTable
from vit_ct.run.options import OWN_OPTIONS, add_own_options, map_reading
from vit_ct.run.runs import BadFilesReport, run_dir, write_summary
from vit_ct.run.summary import checkpoint_label, kept_checkpoint, metric_lines
from vit_ct.run.threads import share_cores_with_children, use_threads
from vit_ct.run.wandb_runs import (
    configured_wandb_loggers,
    drop_unset_anonymous,
    make_wandb_dirs,
    place_wandb_runs,
    wandb_dir,
)
from vit_ct.task.reading import ReadMaps
from vit_ct.task.settings import nested

# predict's writers, given by the command that builds the CLI: (output_dir, overwrite, inputs, dicom_out, *,
# calibration, decision_threshold) -> callbacks
PredictionWriters = Callable[[str, bool, list, bool], list[Callback]]


class CommandParser(LightningArgumentParser):
    """LightningCLI's parser, whose error for a bad option value ends in one line naming the option, the value and
    what was expected, instead of ~100 lines of usage (``--debug`` shows jsonargparse's own report)."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error or os.environ.get(DEBUG, "") not in ("", "0"):
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        said = summarise_parser_error(message)
        if missing := missing_required(message):  # e.g. `predict.output_dir`: named as typed, in its subcommand
            subcommand, _, key = missing[0].partition(".")
            if subcommand not in SUBCOMMANDS:
                subcommand, key = "", missing[0]
            prog = f"{prog} {subcommand}" if subcommand and not prog.endswith(subcommand) else prog
            said = f"--{key} is required" + (": the folder to write the outputs into" if key == "output_dir" else "")
        sys.stderr.write(f"{prog}: error: {said} (`{prog} --help` lists the options)\n")
        sys.exit(2)


class VitCTCLI(LightningCLI):
    """LightningCLI with the data-to-model links, checkpointing on ``val/auroc`` and a run summary.

    Args:
        prediction_writers: the callbacks ``predict`` writes ``--output_dir`` with.
    """

    def __init__(self, *args, prediction_writers: PredictionWriters, **kwargs) -> None:
        self.prediction_writers = prediction_writers
        described = {name: {"description": SUBCOMMANDS[name]} for name in self.subcommands()}
        parser_kwargs = {"description": DESCRIPTION, **described, **kwargs.pop("parser_kwargs", {})}
        super().__init__(*args, parser_kwargs=parser_kwargs, **kwargs)

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        if not add_subcommands:  # `main(args, run=False)`: one parser, which builds but runs nothing
            add_own_options(self.parser, None)

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs) -> LightningArgumentParser:
        """Lightning's parser of one subcommand (the seam where it adds the Trainer method's arguments), plus the
        options that subcommand alone uses."""
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        add_own_options(parser, subcommand)
        return parser

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
        parser.link_arguments("data.init_args.img_size", "model.network.img_size")
        parser.link_arguments(
            "data", "model.network.in_chans", compute_fn=lambda data: data.num_channels, apply_on="instantiate"
        )
        parser.link_arguments(
            "data", "model.network.context_mm", compute_fn=lambda data: data.context_mm, apply_on="instantiate"
        )
        # Multi-label data (`label_columns`) makes a multi-label model with one named output per column. For
        # single-label data `model.labels.num_classes` stays settable; the labels are checked against it before a run.
        parser.link_arguments("data.init_args.label_columns", "model.labels.multilabel", compute_fn=_is_given)
        parser.link_arguments("data.init_args.label_columns", "model.labels.class_names")

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        if self.subcommand:  # (a CLI built to run nothing may leave the data unset)
            _refuse_data_without_slices(config)
        for line in follow_checkpoint(config, command_line=self.command_line):
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
        """The model's settings from ``--ckpt_path``, over the command line's, as Lightning's CLI does, read from
        the checkpoint's flat hyper-parameters into the model's groups; a missing, truncated or foreign file is named
        with what was expected, where torch would raise an error without the file's name."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not is_checkpoint_file(ckpt_path):
            return
        saved = read_lightning_checkpoint(ckpt_path).get("hyper_parameters") or {}  # kept while unchanged: one read
        if model := nested(saved):
            self.config = self.parser.parse_object({subcommand: {"model": model}}, self.config)

    def _predict_without_default_logger(self, config: Namespace) -> None:
        """``predict`` logs nothing (its results are files in ``--output_dir``): the default W&B logger would open an
        empty run, so it is dropped; a logger the user configured stays."""
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
        for logger in configured_wandb_loggers(config):
            if run_id and not logger.init_args.get("id") and not logger.init_args.get("version"):
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
        # Lightning's model summary, without the FLOPs it cannot count for a model without an example input
        trainer.callbacks = [
            ModelSummaryTable(max_depth=model_summary_depth(c)) if type(c) is RichModelSummary else c
            for c in trainer.callbacks
        ]
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                drop_unset_anonymous(logger)
        trainer.callbacks.append(ReadMaps(self._map_reading()))  # how this command's steps read the maps
        return trainer

    def _map_reading(self) -> MapReading:
        """How this subcommand reads the maps (:func:`map_reading`), checked against the model's patches before
        anything runs (a CLI built without a subcommand reads as fit does)."""
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        return map_reading(self.subcommand or "fit", config).check(self.model.hparams.patch_size)

    def _check_data(self, stage: str) -> None:
        """Read and check the manifest (rows, files, labels vs ``num_classes``) before the trainer starts, so bad
        input fails before a W&B run or a checkpoint exists; then the W&B run's folder is made."""
        check = getattr(self.datamodule, "check", None)
        if check is not None:
            check(stage, num_classes=self.model.hparams.num_classes)
        make_wandb_dirs(self.trainer)

    def _refuse_options_of_other_subcommands(self) -> None:
        """Every subcommand accepts ``--output_dir``, ``--overwrite`` and ``--test_after_fit`` (so that configs load
        anywhere), but only one uses each: set elsewhere (``--test_after_fit``: typed on the command line, since
        configs shared by every subcommand set it), it would be silently ignored."""
        config = self.config_init[self.subcommand]
        for name, owner in OWN_OPTIONS.items():
            typed = _typed(self.command_line, name) if name == "test_after_fit" else True
            if owner != self.subcommand and config.get(name) and typed:
                where = ("writes its run to runs/<project>/<run id>/ (runs/latest for the newest fit)"
                         if owner == "predict" else "runs no training to test after")  # fmt: skip
                raise ValueError(
                    f"--{name} is an option of `vit-ct {owner}`, not of `vit-ct {self.subcommand}`, which {where}:"
                    f" drop --{name}"
                )

    def before_fit(self) -> None:
        self._refuse_options_of_other_subcommands()
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
        self._refuse_options_of_other_subcommands()
        self._check_data("validate")

    def before_test(self) -> None:
        self._refuse_options_of_other_subcommands()
        self._check_data("test")

    def after_validate(self) -> None:
        self._print_figures("val")

    def after_test(self) -> None:
        self._print_figures("test")

    def before_predict(self) -> None:
        self._refuse_options_of_other_subcommands()
        config = self.config_init[self.subcommand]
        inputs = [p for p in (config.get("ckpt_path"), getattr(self.datamodule, "manifest", None)) if p]
        # before reading any slice: a non-empty OUT is refused at once
        writers = self.prediction_writers(
            config["output_dir"],
            bool(config.get("overwrite")),
            inputs,
            bool(config.get("dicom_out")),
            calibration=config.get("calibration"),
            decision_threshold=config.get("decision_threshold"),
        )
        self._check_data("predict")
        # predict writes no checkpoints (without the callback, restoring its state cannot warn about its folder),
        # and its skip list goes into OUT, written by the PredictionWriter, not into a run folder
        self.trainer.callbacks = [
            c for c in self.trainer.callbacks if not isinstance(c, ModelCheckpoint | BadFilesReport)
        ]
        self.trainer.callbacks.extend(writers)

    def after_fit(self) -> None:
        if self.test_after_fit:
            checkpoint = self.trainer.checkpoint_callback
            last = getattr(checkpoint, "last_model_path", "")
            read = next(c for c in self.trainer.callbacks if isinstance(c, ReadMaps))
            validated = read.reading  # the test reads the maps as finely as `vit-ct test` does, at least
            read.reading = replace(validated, shifts=max(validated.shifts, DEFAULT_READING["test"].shifts))
            self.trainer.test(
                self.model, datamodule=self.datamodule, ckpt_path=_checkpoint_to_test(checkpoint), verbose=False
            )
            read.reading = validated
            if checkpoint is not None:  # loading "best" put back the callback's state as of that epoch
                checkpoint.last_model_path = last
        self._summarise()

    @rank_zero_only
    def _print_figures(self, stage: str) -> None:
        for line in metric_lines(_scalars(self.trainer.callback_metrics), stage):
            print(line)

    @rank_zero_only
    def _summarise(self) -> None:
        trainer = self.trainer
        folder = run_dir(trainer)
        checkpoint = trainer.checkpoint_callback
        metrics = _scalars(trainer.callback_metrics)
        summary = {
            "run_dir": str(folder.resolve()),  # absolute: the summary is read from other folders too
            "best_checkpoint": _absolute(getattr(checkpoint, "best_model_path", "")),  # the one kept: see below
            "kept_checkpoint": kept_checkpoint(checkpoint),  # final weights, or best by the monitored figure
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
        kept = ("the last epoch's weights, as checkpoint.monitor null asks" if summary["kept_checkpoint"] ==
                "final weights" else f"the epoch of the {summary['kept_checkpoint']}")  # fmt: skip
        kept_file = summary["best_checkpoint"] or "none written: the last checkpoint holds the final weights"
        rows = [(checkpoint_label(summary), kept_file, kept),
                ("last checkpoint", summary["last_checkpoint"], "the latest state, to resume from"),
                ("run folder", str(folder), "config.yaml, summary.json")]  # fmt: skip
        if summary["wandb_dir"]:
            offline = getattr(getattr(trainer.logger, "experiment", None), "offline", False)
            rows.append(("W&B run", summary["wandb_dir"], "offline: `wandb sync` uploads it" if offline else "synced"))
        for label, path, note in rows:  # soft_wrap: a long path stays on one line, whole, for a script to read
            console.print(f"[bold]{label:<16}[/] {escape(str(path))}  ({note})", soft_wrap=True, highlight=False)
        stage = "test" if any(k.startswith("test/") for k in metrics) else "val"
        for line in metric_lines(metrics, stage):
            console.print(line, soft_wrap=True, highlight=False, markup=False)


def _refuse_data_without_slices(config: Namespace) -> None:
    """A manifest data module given neither ``--data.manifest`` nor ``--data.init_args.scans`` fails now, before a
    model is built, instead of after (where the data module would first be asked for its slices)."""
    data = config.get("data")
    class_path = data.get("class_path") if isinstance(data, Namespace) else None
    if not class_path or "." not in class_path:
        return
    module, name = class_path.rsplit(".", 1)
    data_class = getattr(importlib.import_module(module), name, None)
    init_args = data.get("init_args") or Namespace()
    manifest_module = isinstance(data_class, type) and issubclass(data_class, CTSliceDataModule)
    if manifest_module and "manifest" in init_args and init_args.manifest is None and not init_args.get("scans"):
        raise ValueError(  # (the synthetic set has no `manifest`: it writes its own)
            "data.manifest is not set: pass --data.manifest PATH.csv (your slices listed in a CSV; `vit-ct"
            " manifest DICOM_DIR --output PATH.csv` writes one), or --data.init_args.scans [DIR] for whole scans"
        )


def _checkpoint_to_test(checkpoint) -> str | None:
    """``best`` when there is a best checkpoint; else the last checkpoint, or the weights in memory, said in one line
    (without validation, or with ``val/auroc`` never defined, no checkpoint is best)."""
    if checkpoint is not None and checkpoint.best_model_path:
        return "best"
    last = getattr(checkpoint, "last_model_path", "") or None
    chosen = f"the last checkpoint {last}" if last else "the final weights in memory (no checkpoint was written)"
    rank_zero_info(f"test_after_fit: no best checkpoint (no validation, or val/auroc undefined): testing {chosen}")
    return last


def _scalars(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if torch.is_tensor(v) and v.numel() == 1}


def _typed(command_line: Sequence[str], name: str) -> bool:
    return any(arg == f"--{name}" or arg.startswith(f"--{name}=") for arg in command_line)


def _is_given(value) -> bool:
    return value is not None


def _absolute(path: str | None) -> str | None:
    return str(Path(path).resolve()) if path else None
