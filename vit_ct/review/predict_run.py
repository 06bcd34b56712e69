"""A ``vit-ct predict`` output folder opened for review without running the model again: its slices
(``predictions.csv``, one rollout map per slice on the slice's own grid) and, where it has them, its scans
(``scans.csv``: each scan's slice probabilities, its probability and peak slice).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from vit_ct.data.io.reader import load_ct_slice, load_mask
from vit_ct.data.manifests.manifest import manifest_frame
from vit_ct.metrics.lesion_probability import has_in_scan_columns, lesion_probability
from vit_ct.metrics.schema import PREDICTIONS, REVIEW, RUN_JSON, SCANS, RunRecord


@dataclass
class PredictRun:
    """One predict output folder.

    Attributes:
        folder: ``OUT``.
        slices: ``predictions.csv`` with ``image_path`` (the slice's file), ``p_lesion`` (P(lesion), by
            :func:`vit_ct.metrics.lesion_probability.lesion_probability`), ``order`` (its place in its scan) and,
            where the model read each slice in its scan too (a sequence head), ``p_lesion_in_scan``.
        scans: ``scans.csv``, or None when the run predicted slices without scans.
        info: ``run.json`` (checkpoint, manifest, input), empty for runs written before it existed.
    """

    folder: Path
    slices: pd.DataFrame
    scans: pd.DataFrame | None
    info: dict

    def scan_slices(self, scan: str) -> pd.DataFrame:
        """The rows of one scan, in slice order."""
        if PREDICTIONS.scan not in self.slices:
            raise ValueError(f"{self.folder / PREDICTIONS.file} has no scan column: its slices belong to no scan")
        rows = self.slices[self.slices[PREDICTIONS.scan].astype(str) == str(scan)]
        if rows.empty:
            raise ValueError(f"scan {scan!r} is not in {self.folder / PREDICTIONS.file}")
        return rows.sort_values(SCANS.order, kind="stable")

    def rollout(self, row: pd.Series) -> np.ndarray:
        """The slice's rollout map (rows x columns of the slice)."""
        return np.load(self.folder / row[PREDICTIONS.rollout])

    def images(self, row: pd.Series) -> tuple[np.ndarray, np.ndarray | None]:
        """The slice in HU and its lesion mask (None without one), read again from its files."""
        options = (self.info.get("input") or {}).get("read_options") or {}
        frame = manifest_frame(row)
        hu = load_ct_slice(row[REVIEW.image_path], frame=frame, **options)
        mask = row.get(REVIEW.mask_path)
        return hu, (load_mask(mask, frame=frame) if isinstance(mask, str) and mask else None)


def open_predict_run(folder: str | os.PathLike) -> PredictRun:
    """Open ``OUT`` of ``vit-ct predict`` (``predictions.csv``, ``maps/``, optional ``scans.csv`` and ``run.json``).

    Raises:
        ValueError: ``folder`` holds no ``predictions.csv``, or a slice's file cannot be found (naming it).
    """
    folder = Path(folder).expanduser().resolve()
    table = folder / PREDICTIONS.file
    if not table.is_file():
        raise ValueError(f"{folder} is not a vit-ct predict output: it has no {PREDICTIONS.file}")
    info: RunRecord | dict = json.loads((folder / RUN_JSON).read_text()) if (folder / RUN_JSON).is_file() else {}
    slices = pd.read_csv(table)
    base = Path(info["images_relative_to"]) if info.get("images_relative_to") else Path.cwd()

    def resolve(path):
        return path if not isinstance(path, str) or Path(path).is_absolute() else str(base / path)

    slices[REVIEW.image_path] = [resolve(p) for p in slices[PREDICTIONS.image]]
    if PREDICTIONS.mask in slices:
        slices[REVIEW.mask_path] = [resolve(p) for p in slices[PREDICTIONS.mask]]
    missing = [p for p in slices[REVIEW.image_path] if not Path(p).exists()]
    if missing:
        raise ValueError(
            f"{table}: {len(missing)} slices not found, e.g. {missing[0]} (paths relative to"
            f" {base}); run the review where the manifest's paths resolve"
        )
    if "task" in info:
        slices[SCANS.p_lesion] = lesion_probability(slices, info["task"], info["class_names"])
    elif PREDICTIONS.prob in slices:  # a binary run written before run.json existed
        slices[SCANS.p_lesion] = slices[PREDICTIONS.prob].astype(float)
    else:
        raise ValueError(f"{folder} has no run.json to say how its prob_<class> columns make P(lesion): predict again")
    if "task" in info and has_in_scan_columns(slices, info["task"], info["class_names"]):
        slices[SCANS.p_lesion_in_scan] = lesion_probability(slices, info["task"], info["class_names"], in_scan=True)
    order = slices.groupby(PREDICTIONS.scan).cumcount() if PREDICTIONS.scan in slices else np.arange(len(slices))
    slices[SCANS.order] = order
    scans = pd.read_csv(folder / SCANS.file) if (folder / SCANS.file).is_file() else None
    return PredictRun(folder=folder, slices=slices, scans=scans, info=info)
