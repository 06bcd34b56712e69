"""``vit-ct manifest SCANS... --output my.csv``: a manifest of every CT slice in a DICOM archive (or NIfTI volumes),
with patient, study, series and position, and the label column left empty for the user to fill in."""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="vit-ct manifest",
        description="Write a manifest CSV of the CT slices under DICOM folders (series, or trees of studies and series)"
        " and NIfTI volumes; slices ordered along each series' normal, labels left empty to fill in.",
    )
    parser.add_argument("scans", nargs="+", help="DICOM folders or files, NIfTI volumes")
    parser.add_argument("--output", required=True, help="manifest CSV to write (image paths relative to its folder)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing manifest (its labels are lost); refused without"
    )
    args = parser.parse_args(argv)
    from vit_ct.data.scans import write_scan_manifest  # here: `vit-ct manifest --help` answers without it
    from vit_ct.run.console import counted

    if Path(args.output).exists() and not args.overwrite:
        parser.exit(2, f"vit-ct manifest: {args.output} exists (labels filled in would be lost); pass --overwrite\n")
    try:
        path, scans, skipped = write_scan_manifest(args.scans, args.output)
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
