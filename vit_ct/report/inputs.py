"""What a report reads: a model's predictions (a ``vit-ct predict`` output folder as it is, or any model's
``predictions.csv`` with the same columns) joined to the labelled manifest by the slice's image, as the manifest names
it (and its ``slice`` for volumes), one row per predicted slice.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from vit_ct.data.manifests.labels import lesion_labels, scan_lesion_labels, values_read_as_lesion
from vit_ct.data.manifests.manifest import read_manifest
from vit_ct.data.manifests.scan_labels import scan_key
from vit_ct.metrics.lesion_probability import has_in_scan_columns, lesion_probability
from vit_ct.metrics.schema import PREDICTIONS, RUN_JSON, SCANS

# The manifest's own columns, never subgroups (the README's manifest table, and what read_manifest adds)
MANIFEST_COLUMNS = {"image", "label", "patient_id", "scan", "split", "mask", "slice", "pixel_spacing_mm", "image_ref",
                    "mask_ref", "manifest_line", "image_digest", "scan_label", "position_mm"}  # fmt: skip
# Identifiers (StudyInstanceUID, SeriesInstanceUID, ...) name cases, not groups a model may fail for: never subgroups
IDENTIFIER_SUFFIXES = ("_uid", "_id")
MAX_LEVELS = 12  # a manifest column with 2..12 distinct values (fewer than its rows) is a subgroup column
# The joined table: P(lesion), truth, where each slice belongs, its files
P_LESION, POSITIVE, PATIENT, SCAN, SPLIT = "p_lesion", "positive", "patient", "scan", "split"
SCAN_POSITIVE = "scan_positive"
IMAGE_PATH, MASK_PATH, OVERLAY_PATH, SPACING = "image_path", "mask_path", "overlay_path", "pixel_spacing_mm"
MANIFEST_ROW = "manifest_row"  # the slice's row (position) in the manifest table, to read it as the model did


@dataclass
class ModelPredictions:
    """One model's predictions.

    Attributes:
        name: How the report names the model.
        table: The ``predictions.csv`` read (its path in ``table.attrs["path"]``), with ``p_lesion``.
        folder: The folder its relative paths (``rollout``, ``overlay``) are relative to.
        info: ``run.json`` where the folder has one (a ``vit-ct predict`` output), else ``{}``.
    """

    name: str
    table: pd.DataFrame
    folder: Path
    info: dict


def read_predictions(path: str | os.PathLike, name: str, *, in_scan: bool = False) -> ModelPredictions:
    """A ``vit-ct predict`` output folder, or a ``predictions.csv`` of any model: ``image`` as the manifest names the
    slice, P(lesion) as ``prob`` (or ``prob_lesion``; a vit-ct run's ``prob_<class>`` columns through its ``run.json``),
    optionally ``slice``, ``overlay`` (a PNG per slice, relative to the CSV's folder) and the map score columns
    ``<map>_<score>`` (``rollout_pointing``, ...). ``in_scan``: P(lesion) from the slices read in their scans
    (``prob_in_scan``, ... of a model with a sequence head) instead.

    Raises:
        ValueError: naming the folder or file and what was expected.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        csv = path / PREDICTIONS.file
        if not csv.is_file():
            raise ValueError(f"{path} is not a vit-ct predict output: it has no {PREDICTIONS.file} (expected the folder"
                             " `vit-ct predict --output_dir` wrote, or a predictions CSV)")  # fmt: skip
    elif path.is_file():
        csv = path
    else:
        raise ValueError(f"{path} not found; expected a vit-ct predict output folder or a predictions CSV")
    try:
        table = pd.read_csv(csv)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise ValueError(f"{csv} is not a readable CSV: {err}") from None
    info = json.loads((csv.parent / RUN_JSON).read_text()) if (csv.parent / RUN_JSON).is_file() else {}
    if PREDICTIONS.image not in table:
        raise ValueError(f"{csv} lacks the '{PREDICTIONS.image}' column (the slice as the manifest names it); columns:"
                         f" {list(table.columns)}")  # fmt: skip
    table[P_LESION] = _lesion_probability(table, info, csv, in_scan=in_scan)
    table.attrs["path"] = str(csv)
    return ModelPredictions(name=name, table=table, folder=csv.parent.resolve(), info=info)


def has_in_scan(predictions: ModelPredictions) -> bool:
    """Whether a vit-ct run wrote each slice's probability in its scan too (a sequence head: ``prob_in_scan``)."""
    info = predictions.info
    return has_in_scan_columns(predictions.table, info.get("task", "binary"), info.get("class_names") or [])


def _lesion_probability(table: pd.DataFrame, info: dict, csv: Path, *, in_scan: bool = False) -> pd.Series:
    """P(lesion) per row: through ``run.json``'s task (multi-class, multi-label), else ``prob`` or ``prob_lesion``;
    ``in_scan``: of the ``prob_in_scan`` columns."""
    if "task" in info or in_scan:
        task, names = info.get("task", "binary"), info.get("class_names") or []
        missing = [c for c in PREDICTIONS.probs(task, names, in_scan=in_scan) if c not in table]
        if missing:
            raise ValueError(f"{csv} lacks the column(s) {missing} its run.json ({task}) names")
        prob = lesion_probability(table, task, names, in_scan=in_scan)
    else:
        column = next((c for c in (PREDICTIONS.prob, f"{PREDICTIONS.prob}_lesion") if c in table), None)
        if column is None:
            raise ValueError(f"{csv} lacks a P(lesion) column: expected 'prob' (or 'prob_lesion'), numbers in [0, 1];"
                             f" columns: {list(table.columns)}")  # fmt: skip
        prob = pd.to_numeric(table[column], errors="coerce")
    bad = ~prob.between(0, 1)  # NaN too
    if bad.any():
        lines = (np.flatnonzero(bad.to_numpy()) + 2)[:10].tolist()  # the header is line 1
        raise ValueError(f"{csv}: P(lesion) must be a number in [0, 1]; bad on lines {lines}")
    return prob.astype(float)


def read_labels(manifest: str | os.PathLike, info: dict) -> pd.DataFrame:
    """The manifest (:func:`vit_ct.data.manifests.manifest.read_manifest`; multi-label when the run was), unlabelled
    rows allowed."""
    label_columns = info.get("class_names") if info.get("task") == "multilabel" else None
    table = read_manifest(manifest, label_columns=label_columns, require_labels=False)
    # A binary model's output (or another model's CSV, whose P(lesion) is one column) meets classes above 1: say what
    # they are read as. A multi-class run's classes above 0 are lesions by its own outputs.
    note = values_read_as_lesion(table) if info.get("task") not in ("multiclass", "multilabel") else None
    if note:
        warnings.warn(note, stacklevel=2)
    return table


def _keys(images: pd.Series, frames: pd.Series | None) -> pd.Series:
    frames = frames if frames is not None else pd.Series(pd.NA, index=images.index)
    return pd.Series([f"{image}#{'' if pd.isna(f) else int(f)}" for image, f in zip(images, frames, strict=True)],
                     index=images.index)  # fmt: skip


def join(predictions: ModelPredictions, manifest: pd.DataFrame) -> pd.DataFrame:
    """One row per predicted slice with its P(lesion), the manifest's truth and where it belongs:
    ``image``, ``p_lesion``, ``positive`` (bool, <NA> unlabelled), ``patient`` (``patient_id``, else the scan, else the
    image: a row is its own patient), ``scan`` (None without a scan or patient), ``split``, ``image_path``,
    ``mask_path``, ``overlay_path``, ``pixel_spacing_mm``, ``manifest_row`` (the row's position in ``manifest``), the
    map score columns of the predictions and the manifest's subgroup columns (``attrs["subgroups"]``), and
    ``scan_positive``: the slice's scan label (<NA> without one).

    Raises:
        ValueError: a predicted slice the manifest does not list, naming both files.
    """
    table, csv = predictions.table, predictions.table.attrs["path"]
    frames = "slice" in table and "slice" in manifest
    keys = _keys(table[PREDICTIONS.image].astype(str), table["slice"] if frames else None)
    listed = _keys(manifest["image_ref"].astype(str), manifest["slice"] if frames else None)
    where = pd.Series(np.arange(len(manifest)), index=listed.to_numpy()).groupby(level=0).first()  # first listing
    missing = ~keys.isin(where.index)
    if missing.any():
        example = table.loc[missing, PREDICTIONS.image].iloc[0]
        raise ValueError(
            f"{csv}: {int(missing.sum())} of its {len(table)} rows are not in manifest {manifest.attrs['manifest']}"
            f" (matched by 'image' as the manifest writes it{' and slice' if frames else ''}), e.g. {example!r};"
            " expected the manifest the predictions were made from"
        )
    rows = manifest.iloc[where[keys].to_numpy()].reset_index(drop=True)
    out = pd.DataFrame({PREDICTIONS.image: table[PREDICTIONS.image].astype(str).to_numpy(),
                        P_LESION: table[P_LESION].to_numpy(float)})  # fmt: skip
    out[POSITIVE] = lesion_labels(rows, manifest.attrs.get("label_columns")).to_numpy()
    key = scan_key(rows)
    out[SCAN] = rows[key].astype(str).to_numpy() if key else None
    has_patient = "patient_id" in rows and rows["patient_id"].notna().all()
    out[PATIENT] = rows["patient_id"].astype(str).to_numpy() if has_patient else (out[SCAN] if key else out["image"])
    out[SPLIT] = rows["split"].to_numpy() if "split" in rows else None
    out[IMAGE_PATH] = rows["image"].to_numpy()
    out[MANIFEST_ROW] = where[keys].to_numpy()
    out[MASK_PATH] = rows["mask"].to_numpy() if "mask" in rows else None
    out[SPACING] = rows[SPACING].to_numpy(float) if SPACING in rows else np.nan
    if "slice" in rows:
        out["slice"] = rows["slice"].to_numpy()
    overlay = table[PREDICTIONS.overlay] if PREDICTIONS.overlay in table else pd.Series(None, index=table.index)
    out[OVERLAY_PATH] = [str(predictions.folder / p) if isinstance(p, str) else None for p in overlay]
    scores = [c for c in table.columns if _is_map_score(c)]
    out[scores] = table[scores].to_numpy(float) if scores else None
    scan_positive = scan_lesion_labels(rows)
    out[SCAN_POSITIVE] = pd.NA if scan_positive is None else scan_positive.to_numpy()
    subgroups = subgroup_columns(rows, manifest.attrs.get("label_columns"))
    for column in subgroups:
        out[column] = rows[column].replace("", None).to_numpy()
    out.attrs["subgroups"] = subgroups
    out.attrs["predictions"], out.attrs["manifest"] = csv, manifest.attrs["manifest"]
    return out


def _is_map_score(column: str) -> bool:
    from vit_ct.metrics.localisation import MAP_SOURCES, SCORES

    return any(column == PREDICTIONS.score(s, score) for s in MAP_SOURCES for score in SCORES)


def subgroup_columns(manifest: pd.DataFrame, label_columns=None) -> list[str]:
    """The manifest's categorical columns beyond its own: text or numbers with 2 to 12 distinct values, fewer than its
    rows (``lesion_type``, ``bleed_type``, ``scanner``, ...); label columns and identifiers (``study_uid``,
    ``series_uid``, any ``*_uid`` or ``*_id``) are not."""
    own = MANIFEST_COLUMNS | set(label_columns or ()) | {c for c in manifest if c.startswith(("scan_", "label_"))}
    own |= {c for c in manifest if str(c).lower().endswith(IDENTIFIER_SUFFIXES)}
    chosen = []
    for column in manifest.columns:
        if column in own or manifest[column].dtype.kind not in "OUSif":
            continue
        values = manifest[column].replace("", None).dropna()
        if 2 <= values.nunique() <= MAX_LEVELS and values.nunique() < len(manifest):
            chosen.append(column)
    return chosen


def scan_table(slices: pd.DataFrame) -> pd.DataFrame | None:
    """One row per scan of the joined slices: ``scan``, ``patient``, ``p_lesion`` (its most suspicious slice's, as
    ``scans.csv`` has it), ``positive`` (the manifest's scan label where there is one, else whether any slice holds a
    lesion; <NA> when a slice is unlabelled), ``slices``; None when the slices name no scan."""
    if slices[SCAN].isna().any():
        return None
    rows = []
    for scan, group in slices.groupby(SCAN, sort=False):
        truth, scan_label = group[POSITIVE], group[SCAN_POSITIVE]
        positive = bool(scan_label.iloc[0]) if scan_label.notna().all() else (
            bool(truth.any()) if truth.notna().all() else pd.NA)  # fmt: skip
        rows.append({SCANS.scan: scan, PATIENT: group[PATIENT].iloc[0], P_LESION: group[P_LESION].max(),
                     POSITIVE: positive, "slices": len(group)})  # fmt: skip
    out = pd.DataFrame(rows)
    out[POSITIVE] = out[POSITIVE].astype("boolean")
    return out
