"""What makes a slice positive, defined once: its class is above 0 (0 = no lesion), or one of its multi-label columns
is 1. Negative when its class is 0, or every label column is 0; unknown otherwise (a missing label, or missing label
columns and no 1 among the others). The split's strata, the manifest's mask check, the scan-level labels, the W&B
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


def lesion_rows(table: pd.DataFrame, label_columns: Sequence[str] | None = None) -> np.ndarray:
    """Rows labelled with a lesion (:func:`lesion_labels`; unlabelled rows are not), as a bool array."""
    return lesion_labels(table, label_columns).fillna(False).to_numpy(dtype=bool)


def lesion_label(label: torch.Tensor) -> torch.Tensor:
    """The same rule on a batch's labels (``(B,)`` classes, or ``(B, L)`` 0/1 labels; -1 where unknown): ``(B,)``
    int64, 1 for a lesion, 0 for none, -1 where unknown."""
    if label.ndim == 1:
        return torch.where(label < 0, -1, (label > 0).long())
    positive, negative = (label == 1).any(dim=1), (label == 0).all(dim=1)
    return torch.where(positive, 1, torch.where(negative, 0, -1))
