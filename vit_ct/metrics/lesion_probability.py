"""Scans: P(lesion) of a slice defined once (training, predict and the review share it), and the scan-level
results built from slices: a scan's probability is its most suspicious slice's, and a scan is positive when any of its
slices is (clinical ICH triage and the CQ500 benchmark score scans, not slices)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import pandas as pd
import torch
from torchmetrics.functional.classification import binary_auroc

from vit_ct.metrics.schema import PREDICTIONS, SCANS

Task = Literal["binary", "multiclass", "multilabel"]
ANY = "any"  # the label of RSNA 2019 (and of any multi-label set that names one) that says "some lesion"


def lesion_scores(probs: torch.Tensor, task: Task, class_names: Sequence[str] | None = None) -> torch.Tensor:
    """P(lesion) ``(B,)`` from the model's probabilities: binary as they are, multi-class 1 - P(class 0),
    multi-label the ``any`` label where there is one, else the largest label probability.

    Args:
        probs: ``(B,)`` for binary, ``(B, num_classes)`` otherwise (:meth:`ViTClassifier.probabilities`).
        task: ``binary``, ``multiclass`` or ``multilabel``.
        class_names: the outputs' names (multi-label: the label columns).
    """
    if task == "binary":
        return probs
    if task == "multiclass":
        return 1.0 - probs[:, 0]
    names = list(class_names or [])
    return probs[:, names.index(ANY)] if ANY in names else probs.max(dim=1).values


def lesion_probability(
    predictions: pd.DataFrame, task: Task, class_names: Sequence[str], *, in_scan: bool = False
) -> pd.Series:
    """:func:`lesion_scores` of the rows of a ``predictions.csv`` (``prob``, or a ``prob_<name>`` column per output;
    with ``in_scan``, ``prob_in_scan``...)."""
    columns = PREDICTIONS.probs(task, class_names, in_scan=in_scan)
    columns = columns[0] if task == "binary" else columns
    probs = torch.from_numpy(np.array(predictions[columns], dtype=np.float64))  # a copy: pandas' arrays are read-only
    return pd.Series(lesion_scores(probs, task, class_names).numpy(), index=predictions.index)


def has_in_scan_columns(predictions: pd.DataFrame, task: Task, class_names: Sequence[str]) -> bool:
    """Whether the rows of a ``predictions.csv`` hold each slice's probabilities in its scan too (``prob_in_scan``...:
    a model with a sequence head wrote them)."""
    return all(column in predictions for column in PREDICTIONS.probs(task, class_names, in_scan=True))


def scan_column(table: pd.DataFrame) -> str | None:
    """The column that names each slice's scan: ``scan`` (scans, or a manifest from ``vit-ct manifest``), else
    ``patient_id`` (one scan per patient, as in the synthetic set); None when the table has neither."""
    for column in ("scan", "patient_id"):
        if column in table.columns and table[column].notna().all():
            return column
    return None


def scan_summary(slices: pd.DataFrame, key: str) -> pd.DataFrame:
    """One row per scan from per-slice rows (``key``, ``order``, ``image``, ``p_lesion``, ``positive``).

    Columns: ``scan``, ``n_slices``, ``prob`` (the maximum of the slices' P(lesion): a scan holds a lesion when one
    slice does), ``peak_slice`` (index along the scan, as ``k`` of the NIfTI volume), ``peak_image``,
    ``slice_probs`` (';'-separated, in scan order), and ``label`` (1 when any slice is positive, 0 when all are
    negative, empty when a slice's label is unknown).
    """
    rows = []
    for scan, group in slices.sort_values([key, SCANS.order]).groupby(key, sort=False):
        probs = group[SCANS.p_lesion].to_numpy(dtype=float)
        peak = int(np.argmax(probs))
        known = group[SCANS.positive].notna().all()
        rows.append(
            {
                SCANS.scan: scan,
                SCANS.n_slices: len(group),
                SCANS.prob: float(probs[peak]),
                SCANS.peak_slice: peak,
                SCANS.peak_image: group[PREDICTIONS.image].iloc[peak],
                SCANS.label: int(group[SCANS.positive].any()) if known else pd.NA,
                SCANS.slice_probs: ";".join(f"{p:.4f}" for p in probs),
            }
        )
    table = pd.DataFrame(rows)
    table[SCANS.label] = table[SCANS.label].astype("Int64")
    return table


def scan_auroc(scans: pd.DataFrame) -> float:
    """AUROC of the scans' probabilities against their labels (NaN without both classes)."""
    known = scans[scans[SCANS.label].notna()]
    if known[SCANS.label].nunique() < 2:
        return float("nan")
    probs, labels = known[SCANS.prob].to_numpy(float), known[SCANS.label].to_numpy(int)
    return float(binary_auroc(torch.tensor(probs), torch.tensor(labels)))
