"""What ``vit-ct --help`` says: what vit-ct is, every subcommand in one sentence, the options given before a
subcommand. Standard library only: ``vit-ct --help`` answers from here without importing torch or Lightning (which
take seconds: ``benchmarks/records/startup.json``); ``vit-ct SUBCOMMAND --help`` builds the full parser and lists
every option.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Sequence

DESCRIPTION = (
    "vit-ct trains a Vision Transformer (timm, Lightning) to classify CT slices and shows where it looked: "
    "attention-rollout maps on each slice's own pixel grid, scored against lesion masks where there are some. "
    "Runs are tracked with W&B (offline unless you configured it); each fit writes runs/<project>/<run id>/ and "
    "points runs/latest at it."
)
# Each subcommand in one sentence: the overview's list and the first line of `vit-ct SUBCOMMAND --help`.
SUBCOMMANDS = {
    "fit": "Train a model on the configured data (a synthetic set or a manifest CSV), keeping its checkpoints in the "
    "run folder; --test_after_fit tests the weights it keeps on the test split.",
    "validate": "Score a model (--ckpt_path, or weights named in the config) on the validation split: loss, AUROC, "
    "accuracy and the localisation scores of its attention maps.",
    "test": "Score a model (--ckpt_path, or weights named in the config) on the held-out test split, with the same "
    "figures as validate.",
    "predict": "Write P(lesion), an attention-rollout map and an overlay for every slice of a manifest, or of whole "
    "scans (--data.init_args.scans), into a new --output_dir.",
    "manifest": "List the CT slices of DICOM folders or NIfTI volumes in a manifest CSV, its label column left for "
    "you to fill in; --dataset NAME ROOT turns a public head-CT set (CQ500, CT-ICH, INSTANCE, BHSD, RSNA) into a "
    "labelled one.",
    "report": "Write report.html and report.json from a predict output and its labelled manifest: AUROC, sensitivity "
    "and specificity per slice and scan, calibration, map scores and subgroups, each with a bootstrap interval over "
    "patients; --compare NAME=PATH puts another model's predictions beside it.",
    "pacs": "Retrieve a study's CT series from a DICOMweb server (a PACS such as Orthanc), predict on them as whole "
    "scans, store the DICOM objects predict writes back into the study and report what was stored.",
}
CONFIG_HELP = (
    "YAML config file (configs/*.yaml, or a run's config.yaml), usually given after the subcommand; repeat it to "
    "compose configs, later ones winning. Before the subcommand, a config holds one section per subcommand (fit: ...)."
)
PRINT_CONFIG_HELP = "Print the configuration after applying all other arguments, and exit."
DEBUG_HELP = "Print an error's full traceback instead of its one line (also VIT_CT_DEBUG=1)."
EXAMPLES = """\
examples:
  vit-ct fit --config configs/demo.yaml                      train the demo ViT on the built-in synthetic set
  vit-ct fit --config configs/finetune.yaml --data.manifest my.csv
  vit-ct test --config configs/demo.yaml --ckpt_path runs/latest/checkpoints/last.ckpt
  vit-ct predict --config configs/finetune.yaml --ckpt_path CKPT --data.manifest new.csv --output_dir out
  vit-ct manifest DICOM_DIR --output archive.csv
  vit-ct manifest --dataset cq500 CQ500/ --output cq500.csv  a public set, labelled, by name
  vit-ct report out --manifest my.csv                        predict's output with labels: out/report/report.html
  vit-ct pacs http://localhost:8042/dicom-web --study UID --config configs/manifest.yaml --ckpt_path CKPT \
      --output_dir pacs_out                                  a PACS study in, DICOM results stored back
  vit-ct fit --help                                          every option of fit"""
HELP_FLAGS = ("-h", "--help")
CONFIG_FLAGS = ("-c", "--config")


def overview_parser() -> argparse.ArgumentParser:
    """The top-level parser as ``vit-ct --help`` shows it (the real one is the LightningCLI's, with the same text)."""
    parser = argparse.ArgumentParser(
        prog="vit-ct",
        description=textwrap.fill(DESCRIPTION, width=100),
        epilog=EXAMPLES,
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=16),
    )
    parser.add_argument(*CONFIG_FLAGS, metavar="CONFIG", help=CONFIG_HELP)
    parser.add_argument("--print_config", action="store_true", help=PRINT_CONFIG_HELP)
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    commands = parser.add_subparsers(
        title="subcommands", metavar="SUBCOMMAND", description="`vit-ct SUBCOMMAND --help` lists its options."
    )
    for name, sentence in SUBCOMMANDS.items():
        commands.add_parser(name, help=sentence)
    return parser


def overview() -> str:
    return overview_parser().format_help()


def wants_overview(argv: Sequence[str]) -> bool:
    """Whether ``argv`` asks for the top-level help: ``-h``/``--help`` before any subcommand (``vit-ct --help``,
    ``vit-ct --config C --help``). A subcommand's own ``--help`` is its parser's."""
    skip_value = False
    for arg in argv:
        if skip_value:
            skip_value = False
        elif arg in HELP_FLAGS:
            return True
        elif arg in SUBCOMMANDS:
            return False
        elif arg in CONFIG_FLAGS:
            skip_value = True  # the next word is the config's path, whatever it is called
    return False
