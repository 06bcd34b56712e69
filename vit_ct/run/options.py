"""The options of one subcommand of ``vit-ct`` (``--test_after_fit``, ``--output_dir``, ...) and the defaults that
differ between subcommands."""

from __future__ import annotations

import argparse

from lightning.pytorch.cli import LightningArgumentParser

from vit_ct.explain.shifted import READ_SHIFTS

# Options of one subcommand. The others accept them too, hidden from their help, so that a config written for every
# subcommand (demo.yaml's `test_after_fit`) or a run's saved config.yaml (`output_dir: null`) still loads anywhere.
OWN_OPTIONS = {
    "test_after_fit": "fit",
    "output_dir": "predict",
    "overwrite": "predict",
    "dicom_out": "predict",
    "calibration": "predict",
}
HELP = {
    "test_after_fit": "Test the weights the fit keeps (see --checkpoint.monitor) on the test split after fitting,"
    " reading the maps as `vit-ct test` does (--model.map_shifts: validation's, or test's default where finer).",
    "output_dir": "Folder to write predictions.csv, the maps and overlays (and scans.csv) into; a folder that is not"
    " empty is refused unless --overwrite true.",
    "overwrite": "Replace a non-empty --output_dir: no file of its old outputs is kept.",
    "dicom_out": "Also write, per scan read from a DICOM series, a Parametric Map of the rollout, a SEG of its"
    " half-maximum region and Secondary Captures of the overlays in the scan's study, under OUT/dicom/<scan>/.",
    "calibration": "A calibration.json written by vit-ct report (the temperature it fitted on validation slices):"
    " predictions.csv then also holds prob_calibrated, P(lesion) after temperature scaling (binary runs).",
}


def add_own_options(parser: LightningArgumentParser, subcommand: str | None) -> None:
    """``--test_after_fit`` (fit), ``--output_dir`` (predict, required) and ``--overwrite`` (predict), each shown
    only in its subcommand's help (``subcommand`` None: the parser of a CLI that runs nothing, which shows all), and
    the defaults that differ by subcommand: how finely test and predict read the maps (``--model.map_shifts``)."""

    def shown(name: str) -> str:
        return HELP[name] if OWN_OPTIONS[name] == subcommand or subcommand is None else argparse.SUPPRESS

    parser.add_argument("--test_after_fit", type=bool, default=False, help=shown("test_after_fit"))
    if subcommand == "predict":
        parser.add_argument("--output_dir", type=str, required=True, help=shown("output_dir"))
    else:
        parser.add_argument("--output_dir", type=str | None, default=None, help=shown("output_dir"))
    parser.add_argument("--overwrite", type=bool, default=False, help=shown("overwrite"))
    parser.add_argument("--dicom_out", type=bool, default=False, help=shown("dicom_out"))
    parser.add_argument("--calibration", type=str | None, default=None, help=shown("calibration"))
    if subcommand in ("validate", "test"):
        parser.set_defaults(verbose=False)  # vit-ct prints the figures itself, once (Lightning's table: --verbose)
    if subcommand in ("test", "predict"):  # maps for a person: finer than a fit's validation reads them
        parser.set_defaults({"model.map_shifts": READ_SHIFTS})
