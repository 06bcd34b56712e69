"""The options of one subcommand of ``vit-ct`` (``--test_after_fit``, ``--output_dir``, ...) and the defaults that
differ between subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from lightning.pytorch.cli import LightningArgumentParser

from vit_ct.explain.map_reading import DEFAULT_READING, MapReading

# Options of one subcommand. The others accept them too, hidden from their help, so that a config written for every
# subcommand (demo.yaml's `test_after_fit`) or a run's saved config.yaml (`output_dir: null`) still loads anywhere.
OWN_OPTIONS = {
    "test_after_fit": "fit",
    "output_dir": "predict",
    "overwrite": "predict",
    "dicom_out": "predict",
    "decision_threshold": "predict",
    "calibration": "predict",
}
HELP = {
    "test_after_fit": "Test the weights the fit keeps (see --checkpoint.monitor) on the test split after fitting,"
    " reading the maps as `vit-ct test` does (--map_shifts: validation's, or test's default where finer).",
    "output_dir": "Folder to write predictions.csv, the maps and overlays (and scans.csv) into; a folder that is not"
    " empty is refused unless --overwrite true.",
    "overwrite": "Replace a non-empty --output_dir: no file of its old outputs is kept.",
    "dicom_out": "Also write, per scan read from a DICOM series, a Parametric Map of the rollout, a SEG of its"
    " half-maximum region, Secondary Captures of the overlays and a Structured Report (TID 1500) of the finding in the"
    " scan's study, under OUT/dicom/<scan>/.",
    "decision_threshold": "With --dicom_out: the scan's probability at or above which the Structured Report calls"
    " intracranial haemorrhage (and each subtype) present, between 0 and 1 (default 0.5); e.g. a threshold_at_spec*"
    " of the report.json that vit-ct report wrote on validation scans.",
    "map_shifts": "Read the rollout on a grid this many times finer than the patches, from map_shifts**2 passes over"
    " the slice shifted by patch_size / map_shifts pixels (their mean probability: prob_tta); 1: one pass. Default:"
    " 1 for fit and validate, 2 for test and predict.",
    "map_pixels": "Spread each cell of the rollout over its pixels by the gradient x input through the stem (one"
    " backward pass per pass).",
    "calibration": "A calibration.json written by vit-ct report (the temperature it fitted on validation slices):"
    " predictions.csv then also holds prob_calibrated, P(lesion) after temperature scaling (binary runs).",
}


def add_own_options(parser: LightningArgumentParser, subcommand: str | None) -> None:
    """``--test_after_fit`` (fit), ``--output_dir`` (predict, required) and ``--overwrite`` (predict), each shown
    only in its subcommand's help (``subcommand`` None: the parser of a CLI that runs nothing, which shows all), and
    the defaults that differ by subcommand; and how the maps are read (``--map_shifts``, ``--map_pixels``: every
    subcommand that runs the model reads maps, each with its default,
    :data:`vit_ct.explain.map_reading.DEFAULT_READING`)."""

    def shown(name: str) -> str:
        return HELP[name] if OWN_OPTIONS[name] == subcommand or subcommand is None else argparse.SUPPRESS

    parser.add_argument("--test_after_fit", type=bool, default=False, help=shown("test_after_fit"))
    if subcommand == "predict":
        parser.add_argument("--output_dir", type=str, required=True, help=shown("output_dir"))
    else:
        parser.add_argument("--output_dir", type=str | None, default=None, help=shown("output_dir"))
    parser.add_argument("--overwrite", type=bool, default=False, help=shown("overwrite"))
    parser.add_argument("--dicom_out", type=bool, default=False, help=shown("dicom_out"))
    parser.add_argument("--decision_threshold", type=float | None, default=None, help=shown("decision_threshold"))
    parser.add_argument("--calibration", type=str | None, default=None, help=shown("calibration"))
    parser.add_argument("--map_shifts", type=int | None, default=None, help=HELP["map_shifts"])
    parser.add_argument("--map_pixels", type=bool, default=False, help=HELP["map_pixels"])
    if subcommand in ("validate", "test"):
        parser.set_defaults(verbose=False)  # vit-ct prints the figures itself, once (Lightning's table: --verbose)


def map_reading(subcommand: str, config: Mapping) -> MapReading:
    """How ``subcommand`` reads the maps from its parsed ``config``: ``--map_shifts`` (None: the subcommand's default,
    :data:`~vit_ct.explain.map_reading.DEFAULT_READING`) and ``--map_pixels``."""
    shifts = config.get("map_shifts")
    default = DEFAULT_READING[subcommand]
    return MapReading(shifts=default.shifts if shifts is None else shifts, pixels=bool(config.get("map_pixels")))
