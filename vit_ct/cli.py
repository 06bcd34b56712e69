"""The ``vit-ct`` command (also ``python -m vit_ct``): ``fit``, ``validate``, ``test`` and ``predict`` through a
LightningCLI (:mod:`vit_ct.run.command`) with W&B tracking and checkpoints, ``manifest``
(:mod:`vit_ct.run.manifest_command`: the slices of DICOM folders and NIfTI volumes, or a public dataset by name),
``report`` (:mod:`vit_ct.report.report_command`: figures with intervals from a predict output) and ``pacs``
(:mod:`vit_ct.pacs.pacs_command`: a study from a DICOMweb server through predict, its DICOM objects stored back).

``vit-ct --help`` and ``vit-ct manifest|report|pacs --help`` answer without importing torch, Lightning or timm (they
are imported once a subcommand needs them). An error prints its message and where it was raised, and
exits 1; ``--debug`` (or ``VIT_CT_DEBUG=1``) prints the full traceback instead.
"""

from __future__ import annotations

import os
import signal
import sys

from vit_ct.run.console import DEBUG, print_error, print_interrupted
from vit_ct.run.help import SUBCOMMANDS, overview, overview_parser, wants_overview
from vit_ct.run.interrupts import received_signal, stop_on_signals


def __getattr__(name: str):
    """``VitCTCLI``, the LightningCLI, imported when asked for (PEP 562): it imports torch and Lightning."""
    if name == "VitCTCLI":
        from vit_ct.run.command import VitCTCLI

        return VitCTCLI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(args: list[str] | None = None, *, run: bool = True):
    """Entry point of ``vit-ct`` and ``python -m vit_ct``; ``run=False`` only parses and instantiates.

    Returns the CLI object when given ``args`` (from Python, where errors are raised as they are), else None: the
    console script exits with the return value, and anything but None would be exit status 1. From the command line
    an error prints its message and where it was raised and exits 1; ``--debug`` or ``VIT_CT_DEBUG=1``: the full
    traceback. SIGTERM and Ctrl-C stop the command with one line and exit status 143 / 130
    (:mod:`vit_ct.run.interrupts`).
    """
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["manifest"]:
        from vit_ct.run.manifest_command import main as manifest_main

        manifest_main(argv[1:])
        return None
    if argv[:1] == ["report"]:
        from vit_ct.report.report_command import main as report_main

        report_main(argv[1:])
        return None
    if argv[:1] == ["pacs"]:
        from vit_ct.pacs.pacs_command import main as pacs_main

        pacs_main(argv[1:])
        return None
    if wants_overview(argv):
        print(overview(), end="")
        sys.exit(0)
    if not argv:
        overview_parser().error(f"choose a subcommand: {', '.join(SUBCOMMANDS)} (`vit-ct --help` says what each does)")
    if args is not None:
        return _cli(args, run)
    if "--debug" in sys.argv[1:]:
        sys.argv.remove("--debug")  # not a LightningCLI option; the variable reaches DDP's other ranks too
        os.environ[DEBUG] = "1"
    stop_on_signals()
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


def _cli(args: list[str] | None, run: bool):
    """The LightningCLI with vit-ct's callbacks, run (or, ``run=False``, only built) on ``args``."""
    import torch
    from jsonargparse import lazy_instance
    from lightning.pytorch.loggers import WandbLogger

    from vit_ct.data.loading.slice_module import SliceDataModule
    from vit_ct.run.allocator import keep_freed_memory
    from vit_ct.run.checkpoint import ResumeState
    from vit_ct.run.command import CommandParser, VitCTCLI
    from vit_ct.run.console import quiet_lightning
    from vit_ct.run.epoch_progress import EpochLines, progress_bar
    from vit_ct.run.learning_rate import PeakLearningRate
    from vit_ct.run.runs import BadFilesReport, LoggedConfigCallback
    from vit_ct.run.scan_auroc import ScanAUROC
    from vit_ct.run.threads import use_threads
    from vit_ct.run.trainer import Trainer
    from vit_ct.run.wandb_media import RolloutOverlayCallback
    from vit_ct.run.wandb_runs import (
        finish_wandb_run,
        quiet_wandb_unless_configured,
        use_wandb_offline_unless_configured,
    )
    from vit_ct.task import ViTClassifier

    quiet_lightning()
    use_wandb_offline_unless_configured()
    quiet_wandb_unless_configured()
    use_threads()  # a run alone: every usable CPU (DDP ranks get their share in instantiate_trainer)
    keep_freed_memory()  # freed blocks stay for the next step instead of being faulted in again (glibc)
    torch.set_float32_matmul_precision("high")
    try:
        cli = VitCTCLI(
            ViTClassifier,
            SliceDataModule,
            prediction_writers=_prediction_writers,
            trainer_class=Trainer,
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
                    progress_bar(),
                    EpochLines(),
                    ScanAUROC(),
                    PeakLearningRate(),
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


def _prediction_writers(
    output_dir: str,
    overwrite: bool,
    inputs: list,
    dicom_out: bool = False,
    *,
    calibration: str | None = None,
    decision_threshold: float | None = None,
) -> list:
    """What ``predict`` writes ``output_dir`` with: ``predictions.csv``, maps and overlays, then per scan
    ``scans.csv`` and NIfTI volumes (it reads the first one's ``predictions.csv``), and with ``dicom_out`` the DICOM
    objects of each DICOM scan (they read both; the SR's decision at ``decision_threshold``, None: 0.5). A non-empty
    ``output_dir`` is refused here, before any slice is read, unless ``overwrite``; so is a ``calibration`` file that
    holds no temperature, and a ``decision_threshold`` outside [0, 1] or without ``dicom_out``."""
    if decision_threshold is not None and not 0.0 <= decision_threshold <= 1.0:  # (NaN too)
        raise ValueError(f"--decision_threshold {decision_threshold}: expected a probability between 0 and 1")
    if decision_threshold is not None and not dicom_out:
        raise ValueError("--decision_threshold is where --dicom_out's Structured Report calls a finding present:"
                         " add --dicom_out true, or drop --decision_threshold")  # fmt: skip
    from vit_ct.predict.scan_writer import ScanResultsWriter
    from vit_ct.predict.writer import PredictionWriter

    writer = PredictionWriter(output_dir, overwrite=overwrite, inputs=inputs, calibration=calibration)
    writers = [writer, ScanResultsWriter(writer)]
    if dicom_out:
        from vit_ct.predict.dicom_scan import THRESHOLD, DicomObjectsWriter

        threshold = THRESHOLD if decision_threshold is None else decision_threshold
        writers.append(DicomObjectsWriter(writer, threshold=threshold))
    return writers
