"""The public head-CT datasets by name: each one's folder, exactly as it is distributed, turned into a vit-ct manifest
(`write_dataset_manifest`). Each module states the layout it reads, its sources, its rules and the data's licence.

Labels are written alike for every set: ``label`` (0/1, any bleed on the slice) and RSNA's subtype names
(``epidural``, ``intraparenchymal``, ``intraventricular``, ``subarachnoid``, ``subdural``) for slice labels;
``scan_label`` and ``scan_<subtype>`` for labels given per scan (repeated on each of its rows); ``mask`` for a binary
mask of the slice (the same NIfTI file on each row of a scan, with its ``slice``).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from vit_ct.data.datasets import bhsd, cq500, ctich, instance, rsna
from vit_ct.data.datasets.output import DatasetOutput
from vit_ct.data.datasets.volumes import LEFT_OUT, Converted

__all__ = ["DATASETS", "DatasetInfo", "DatasetManifest", "dataset_info", "write_dataset_manifest"]


@dataclass(frozen=True)
class DatasetInfo:
    """A public dataset vit-ct reads by name."""

    name: str
    title: str
    labels: str  # what the manifest gets
    layout: str  # what ROOT must hold
    licence: str
    url: str
    convert: Callable[..., Converted]
    tables: tuple[str, ...] = ()  # side tables written beside the manifest (``<stem>.<name>.csv``)

    def options(self) -> dict[str, object]:
        """The converter's options and their defaults."""
        skip = {"root", "out", "progress"}
        return {n: p.default for n, p in inspect.signature(self.convert).parameters.items() if n not in skip}


DATASETS = {
    info.name: info
    for info in (
        DatasetInfo(
            "cq500", "CQ500 (qure.ai)", "scan labels from 2 of 3 readers, subtypes; one series per study",
            "reads.csv and the CQ500CT<N> CQ500CT<N>/Unknown Study/CT <series>/ folders", "CC BY-NC-SA 4.0",
            "https://www.kaggle.com/datasets/crawford/qureai-headct", cq500.convert, tables=("series", LEFT_OUT),
        ),
        DatasetInfo(
            "ctich", "PhysioNet CT-ICH v1.3.1", "slice labels and subtypes from the diagnosis CSV; masks",
            f"ct_scans/, masks/ and {ctich.CSV_NAME}", "PhysioNet Restricted Health Data License 1.5.0",
            "https://physionet.org/content/ct-ich/1.3.1/", ctich.convert, tables=(LEFT_OUT,),
        ),
        DatasetInfo(
            "instance", "INSTANCE 2022", "slice labels from the masks (no subtypes); masks", instance.LAYOUT,
            "challenge rule agreement (own use, no redistribution)", "https://instance.grand-challenge.org/",
            instance.convert, tables=(LEFT_OUT,),
        ),
        DatasetInfo(
            "bhsd", "BHSD", "slice labels and subtypes from the 5-class masks; binary masks", bhsd.LAYOUT,
            "CC BY-NC-ND 4.0", "https://huggingface.co/datasets/WuBiao/BHSD", bhsd.convert, tables=(LEFT_OUT,),
        ),
        DatasetInfo(
            "rsna", "RSNA 2019 Intracranial Hemorrhage Detection", "slice labels: five subtypes, any (= label)",
            "stage_2_train.csv and stage_2_train/", "Kaggle competition terms (non-commercial)",
            "https://www.kaggle.com/competitions/rsna-intracranial-hemorrhage-detection", rsna.convert,
            tables=(LEFT_OUT,),
        ),
    )
}  # fmt: skip
ALIASES = {"ct-ich": "ctich", "physionet": "ctich", "instance2022": "instance", "rsna2019": "rsna"}


def dataset_info(name: str) -> DatasetInfo:
    """The dataset of a name (case and ``-``/``_`` ignored), or a ValueError listing the names."""
    key = str(name).strip().lower().replace("_", "-")
    key = ALIASES.get(key, key).replace("-", "")
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
    return DATASETS[key]


