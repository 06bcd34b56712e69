"""PhysioNet CT-ICH (Hssayeni et al., "Computed Tomography Images for Intracranial Hemorrhage Detection and
Segmentation", v1.3.1): 75 head CT volumes (NIfTI) of patients with traumatic brain injury, bleed masks and a
diagnosis per slice, as a vit-ct manifest with slice labels, subtypes and masks.

Layout (the dataset's ReadMe.txt, v1.3.1, https://physionet.org/content/ct-ich/1.3.1/; the authors' loader in
github.com/Murtadha44/-Intracranial-Hemorrhage-Segmentation-Using-Deep-Convolutional-Model-U-Net-):

- ``ct_scans/NNN.nii``: one volume per patient, NNN the patient number with three digits (049..130; 059..065 are
  missing: "ct_scans folder contains the NIfTI scans ... except for subject #59 to 65"). (rows, columns, slices),
  512 x 512 x ~30 slices of 5 mm, stored in Hounsfield units (the authors window the raw array at 40/120 directly).
- ``masks/NNN.nii``: the bleed delineated by two radiologists in consensus, voxel for voxel like the CT; binary
  (non-zero = bleed; amid reads it as ``get_fdata().astype(bool)``).
- ``hemorrhage_diagnosis_raw_ct.csv``: one row per slice: ``PatientNumber, SliceNumber, Intraventricular,
  Intraparenchymal, Subarachnoid, Epidural, Subdural, No_Hemorrhage, Fracture_Yes_No`` (0/1). ``SliceNumber`` counts
  from 1 along the volume's last axis (the authors' loader asserts one row per slice of the volume). Some copies start
  with a byte-order mark.
- ``Patient_demographics.csv`` (age, sex, per-scan labels) and ``split_raw_data.py`` are not needed here.

Rules: ``slice`` = SliceNumber - 1. ``label`` (any bleed) = 1 when a subtype column is 1 or No_Hemorrhage is 0; rows
where the two disagree are counted in the notes. ``mask`` names ``masks/NNN.nii`` itself when it is binary and on the
CT's affine (else a binary copy is written beside the manifest); it is left empty on a slice labelled with a bleed
whose mask is empty there (vit-ct refuses such rows: an empty mask would teach "no bleed anywhere"). Extra columns:
``fracture`` (Fracture_Yes_No, per slice) and ``mask_pixels`` (bleed voxels of the slice's mask). Scans and patients
are ``CT-ICH-NNN``.

amid (neuro-ml/amid, ``amid/ct_ich.py``) reads the same files (ids 049..058 and 066..130, image as stored, mask as
bool) but gives no slice labels beyond the raw table and brings a cache framework (connectome) with it, so vit-ct
reads the files itself and was checked against that behaviour instead of depending on it.

Licence: PhysioNet Restricted Health Data License 1.5.0 for v1.3.1 (as amid records it; the v1.0.0 data descriptor
said CC BY 4.0): sign in to PhysioNet and accept the data use agreement; no redistribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from vit_ct.data.datasets.output import DatasetOutput
from vit_ct.data.datasets.volumes import (
    Converted,
    add_scan_labels,
    check_choice,
    complete_volumes,
    count_note,
    dataset_folder,
    left_out_note,
    lesion_pixels,
    load_volume,
    mask_reference,
    nifti_files,
    read_labels,
    volume_rows,
)
from vit_ct.data.manifests.splits import list_lines
from vit_ct.progress import track

CSV_NAME = "hemorrhage_diagnosis_raw_ct.csv"
LAYOUT = f"ct_scans/NNN.nii, masks/NNN.nii and {CSV_NAME}"
SUBTYPE_COLUMNS = {  # the diagnosis CSV's column -> vit-ct's (RSNA's) name
    "Epidural": "epidural",
    "Intraparenchymal": "intraparenchymal",
    "Intraventricular": "intraventricular",
    "Subarachnoid": "subarachnoid",
    "Subdural": "subdural",
}
REQUIRED = ("PatientNumber", "SliceNumber", *SUBTYPE_COLUMNS, "No_Hemorrhage")


def read_diagnosis(path: Path) -> pd.DataFrame:
    """The per-slice diagnosis table as integers, with each row's ``line`` in the CSV (header = line 1).

    Raises:
        ValueError: naming the file and the lines, for missing columns or values other than 0/1 (and whole numbers
            >= 1 for PatientNumber, SliceNumber), or a slice listed twice.
    """
    try:
        raw = pd.read_csv(path, dtype=str, keep_default_na=False, encoding="utf-8-sig")
    except (OSError, pd.errors.ParserError, UnicodeDecodeError) as e:
        raise ValueError(f"CT-ICH diagnosis {path}: cannot read ({type(e).__name__}: {e})") from None
    raw.columns = [c.strip() for c in raw.columns]
    missing = [c for c in REQUIRED if c not in raw.columns]
    if missing:
        raise ValueError(f"CT-ICH diagnosis {path} lacks the columns {missing}; header: {list(raw.columns)}")
    table = pd.DataFrame({"line": raw.index + 2})
    for column in [*REQUIRED, *(["Fracture_Yes_No"] if "Fracture_Yes_No" in raw.columns else [])]:
        values = pd.to_numeric(raw[column].str.strip(), errors="coerce")
        whole = values.notna() & (values == values.round())
        ok = whole & (values >= 1 if column in ("PatientNumber", "SliceNumber") else values.isin([0, 1]))
        if not ok.all():
            expected = "whole numbers >= 1" if column in ("PatientNumber", "SliceNumber") else "0 or 1"
            raise ValueError(
                f"CT-ICH diagnosis {path}: column {column} must hold {expected}; bad on lines"
                f" {list_lines(list(table.line[~ok]))}"
            )
        table[column] = values.astype(int)
    twice = table.duplicated(["PatientNumber", "SliceNumber"], keep=False)
    if twice.any():
        raise ValueError(f"CT-ICH diagnosis {path}: slices listed twice on lines {list_lines(list(table.line[twice]))}")
    return table.sort_values(["PatientNumber", "SliceNumber"], kind="stable")


def _by_number(folder: Path) -> dict[int, Path]:
    return {int(stem): path for stem, path in nifti_files(folder).items() if stem.isdigit()}


@dataclass
class _Tally:
    """What the notes report over all patients."""

    disagree: list[int] = field(default_factory=list)  # CSV lines where No_Hemorrhage and the subtypes disagree
    unmasked: int = 0  # slices labelled with a bleed, empty in the mask
    stray: int = 0  # slices labelled without a bleed, with mask voxels
    rewritten: list[str] = field(default_factory=list)  # masks written again, and why

    def notes(self) -> list[str]:
        return [
            *count_note(len(self.disagree), "CSV row(s) where No_Hemorrhage disagrees with the subtypes (label = 1"
                        f" when either says bleed), lines {list_lines(self.disagree)}"),
            *count_note(self.unmasked, "slice(s) labelled with a bleed have an empty mask there: mask cell left empty"),
            *count_note(self.stray, "slice(s) labelled without a bleed have mask voxels (kept; see mask_pixels)"),
            *count_note(len(self.rewritten), "mask(s) written again as binary volumes on their CT's grid:"
                        f" {', '.join(self.rewritten[:5])}"),
        ]  # fmt: skip


def _patient_rows(
    n: int, rows: pd.DataFrame, ct_path: Path, mask_path: Path, out: DatasetOutput, tally: _Tally, csv: Path
) -> pd.DataFrame:
    """The manifest rows of one patient: its diagnosis ``rows`` (one per slice, in order) on its volumes."""
    ct = load_volume(ct_path, "CT-ICH CT")
    depth = ct.shape[2]
    if list(rows["SliceNumber"]) != list(range(1, depth + 1)):
        raise ValueError(
            f"CT-ICH: patient {n} has {len(rows)} rows, SliceNumber {rows['SliceNumber'].min()}.."
            f"{rows['SliceNumber'].max()}, in {csv} (lines {list_lines(list(rows['line']))}) but {ct_path} has"
            f" {depth} slices; expected SliceNumber 1..{depth}, one row per slice"
        )
    mask = load_volume(mask_path, "CT-ICH mask")
    labels = read_labels(mask, mask_path, ct, ct_path, "CT-ICH mask")
    scan_id = f"CT-ICH-{n:03d}"
    table = volume_rows(ct_path, ct, out, scan_id=scan_id, patient_id=scan_id)
    for source, name in SUBTYPE_COLUMNS.items():
        table[name] = rows[source].to_numpy()
    any_subtype, no_bleed = rows[list(SUBTYPE_COLUMNS)].to_numpy().max(axis=1), rows["No_Hemorrhage"].to_numpy()
    table["label"] = np.maximum(any_subtype, 1 - no_bleed)
    tally.disagree += list(rows["line"][(any_subtype == 1) == (no_bleed == 1)])
    if "Fracture_Yes_No" in rows.columns:
        table["fracture"] = rows["Fracture_Yes_No"].to_numpy()
    pixels = lesion_pixels(labels)
    reference = mask_reference(mask_path, mask, labels, ct, out, scan_id)
    if reference.rewritten:
        tally.rewritten.append(f"{mask_path.name} ({reference.rewritten})")
    positive = table["label"].to_numpy() == 1
    table["mask"] = np.where(positive & (pixels == 0), "", reference.text)  # vit-ct refuses an empty mask there
    table["mask_pixels"] = pixels
    tally.unmasked += int((positive & (pixels == 0)).sum())
    tally.stray += int((~positive & (pixels > 0)).sum())
    return table


def convert(
    root: Path, out: DatasetOutput, *, on_missing: str = "raise", scan_labels: bool = False, progress: bool = True
) -> Converted:
    """CT-ICH v1.3.1 as a manifest (see the module).

    Args:
        root: the folder holding ct_scans/, masks/ and the diagnosis CSV (or the folder the archive unpacked into).
        out: where the manifest and any rewritten masks go.
        on_missing: "raise" when a patient of the CSV has no CT or mask volume, or one whose voxel data is incomplete
            (a truncated copy), "skip" to leave it out (noted; incomplete ones also listed beside the manifest).
        scan_labels: also write ``scan_label`` and ``scan_<subtype>`` (a bleed on any slice of the scan).
        progress: show a progress bar.
    """
    check_choice(on_missing, "on_missing", ("raise", "skip"))
    root = dataset_folder(root, ("ct_scans", "masks", CSV_NAME), "CT-ICH", LAYOUT)
    diagnosis = read_diagnosis(root / CSV_NAME)
    cts, masks = _by_number(root / "ct_scans"), _by_number(root / "masks")
    patients = sorted(diagnosis["PatientNumber"].unique())
    missing = [
        f"{root / folder / f'{n:03d}.nii'} (patient {n})"
        for n in patients
        for folder, found in (("ct_scans", cts), ("masks", masks))
        if n not in found
    ]
    notes = []
    if missing and on_missing == "raise":
        raise ValueError(
            f"CT-ICH: {len(missing)} volume(s) of patients listed in {root / CSV_NAME} are missing: "
            + ", ".join(missing[:10])
            + (" ..." if len(missing) > 10 else "")
            + "; expected ct_scans/NNN.nii and masks/NNN.nii for each (on_missing='skip' leaves those patients out)"
        )
    notes += count_note(len(missing), f"volume(s) missing, their patients left out: {', '.join(missing[:5])}")
    patients = [n for n in patients if n in cts and n in masks]
    unlisted = sorted(set(cts) - set(diagnosis["PatientNumber"]))
    notes += count_note(len(unlisted), f"CT volume(s) without rows in {CSV_NAME}, left out: {unlisted[:10]}")

    tally, left_out = _Tally(), []
    tables = [
        _patient_rows(n, diagnosis[diagnosis["PatientNumber"] == n], cts[n], masks[n], out, tally, root / CSV_NAME)
        for n in track(patients, "CT-ICH volumes", disable=not progress)
        if complete_volumes((cts[n], masks[n]), on_missing=on_missing, what="CT-ICH", left_out=left_out)
    ]
    if not tables:
        raise ValueError(f"CT-ICH: no patient of {root / CSV_NAME} has both volumes; expected {LAYOUT}")
    table = pd.concat(tables, ignore_index=True)
    if scan_labels:
        table = add_scan_labels(table)
    notes += tally.notes()
    notes += left_out_note(left_out, out)
    return Converted(table, notes)
