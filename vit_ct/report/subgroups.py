"""For whom does the model fail? Slice-level AUROC, sensitivity and specificity at 0.5 and the rollout's pointing game
per level of every categorical column of the manifest, of what the DICOM headers say (manufacturer, kernel, slice
thickness, kVp) and of lesion size, each with its interval over patients; a level with fewer than 20 slices shows its
count only, without figures or a verdict.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pydicom
import torch
from torchmetrics.functional.classification import binary_auroc

from vit_ct.metrics.schema import PREDICTIONS
from vit_ct.report.bootstrap import Metric, estimate, patient_bootstrap
from vit_ct.report.detection import THRESHOLD
from vit_ct.report.inputs import IMAGE_PATH, P_LESION, PATIENT, POSITIVE, SPACING
from vit_ct.report.map_quality import LESION_AREA_MM2, LESION_AREA_PX, size_quartiles

MIN_CASES = 20  # below this many slices a subgroup's figures say little: its count is shown, no verdict
# the DICOM header fields read (pydicom, pixels left unread), as the report's column names
DICOM_FIELDS = {"manufacturer": "Manufacturer", "kernel": "ConvolutionKernel", "slice_thickness_mm": "SliceThickness",
                "kvp": "KVP"}  # fmt: skip
NOT_DICOM = (".npy", ".nii", ".nii.gz", ".png")
LESION_SIZE = "lesion_size"


def dicom_fields(slices: pd.DataFrame) -> pd.DataFrame:
    """The slices with a column per :data:`DICOM_FIELDS` (None where the image is not DICOM or lacks the field; no
    column where no slice has it) and ``pixel_spacing_mm`` filled from PixelSpacing where the manifest left it empty.
    Each file's header is read once."""
    headers: dict[str, dict] = {}
    tags = [*DICOM_FIELDS.values(), "PixelSpacing"]
    for path in slices[IMAGE_PATH].unique():
        if not isinstance(path, str) or path.lower().endswith(NOT_DICOM):
            continue
        try:
            ds = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=tags)
        except Exception:  # a file pydicom cannot read: no header figures for it, the report goes on
            continue
        headers[path] = {name: _plain(ds.get(tag)) for name, tag in DICOM_FIELDS.items()}
        spacing = ds.get("PixelSpacing")
        headers[path][SPACING] = float(np.mean([float(v) for v in spacing])) if spacing else np.nan
    out = slices.copy()
    for name in DICOM_FIELDS:
        values = [headers.get(p, {}).get(name) for p in out[IMAGE_PATH]]
        if any(v is not None for v in values):
            out[name] = values
    from_header = np.array([headers.get(p, {}).get(SPACING, np.nan) for p in out[IMAGE_PATH]], dtype=float)
    out[SPACING] = np.where(np.isnan(out[SPACING].to_numpy(float)), from_header, out[SPACING].to_numpy(float))
    return out


def _plain(value) -> str | None:
    """A header value as a subgroup level: text, numbers as written without trailing zeros; None where empty."""
    if value is None or value == "":
        return None
    if isinstance(value, pydicom.multival.MultiValue):
        return "\\".join(_plain(v) or "" for v in value)
    if isinstance(value, (int, float)):
        return f"{float(value):g}"
    return str(value).strip() or None


def subgroup_statistic(table: pd.DataFrame):
    """AUROC, sensitivity and specificity at 0.5 and the rollout's mean pointing game of a replicate's slices."""
    prob, label = table[P_LESION].to_numpy(float), table[POSITIVE].to_numpy(bool)
    pointing_column = PREDICTIONS.score("rollout", "pointing")
    pointing = table[pointing_column].to_numpy(float) if pointing_column in table else None

    def statistic(rows: np.ndarray) -> dict[str, float]:
        p, y = prob[rows], label[rows]
        called = p > THRESHOLD
        out = {"sensitivity": called[y].mean() if y.any() else np.nan,
               "specificity": (~called[~y]).mean() if (~y).any() else np.nan,
               "auroc": float(binary_auroc(torch.from_numpy(np.array(p)), torch.from_numpy(y.astype(np.int64)),
                                           validate_args=False)) if 0 < y.sum() < len(y) else np.nan}  # fmt: skip
        if pointing is not None:
            scored = pointing[rows][np.isfinite(pointing[rows])]
            out["pointing"] = scored.mean() if len(scored) else np.nan
        return out

    return statistic


def subgroup(table: pd.DataFrame, overall: dict[str, Metric], *, resamples: int, seed: int) -> dict:
    """One level's entry: its counts, and (from 20 slices) its figures with intervals and a verdict against the
    overall figure: ``lower`` or ``higher`` when the level's 95% interval of AUROC (sensitivity where it has no
    negatives, specificity where it has no positives) excludes the overall value, else ``no difference shown``."""
    positives = int(table[POSITIVE].sum())
    entry: dict = {"n": len(table), "positives": positives, "patients": int(table[PATIENT].nunique())}
    if len(table) < MIN_CASES:
        return entry | {"verdict": None}
    counts = {"auroc": len(table), "sensitivity": positives, "specificity": len(table) - positives}
    pointing = PREDICTIONS.score("rollout", "pointing")
    if pointing in table:
        counts["pointing"] = int(table[pointing].notna().sum())
    bootstrap = patient_bootstrap(table[PATIENT], resamples=resamples, seed=seed)
    metrics, _ = estimate(subgroup_statistic(table), bootstrap, counts)
    entry |= metrics
    basis = next(k for k in ("auroc", "sensitivity", "specificity") if metrics[k]["value"] is not None)
    entry["verdict"] = _verdict(metrics[basis], overall.get(basis))
    return entry


def _verdict(level: Metric, overall: Metric | None) -> str | None:
    if level["ci95"] is None or overall is None or overall["value"] is None:
        return None
    lo, hi = level["ci95"]
    return "lower" if hi < overall["value"] else "higher" if lo > overall["value"] else "no difference shown"


def subgroups(slices: pd.DataFrame, overall: dict[str, Metric], *, resamples: int, seed: int) -> dict:
    """Every grouping: the manifest's subgroup columns (``attrs["subgroups"]``), the DICOM fields
    (:func:`dicom_fields`, already added) and lesion size (quartiles of the lesion area, lesion slices only), each
    ``{level: entry}`` (:func:`subgroup`)."""
    labelled = slices[slices[POSITIVE].notna()].copy()
    labelled[POSITIVE] = labelled[POSITIVE].astype(bool)
    columns = [*slices.attrs.get("subgroups", []), *(c for c in DICOM_FIELDS if c in slices)]
    out: dict = {}
    for column in columns:
        out[column] = {str(level): subgroup(group, overall, resamples=resamples, seed=seed)
                       for level, group in labelled.groupby(column, sort=True)}  # fmt: skip
    if LESION_AREA_PX in labelled and labelled[LESION_AREA_PX].gt(0).any():
        unit = LESION_AREA_MM2 if labelled.loc[labelled[LESION_AREA_PX] > 0, LESION_AREA_MM2].notna().all() else (
            LESION_AREA_PX)  # fmt: skip
        quartile, edges = size_quartiles(labelled[unit])
        suffix = "mm²" if unit == LESION_AREA_MM2 else "px"
        out[LESION_SIZE] = {}
        for q in range(1, 5):
            chosen = labelled[(quartile == q).fillna(False).to_numpy(bool)]
            if len(chosen):
                name = f"q{q}: {edges[q - 1]:.4g}-{edges[q]:.4g} {suffix}"
                out[LESION_SIZE][name] = subgroup(chosen, overall, resamples=resamples, seed=seed)
    return out