@dataclass
class DatasetManifest:
    """What `write_dataset_manifest` wrote."""

    dataset: DatasetInfo
    manifest: Path
    table: pd.DataFrame
    notes: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)  # the manifest, then the mask folder and side tables

    def summary(self) -> str:
        """One line for the command line."""
        scans = self.table["scan"].nunique() if "scan" in self.table.columns else None
        labels = [c for c in ("scan_label", "label") if c in self.table.columns]
        positive = ""
        if labels:
            column = labels[0]
            unit = self.table.groupby("scan")[column].max() if column == "scan_label" else self.table[column]
            positive = f", {int(unit.sum())} {'scans' if column == 'scan_label' else 'slices'} with a bleed"
        of = f" of {scans} scans" if scans is not None else ""
        source = f"{self.dataset.title}, licence: {self.dataset.licence}"
        return f"wrote {self.manifest}: {len(self.table)} slices{of}{positive} ({source})"


def write_dataset_manifest(
    name: str,
    root: str | os.PathLike,
    output: str | os.PathLike,
    *,
    overwrite: bool = False,
    progress: bool = True,
    **options,
) -> DatasetManifest:
    """Write a vit-ct manifest for a public head-CT dataset from its folder as distributed.

    Datasets (NAME: what ROOT holds -> what the manifest gets; licence):

    - ``cq500``: reads.csv and the ``CQ500CT<N> CQ500CT<N>`` folders -> ``scan_label`` and ``scan_<subtype>`` from
      two of three readers, one series per study (non-contrast, soft kernel, the thinnest >= ``min_thickness_mm``,
      said plain; every series, the choice and why in ``OUT.series.csv``); CC BY-NC-SA 4.0. Options:
      ``min_thickness_mm`` (2.5), ``on_missing`` ("skip" here: the Kaggle mirror lacks some studies of reads.csv,
      listed in ``OUT.left_out.csv``).
    - ``ctich``: ct_scans/, masks/, hemorrhage_diagnosis_raw_ct.csv (PhysioNet CT-ICH v1.3.1) -> ``label``,
      subtypes, ``fracture`` per slice, ``mask``; PhysioNet Restricted Health Data License. Options: ``on_missing``,
      ``scan_labels``.
    - ``instance``: data/ and label/ (INSTANCE 2022 training set) -> ``label`` from the masks, ``mask``; challenge
      agreement, no redistribution. Options: ``on_missing``, ``scan_labels``.
    - ``bhsd``: images/ and "ground truths/" (label_192), or imagesTr/labelsTr/imagesTs/labelsTs -> ``label`` and
      subtypes from the 5-class masks, binary masks written to ``OUT_masks/``; CC BY-NC-ND 4.0. Options:
      ``on_missing``, ``scan_labels``.
    - ``rsna``: stage_2_train.csv and stage_2_train/ (Kaggle) -> the five subtypes, ``any`` and ``label`` per slice;
      non-commercial. Options: ``labels_csv``, ``images``, ``workers``.

    Options: ``on_missing`` "raise" (default) or "skip" a case whose files are missing or, for the NIfTI sets
    (``ctich``, ``instance``, ``bhsd``), hold incomplete voxel data (a truncated copy: skipped ones are also listed
    with their reason in ``OUT.left_out.csv``); ``scan_labels`` adds
    ``scan_label``/``scan_<subtype>`` (a bleed anywhere in the scan) to slice-labelled sets.

    Args:
        name: the dataset (``cq500``, ``ctich``, ``instance``, ``bhsd``, ``rsna``).
        root: its folder as unpacked (or the folder holding that one).
        output: the manifest CSV to write; masks that must be written go to ``<output stem>_masks/`` beside it.
        overwrite: replace an existing manifest (and its mask folder and side tables).
        progress: show progress bars.
        **options: the dataset's options above.

    Returns:
        What was written, with notes on the data (cases left out, label disagreements) for the user.

    Raises:
        ValueError: an unknown name or option, a ROOT without the expected files (naming the path and the layout
            expected), a case listed without its files, malformed label files, or an output that exists.
    """
    info = dataset_info(name)
    unknown = sorted(set(options) - set(info.options()))
    if unknown:
        valid = ", ".join(f"{k}={v!r}" for k, v in info.options().items())
        raise ValueError(f"{info.name} has no option(s) {unknown}; its options: {valid}")
    folder = Path(os.path.abspath(Path(root).expanduser()))
    if not folder.is_dir():
        raise ValueError(f"{info.title} folder {folder} not found; expected a folder holding {info.layout}")
    with DatasetOutput(output, overwrite=overwrite, tables=info.tables) as out:
        converted = info.convert(folder, out, progress=progress, **options)
        files = out.commit(converted.table)
    return DatasetManifest(info, out.manifest, converted.table, converted.notes, files)
