"""RSNA 2019 Intracranial Hemorrhage Detection (Kaggle) by name:
`vit_ct.data.datasets.rsna_manifest.build_rsna_manifest` on the competition's folder, plus ``label`` (= ``any``) so that
every public set names "any bleed" alike.

Layout (Kaggle's rsna-intracranial-hemorrhage-detection download): ``stage_2_train.csv`` (``ID,Label`` rows
``ID_<sop id>_<subtype>``) and ``stage_2_train/ID_<sop id>.dcm`` in one folder. Slice labels: the five subtypes
and ``any``, per slice; ``patient_id`` from each DICOM header. Kaggle's zip unpacks into
``rsna-intracranial-hemorrhage-detection/rsna-intracranial-hemorrhage-detection/`` (the path the competition's
kernels read, ``../input/rsna-intracranial-hemorrhage-detection/rsna-intracranial-hemorrhage-detection/``): the
folder holding both is found below ROOT.

Known faults of the download, handled here and in the reader: ``stage_2_train/ID_6431af929.dcm`` has short pixel data
(the competition's discussion; kernels skip it): files whose pixel data cannot be decoded are left out of the manifest
and listed in ``OUT.left_out.csv``. A share of the slices store wrapped unsigned 12-bit values (air as 3096): the
reader unwraps them (`vit_ct.data.io.dicom.WRAP_PERIOD`) and every run counts them in one line.

Licence: the competition's data terms: non-commercial research use (Kaggle rules of the RSNA 2019 competition).
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from vit_ct.data.datasets.output import DatasetOutput
from vit_ct.data.datasets.rsna_manifest import build_rsna_manifest
from vit_ct.data.datasets.volumes import LEFT_OUT, LEFT_OUT_COLUMNS, Converted, count_note, dataset_folder

LAYOUT = (
    "Kaggle's rsna-intracranial-hemorrhage-detection folder as unzipped, or a folder above it (labels_csv= and"
    " images= name another stage's files)"
)


def convert(
    root: Path,
    out: DatasetOutput,
    *,
    labels_csv: str = "stage_2_train.csv",
    images: str = "stage_2_train",
    workers: int = 8,
    progress: bool = True,
) -> Converted:
    """RSNA 2019 as a multi-label manifest (see the module).

    Args:
        root: the competition folder, or a folder above it (Kaggle's zip unpacks into
            ``rsna-intracranial-hemorrhage-detection/rsna-intracranial-hemorrhage-detection/``).
        out: where the manifest goes.
        labels_csv: the labels file, relative to ``root`` (e.g. stage_1_train.csv for the stage 1 release).
        images: the folder of the labelled slices, relative to ``root`` (e.g. stage_1_train_images).
        workers: threads reading DICOM headers.
        progress: show a progress bar.
    """
    root = dataset_folder(root, (labels_csv, images), "RSNA 2019", f"{labels_csv} and {images}/ ({LAYOUT})")
    labels, folder = root / labels_csv, root / images
    draft = out.folder / f".{out.manifest.name}.{os.getpid()}.tmp"  # its image paths are relative to out.folder
    try:
        table = build_rsna_manifest(labels, folder, draft, workers=workers, progress=progress)
    finally:
        draft.unlink(missing_ok=True)
    table["label"] = table["any"]
    unread = int(table["patient_id"].isna().sum())
    notes = [f"{unread} DICOM header(s) without PatientID: patient_id left empty"] if unread else []
    left_out = table.attrs["left_out"]
    if left_out:
        out.add_table(LEFT_OUT, pd.DataFrame(left_out, columns=list(LEFT_OUT_COLUMNS)))
        shown = ", ".join(f"{Path(f).name} ({reason})" for f, reason in left_out[:3])
        more = f" and {len(left_out) - 3} more" if len(left_out) > 3 else ""
        notes += count_note(
            len(left_out),
            f"slice file(s) whose pixel data cannot be decoded, left out: {shown}{more} (each with its reason in"
            f" {out.stem}.{LEFT_OUT}.csv beside the manifest)",
        )
    return Converted(table, notes)
