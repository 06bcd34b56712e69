"""What makes a slice positive, defined once: its class is above 0 (0 = no lesion), or one of its multi-label columns
is 1. Negative when its class is 0, or every label column is 0; unknown otherwise (a missing label, or missing label
columns and no 1 among the others). A scan labelled as a whole (``scan_label``, ``scan_<name>``) holds a lesion when
one of its scan labels is above 0. The split's strata, the manifest's mask check, the scan-level labels, the W&B
overlays and the review all read this rule."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch


def lesion_labels(table: pd.DataFrame, label_columns: Sequence[str] | None = None) -> pd.Series:
    """Per row: True (a lesion), False (none) or <NA> (unlabelled), as a nullable boolean Series.

    Args:
        table: rows with ``label`` (an integer class) or the ``label_columns`` (0/1 each).
        label_columns: the multi-label columns; None reads ``label``.
    """
    if label_columns:
        labels = table[list(label_columns)].to_numpy(dtype=float, na_value=np.nan)  # NaN where missing (pandas 2.0)
        positive = (labels == 1).any(axis=1)
        known = positive | ~np.isnan(labels).any(axis=1)
    elif "label" in table.columns:
        known = table["label"].notna().to_numpy()
        positive = table["label"].fillna(0).to_numpy(dtype=float) > 0
    else:
        return pd.Series(pd.NA, index=table.index, dtype="boolean")
    return pd.Series(positive, index=table.index, dtype="boolean").where(known)


def scan_lesion_labels(table: pd.DataFrame) -> pd.Series | None:
    """Per row, whether its scan holds a lesion by the scan labels (True, False, or <NA> where unknown), as a nullable
    boolean Series; None when the table has no scan labels."""
    columns = table.attrs.get("scan_labels")
    if not columns:
        return None
    labels = table[list(columns)].to_numpy(dtype=float, na_value=np.nan)
    positive = (labels > 0).any(axis=1)
    known = positive | ~np.isnan(labels).any(axis=1)
    return pd.Series(positive, index=table.index, dtype="boolean").where(known)


def values_read_as_lesion(table: pd.DataFrame) -> str | None:
    """One line saying what a binary task assumes of a single-label manifest's classes above 1 (in ``label``, or in
    ``scan_label`` where it stands in for the slice labels): that each is a lesion, by the rule above; None when every
    value is 0 or 1 (or the table is multi-label, whose columns are 0/1 already).

    A manifest written for a multi-class task (``scan_label`` 2 for, say, a subdural bleed) still trains a binary model:
    the line says so once, instead of the value passing unnoticed.
    """
    if table.attrs.get("label_columns"):
        return None
    columns = list(table.attrs.get("scan_labels") or [])  # scan labels: the slice column holds only what they allow
    if not columns and "label" in table.columns:
        columns = ["label"]
    said = []
    for column in columns:
        values = sorted({int(v) for v in table[column].dropna() if v > 1})
        if values:
            shown = ", ".join(map(str, values[:5])) + (f" and {len(values) - 5} more" if len(values) > 5 else "")
            said.append(f"{column}: value{'s' * (len(values) > 1)} {shown} read as lesion")
    if not said:
        return None
    return f"manifest {table.attrs.get('manifest', '')}: {'; '.join(said)} (any value > 0 is a lesion in a binary task)"


def lesion_rows(table: pd.DataFrame, label_columns: Sequence[str] | None = None) -> np.ndarray:
    """Rows labelled with a lesion (:func:`lesion_labels`; unlabelled rows are not), as a bool array."""
    return lesion_labels(table, label_columns).fillna(False).to_numpy(dtype=bool)


def lesion_scan_rows(table: pd.DataFrame, label_columns: Sequence[str] | None = None) -> np.ndarray:
    """Rows labelled with a lesion, or of a scan labelled with one (:func:`scan_lesion_labels`), as a bool array."""
    rows = lesion_rows(table, label_columns)
    scans = scan_lesion_labels(table)
    return rows if scans is None else rows | scans.fillna(False).to_numpy(dtype=bool)


def lesion_label(label: torch.Tensor) -> torch.Tensor:
    """The same rule on a batch's labels (``(B,)`` classes, or ``(B, L)`` 0/1 labels; -1 where unknown): ``(B,)``
    int64, 1 for a lesion, 0 for none, -1 where unknown."""
    if label.ndim == 1:
        return torch.where(label < 0, -1, (label > 0).long())
    positive, negative = (label == 1).any(dim=1), (label == 0).all(dim=1)
    return torch.where(positive, 1, torch.where(negative, 0, -1))
