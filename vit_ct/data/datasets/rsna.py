"""RSNA 2019 Intracranial Hemorrhage Detection (Kaggle) by name:
`vit_ct.data.datasets.rsna_manifest.build_rsna_manifest` on the competition's folder, plus ``label`` (= ``any``) so that
every public set names "any bleed" alike.

Layout (Kaggle's rsna-intracranial-hemorrhage-detection download): ``stage_2_train.csv`` (``ID,Label`` rows
``ID_<sop id>_<subtype>``) and ``stage_2_train/ID_<sop id>.dcm`` in one folder. Slice labels: the five subtypes
and ``any``, per slice; ``patient_id`` from each DICOM header.

Licence: the competition's data terms: non-commercial research use (Kaggle rules of the RSNA 2019 competition).
"""

from __future__ import annotations

import os
from pathlib import Path

from vit_ct.data.datasets.output import DatasetOutput
from vit_ct.data.datasets.rsna_manifest import build_rsna_manifest
from vit_ct.data.datasets.volumes import Converted


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
        root: the competition folder.
        out: where the manifest goes.
        labels_csv: the labels file, relative to ``root`` (e.g. stage_1_train.csv for the stage 1 release).
        images: the folder of the labelled slices, relative to ``root`` (e.g. stage_1_train_images).
        workers: threads reading DICOM headers.
        progress: show a progress bar.
    """
    labels, folder = root / labels_csv, root / images
    missing = [str(p) for p in (labels, folder) if not p.exists()]
    if missing:
        raise ValueError(
            f"RSNA 2019: {', '.join(missing)} not found; expected {labels_csv} and {images}/ in {root} (Kaggle's"
            " rsna-intracranial-hemorrhage-detection folder; labels_csv= and images= name other stages)"
        )
    draft = out.folder / f".{out.manifest.name}.{os.getpid()}.tmp"  # its image paths are relative to out.folder
    try:
        table = build_rsna_manifest(labels, folder, draft, workers=workers, progress=progress)
    finally:
        draft.unlink(missing_ok=True)
    table["label"] = table["any"]
    unread = int(table["patient_id"].isna().sum())
    notes = [f"{unread} DICOM header(s) could not be read: patient_id left empty"] if unread else []
    return Converted(table, notes)
