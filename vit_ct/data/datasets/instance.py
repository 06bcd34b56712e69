"""INSTANCE 2022 (the MICCAI 2022 Intracranial Hemorrhage Segmentation Challenge on Non-Contrast head CT, Li et al.,
arXiv:2301.03281): 100 training head CT volumes (NIfTI) with voxel masks of the bleed, as a vit-ct manifest with
slice labels read from the masks and the masks themselves.

Layout (github.com/PerceptionComputingLab/INSTANCE2022; the training folders as the participants' code reads them,
e.g. ``Challenge result/codes/T8/models/pytorch/dataset.py`` there: ``train_2/data/{id}`` and ``train_2/label/{id}``;
Project-MONAI/tutorials ``auto3dseg/tasks/instance22/instance22_folds.json``: ``train/data/095.nii.gz``,
``train/label/095.nii.gz``):

- ``data/NNN.nii.gz`` (001..100): the CT, 512 x 512 x N with N in 20..70, voxels 0.42 x 0.42 x 5 mm (MONAI's task
  README), non-contrast, in Hounsfield units (the teams clip the raw values to 0..80 HU or threshold bone at 100).
- ``label/NNN.nii.gz``: same name, same shape and affine (T8's loader asserts both); 0 = background, 1 = bleed (the
  MONAI task README). No subtypes: every case is a bleed of some kind, so the manifest has ``label`` but no subtype
  columns.
- ``evaluation/`` (the 30 validation cases) has no labels and is not read; the 70 test cases were never released.

Rules: ``label`` = 1 on a slice with a bleed voxel; ``mask`` names ``label/NNN.nii.gz`` itself (binary, on the CT's
affine), else a binary copy on the CT's grid is written beside the manifest; ``mask_pixels`` counts the slice's bleed
voxels. Scans and patients are ``INSTANCE-NNN``.

Licence: no open licence. The INSTANCE 2022 rule agreement (``Agreements/instance2022_agreements.pdf`` in the
repository above): data for the registered participant's own use, "redistribution or transfer of data or data link
is not allowed"; access is requested through instance.grand-challenge.org.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from vit_ct.data.datasets.output import DatasetOutput
from vit_ct.data.datasets.volumes import (
    Converted,
    add_scan_labels,
    check_choice,
    complete_volumes,
    count_note,
    dataset_folder,
    labelled_rows,
    left_out_note,
    pair_volumes,
)
from vit_ct.files import safe_name
from vit_ct.progress import track

LAYOUT = "data/NNN.nii.gz and label/NNN.nii.gz"


def convert(
    root: Path, out: DatasetOutput, *, on_missing: str = "raise", scan_labels: bool = False, progress: bool = True
) -> Converted:
    """INSTANCE 2022's training set as a manifest (see the module).

    Args:
        root: the folder holding data/ and label/ (or the folder above it, e.g. the one holding train_2/).
        out: where the manifest and any rewritten masks go.
        on_missing: "raise" when a CT has no label volume or a label volume no CT, or either one's voxel data is
            incomplete (a truncated copy), "skip" to leave it out (noted; incomplete ones also listed beside the
            manifest).
        scan_labels: also write ``scan_label`` (a bleed on any slice of the scan).
        progress: show a progress bar.
    """
    check_choice(on_missing, "on_missing", ("raise", "skip"))
    root = dataset_folder(root, ("data", "label"), "INSTANCE 2022", LAYOUT)
    notes: list[str] = []
    pairs = pair_volumes(root / "data", root / "label", on_missing=on_missing, what="INSTANCE 2022", notes=notes)
    tables, rewritten, left_out = [], [], []
    for pair in track(pairs, "INSTANCE volumes", disable=not progress):
        if not complete_volumes((pair.image, pair.labels), on_missing=on_missing, what="INSTANCE 2022",
                                left_out=left_out):  # fmt: skip
            continue
        scan_id = safe_name(f"INSTANCE-{pair.stem}")
        volume = labelled_rows(pair, out, scan_id=scan_id, patient_id=scan_id, classes=None, what="INSTANCE 2022")
        if volume.mask.rewritten:
            rewritten.append(f"{pair.labels.name} ({volume.mask.rewritten})")
        tables.append(volume.table)
    if not tables:
        raise ValueError(f"INSTANCE 2022: no CT volume in {root / 'data'} is complete with its label volume")
    table = pd.concat(tables, ignore_index=True)
    if scan_labels:
        table = add_scan_labels(table)
    shown = ", ".join(rewritten[:5])
    notes += count_note(len(rewritten), f"mask(s) written again as binary volumes on their CT's grid: {shown}")
    notes += left_out_note(left_out, out)
    return Converted(table, notes)
