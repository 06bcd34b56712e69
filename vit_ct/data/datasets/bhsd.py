"""BHSD (Wu et al., "BHSD: A 3D Multi-class Brain Hemorrhage Segmentation Dataset", MLMI 2023, arXiv:2308.11298):
192 head CT volumes (NIfTI) with voxel masks of five bleed types, as a vit-ct manifest with slice labels and subtypes
read from the masks, and binary masks.

Layout (github.com/White65534/BHSD: README and ``dataset.json``; the archive ``label_192.zip`` on
huggingface.co/datasets/WuBiao/BHSD as torch_em reads it, ``torch_em/data/datasets/medical/mbh_seg.py``):

- ``label_192/images/NAME.nii.gz`` and ``label_192/ground truths/NAME.nii.gz`` (same name, same voxels). The
  repository's ``dataset.json`` describes the paper's split as ``imagesTr/``, ``labelsTr/`` (96) and ``imagesTs/``,
  ``labelsTs/`` (96); that layout is read too, and the folder goes to ``official_split`` (train / test); an
  ``imagesTs/`` without ``labelsTs/`` (test images released unlabelled) is left out with a note, never silently.
- Label values (``dataset.json``): 0 background, 1 epidural, 2 intraparenchymal, 3 intraventricular,
  4 subarachnoid, 5 subdural.
- NAME is ``ID_<8 hex>_ID_<10 hex>``: the volumes were rebuilt from RSNA 2019 DICOM; the two parts are RSNA's
  PatientID and StudyInstanceUID, written here as ``patient_id`` and ``study_uid``, so a split by patient keeps BHSD
  apart from the same patients' RSNA slices (do not test on BHSD what was trained on RSNA without that split).
- Values are Hounsfield units as RSNA's DICOM rescale gives them (the paper windows -40..120 HU); slice spacing can be
  uneven (issue White65534/BHSD#1).
- The paper's other 2,000 scans "with slice-level annotations" are RSNA's own labels and have no published layout in
  the BHSD release (issue White65534/BHSD#8, open): use RSNA 2019 (``--dataset rsna``) for them.

Rules: ``label`` = 1 on a slice with any bleed voxel, each subtype column = 1 on a slice with a voxel of that value;
a mask of more than one bleed value is written as a binary mask volume (bleed = 1) on the CT's affine beside the
manifest (``<stem>_masks/<scan>.nii.gz``: vit-ct masks are binary), the types staying in the subtype columns; one of a
single value (or none) is binary already and named where it lies. ``mask_pixels`` counts the slice's bleed voxels.

Licence: CC BY-NC-ND 4.0 (the repository's README and ``license.png``; earlier README versions said MIT): no
commercial use, no redistribution of modified data (the binary masks written here are for your own use).
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from vit_ct.data.datasets.output import DatasetOutput
from vit_ct.data.datasets.volumes import (
    SUBTYPES,
    Converted,
    add_scan_labels,
    check_choice,
    complete_volumes,
    count_note,
    find_folders,
    labelled_rows,
    left_out_note,
    nifti_files,
    one_folder,
    pair_volumes,
)
from vit_ct.files import safe_name
from vit_ct.progress import track

LAYOUT = "images/ and 'ground truths/' (label_192.zip), or imagesTr/, labelsTr/, imagesTs/, labelsTs/"
CLASSES = {1: "epidural", 2: "intraparenchymal", 3: "intraventricular", 4: "subarachnoid", 5: "subdural"}
RSNA_NAME = re.compile(r"^(ID_[0-9a-fA-F]+)_(ID_[0-9a-fA-F]+)$")  # <PatientID>_<StudyInstanceUID>
assert set(CLASSES.values()) == set(SUBTYPES)


SPLITS = (("imagesTr", "labelsTr", "train"), ("imagesTs", "labelsTs", "test"))


def _layout(folder: Path) -> bool:
    """Whether ``folder`` holds one of the layouts above."""
    if (folder / "images").is_dir() and (folder / "ground truths").is_dir():
        return True
    return any((folder / images).is_dir() and (folder / labels).is_dir() for images, labels, _ in SPLITS)


def _folders(root: Path, notes: list[str]) -> list[tuple[Path, Path, str | None]]:
    """(images, labels, official split) folders of the layouts above, in the one folder at or below ``root`` that
    holds one; an images folder without its labels folder (``imagesTs/`` alone: the test images as released without
    their labels) is said in ``notes``, its volumes left out."""
    folder = one_folder(find_folders(root, _layout), root, "BHSD", "one of the layouts", LAYOUT)
    if (folder / "images").is_dir() and (folder / "ground truths").is_dir():
        return [(folder / "images", folder / "ground truths", None)]
    found = []
    for images, labels, name in SPLITS:
        if not (folder / images).is_dir():
            continue
        if (folder / labels).is_dir():
            found.append((folder / images, folder / labels, name))
        else:
            count = len(nifti_files(folder / images))
            notes += count_note(
                count, f"volume(s) in {folder / images} without {labels}/ beside it: unlabelled, left out"
            )
    return found


def convert(
    root: Path, out: DatasetOutput, *, on_missing: str = "raise", scan_labels: bool = False, progress: bool = True
) -> Converted:
    """BHSD's 192 voxel-labelled volumes as a manifest (see the module).

    Args:
        root: the unpacked label_192 folder (or the folder holding it).
        out: where the manifest and the binary masks go.
        on_missing: "raise" when a CT has no label volume or a label volume no CT, or either one's voxel data is
            incomplete (a truncated copy), "skip" to leave it out (noted; incomplete ones also listed beside the
            manifest).
        scan_labels: also write ``scan_label`` and ``scan_<subtype>`` (a bleed of that type on any slice).
        progress: show a progress bar.
    """
    check_choice(on_missing, "on_missing", ("raise", "skip"))
    notes: list[str] = []
    jobs = [
        (pair, split)
        for images, labels, split in _folders(root, notes)
        for pair in pair_volumes(images, labels, on_missing=on_missing, what="BHSD", notes=notes)
    ]
    tables, left_out = [], []
    for pair, split in track(jobs, "BHSD volumes", disable=not progress):
        if not complete_volumes((pair.image, pair.labels), on_missing=on_missing, what="BHSD", left_out=left_out):
            continue
        match = RSNA_NAME.match(pair.stem)
        scan_id = safe_name(pair.stem)
        volume = labelled_rows(
            pair, out, scan_id=scan_id, patient_id=match[1] if match else scan_id, classes=CLASSES, what="BHSD"
        )
        table = volume.table
        table["study_uid"] = match[2] if match else None
        if split is not None:
            table["official_split"] = split
        tables.append(table)
    if not tables:
        raise ValueError(f"BHSD: no CT volume under {root} is complete with its label volume")
    table = pd.concat(tables, ignore_index=True)
    images = table.groupby("scan")["image"].nunique()
    if (images > 1).any():
        twice = sorted(images.index[images > 1])
        raise ValueError(f"BHSD: volumes named alike in the train and test folders: {twice[:5]}; expected one of each")
    if scan_labels:
        table = add_scan_labels(table)
    notes += left_out_note(left_out, out)
    return Converted(table, notes)
