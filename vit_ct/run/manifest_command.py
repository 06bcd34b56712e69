"""``vit-ct manifest``: a manifest CSV of CT slices, in two forms.

- ``vit-ct manifest SCANS... --output my.csv``: every CT slice of a DICOM archive (or NIfTI volumes), with patient,
  study, series and position, and the label column left empty for the user to fill in.
- ``vit-ct manifest --dataset NAME ROOT --output my.csv``: a public head-CT dataset's folder, as it is distributed,
  turned into a labelled manifest (:mod:`vit_ct.data.datasets`).

Standard library only until the arguments are checked: ``vit-ct manifest --help`` answers without pandas or torch.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import NoReturn

# The public datasets --dataset takes and their other names, as --help lists them without importing the converters
# (vit_ct.data.datasets.DATASETS and ALIASES are the truth; tests/test_manifest_datasets_cli.py checks this copy).
DATASET_NAMES = {"cq500": (), "ctich": ("ct-ich", "physionet"), "instance": ("instance2022",), "bhsd": (),
                 "rsna": ("rsna2019",)}  # fmt: skip
# The converters' keyword options as flags: option -> (the datasets that take it, argparse settings). A flag left out
# is not passed, so the converter's signature holds the only default; the help restates it (checked by the tests).
DATASET_OPTIONS = {
    "on_missing": (("cq500", "ctich", "instance", "bhsd"), {
        "choices": ("raise", "skip"), "help": "skip a case whose files are missing (or, of a NIfTI set, truncated),"
                                              " noting it, instead of stopping (default raise; cq500: skip, listing"
                                              " the studies its Kaggle mirror lacks in M.left_out.csv)"}),
    "scan_labels": (("ctich", "instance", "bhsd"), {
        "action": "store_true", "help": "add scan_label and scan_<subtype>: a bleed on any slice of the scan"}),
    "min_thickness_mm": (("cq500",), {
        "type": float, "metavar": "MM", "help": "the thinnest slices preferred when choosing each study's series"
                                                " (default 2.5)"}),
    "labels_csv": (("rsna",), {
        "metavar": "CSV", "help": "the labels file in ROOT (default stage_2_train.csv; stage 1: stage_1_train.csv)"}),
    "images": (("rsna",), {"metavar": "FOLDER", "help": "the folder of the labelled slices in ROOT"
                                                         " (default stage_2_train)"}),
    "workers": (("rsna",), {"type": int, "metavar": "N", "help": "threads reading DICOM headers (default 8)"}),
}  # fmt: skip
USAGE = """\
vit-ct manifest SCANS... --output M.csv [--overwrite]
       vit-ct manifest --dataset NAME ROOT --output M.csv [--overwrite] [--on_missing {raise,skip}] [--scan_labels]
                       [--min_thickness_mm MM] [--labels_csv CSV] [--images FOLDER] [--workers N]"""


def manifest_parser() -> argparse.ArgumentParser:
    """The parser of both forms: SCANS are DICOM folders and NIfTI volumes, or with ``--dataset`` one ROOT folder."""
    names = ", ".join(f"{n} ({', '.join(a)})" if a else n for n, a in DATASET_NAMES.items())
    parser = argparse.ArgumentParser(
        prog="vit-ct manifest",
        usage=USAGE,
        description="Write a manifest CSV of the CT slices under DICOM folders (series, or trees of studies and series)"
        " and NIfTI volumes; slices ordered along each series' normal, labels left empty to fill in. With --dataset,"
        " a public head-CT dataset's folder as it is distributed becomes a labelled manifest instead.",
    )
    parser.add_argument("scans", nargs="+", metavar="SCANS", help="DICOM folders or files, NIfTI volumes; with"
                        " --dataset: ROOT, the dataset's folder (or the folder holding it)")  # fmt: skip
    parser.add_argument("--output", required=True, help="manifest CSV to write (image paths relative to its folder)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing manifest (its labels are lost; with --dataset"
        " its mask folder and side tables too); refused without"
    )  # fmt: skip
    public = parser.add_argument_group(
        "public datasets", f"--dataset NAME ROOT; NAME is one of {names}. Check each dataset's licence before you use"
        " it (printed with the summary). The options below are each taken by the datasets they name.",
    )  # fmt: skip
    public.add_argument("--dataset", metavar="NAME", help="read ROOT as this public dataset")
    for option, (datasets, settings) in DATASET_OPTIONS.items():
        settings = {**settings, "help": f"{', '.join(datasets)}: {settings['help']}"}
        public.add_argument(f"--{option}", default=argparse.SUPPRESS, **settings)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = manifest_parser()
    args = parser.parse_args(argv)
    options = {k: vars(args)[k] for k in DATASET_OPTIONS if k in vars(args)}  # the flags given (left out: SUPPRESS)
    if args.dataset is not None:
        write_public_dataset(parser, args.dataset, args.scans, args.output, args.overwrite, options)
        return
    if options:
        flags = ", ".join(f"--{k}" for k in options)
        kind = "is an option" if len(options) == 1 else "are options"
        parser.exit(2, f"vit-ct manifest: {flags} {kind} of the --dataset NAME ROOT form; without --dataset, SCANS"
                    " are DICOM folders and NIfTI volumes\n")  # fmt: skip
    write_scans(parser, args.scans, args.output, args.overwrite)


def write_scans(parser: argparse.ArgumentParser, scans: list[str], output: str, overwrite: bool) -> None:
    """The manifest of the CT slices under DICOM folders and NIfTI volumes, its labels left empty."""
    from vit_ct.data.io.scans import write_scan_manifest  # here: `vit-ct manifest --help` answers without it
    from vit_ct.data.manifests.manifest import check_replaceable_manifest
    from vit_ct.run.console import counted

    if Path(output).exists() and not overwrite:
        parser.exit(2, f"vit-ct manifest: {output} exists (labels filled in would be lost); pass --overwrite\n")
    try:
        check_replaceable_manifest(output)
        path, scans, skipped = write_scan_manifest(scans, output)
    except ValueError as err:  # a missing path, or no CT at all: the message names them
        parser.exit(2, f"vit-ct manifest: {err}\n")
    slices = sum(len(s.images) for s in scans)
    print(f"{path}: {counted(slices, 'slice')} of {counted(len(scans), 'scan')}; fill in the label column (0 = no"
          " lesion) to train on it")  # fmt: skip
    for scan in scans:
        notes = f"  ({'; '.join(scan.notes)})" if scan.notes else ""
        print(f"  {scan.scan_id}: {counted(len(scan.images), 'slice')}, {scan.description or scan.source}{notes}")
    if skipped:
        listed = path.with_name(path.stem + ".skipped.csv")
        print(f"{counted(len(skipped), 'file')} skipped (not CT slices), listed in {listed}:")
        for s in skipped[:20]:
            print(f"  {s.path}: {s.reason}")
        if len(skipped) > 20:
            print(f"  ... and {len(skipped) - 20} more")


def write_public_dataset(
    parser: argparse.ArgumentParser, name: str, roots: list[str], output: str, overwrite: bool, options: dict
) -> None:
    """The labelled manifest of a public dataset's folder (:func:`vit_ct.data.datasets.write_dataset_manifest`);
    prints its summary, the files beside it and the converter's notes on the data."""

    def refuse(message: str) -> NoReturn:
        parser.exit(2, f"vit-ct manifest: {message}\n")

    if len(roots) != 1:
        refuse(f"--dataset {name} takes one ROOT folder, got {len(roots)}: {' '.join(roots)}")
    root = Path(roots[0])
    if root.is_file():
        refuse(f"ROOT {root} is a file; expected the dataset's folder (unpack an archive first)")
    from vit_ct.data.datasets import ALIASES, DATASETS, dataset_info, write_dataset_manifest  # pandas, pydicom, torch
    from vit_ct.run.console import print_interrupted
    from vit_ct.run.interrupts import received_signal, stop_on_signals

    try:
        info = dataset_info(name)
    except ValueError:
        refuse(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)} (or {', '.join(ALIASES)})")
    for option in options:
        if option not in info.options():
            takers = [n for n, other in DATASETS.items() if option in other.options()]
            own = ", ".join(f"--{o}" for o in info.options()) or "none"
            refuse(f"--{option} is not an option of {info.name} (only of {', '.join(takers)}); {info.name}'s: {own}")
    progress = sys.stdout.isatty()  # bars in a terminal; into a file or a pipe no bar frames, only the lines below
    stop_on_signals()  # SIGTERM like Ctrl-C: the half-written masks are removed, an earlier manifest stays
    try:
        written = write_dataset_manifest(info.name, root, output, overwrite=overwrite, progress=progress, **options)
    except (ValueError, OSError) as err:  # a folder without the expected files, an output that exists: named
        refuse(str(err))
    except KeyboardInterrupt:
        sys.exit(print_interrupted(received_signal() or signal.SIGINT, ["manifest"]))
    print(written.summary())
    for path in written.files[1:]:
        print(f"  and {path}{'/' if path.is_dir() else ''}")
    if written.notes:
        print("notes on the data:")
        for note in written.notes:
            print(f"  {note}")
