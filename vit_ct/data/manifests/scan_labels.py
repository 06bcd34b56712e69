"""Scan-level labels: one label per scan (a report's verdict, CQ500's reads), repeated on each of its rows as
``scan_label`` (or ``scan_<name>`` beside multi-label columns ``<name>``).

A manifest with scan labels and no slice labels trains by multiple-instance learning (the scan is the bag, its slices
the instances; :mod:`vit_ct.task.scan_bags`). What that allows to say of a slice is written as its slice label: a
slice of a lesion-free scan is lesion-free (0); a slice of a scan with a lesion is unknown (<NA>), since most of its
slices show none. A slice label given in the manifest always wins: scan labels stand in only for a missing column.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from vit_ct.data.manifests.splits import list_lines

SCAN_PREFIX = "scan_"
SCAN_LABEL = "scan_label"  # the scan label beside single-label data (`label`)


def scan_label_column(slice_column: str) -> str:
    """The scan-label column standing for a slice-label column: ``label`` -> ``scan_label``, ``sdh`` -> ``scan_sdh``."""
    return SCAN_LABEL if slice_column == "label" else f"{SCAN_PREFIX}{slice_column}"


def scan_key(table: pd.DataFrame) -> str | None:
    """The column that names each row's scan: ``scan`` (as ``vit-ct manifest`` writes it), else ``patient_id`` (one scan
    per patient); None when neither names every row."""
    for column in ("scan", "patient_id"):
        if column in table.columns and table[column].notna().all() and (table[column] != "").all():
            return column
    return None


def derive_slice_labels(
    df: pd.DataFrame, pairs: Sequence[tuple[str, str]], path: str | os.PathLike, *, parse
) -> list[str]:
    """Parse the scan-label columns of ``pairs`` (slice column, scan column), check that each scan's rows agree, and
    write each slice column as the scan labels allow (0 on a lesion-free scan, <NA> otherwise).

    Args:
        df: the manifest's rows, text cells, ``manifest_line``; its scan key column already parsed.
        pairs: (slice-label column to write, scan-label column to read).
        path: the manifest, for messages.
        parse: ``parse(column) -> Int64 Series`` of a label column, checking its values (the manifest's rule).

    Returns:
        The scan-label columns, in the order of ``pairs``.

    Raises:
        ValueError: naming the manifest and the lines: no scan key, or one scan's rows with two values.
    """
    key = scan_key(df)
    if key is None:
        raise ValueError(
            f"manifest {path}: scan labels ({', '.join(s for _, s in pairs)}) need each row's scan: a 'scan' column"
            " (or 'patient_id', one scan per patient) filled on every row"
        )
    for slice_column, scan_column in pairs:
        labels = parse(scan_column)
        df[scan_column] = labels
        values = labels.astype("float64").fillna(-1.0)  # an empty cell is a value of its own: it must agree too
        mixed = values.groupby(df[key]).nunique() > 1
        if mixed.any():
            groups = [list_lines(df.loc[df[key] == scan, "manifest_line"].tolist()) for scan in mixed.index[mixed][:5]]
            more = f" (and {int(mixed.sum()) - 5} more scans)" if mixed.sum() > 5 else ""
            raise ValueError(
                f"manifest {path}: '{scan_column}' is one label per scan, the same on each of its rows ('{key}'), but"
                f" differs within scans on lines {'; '.join(groups)}{more}"
            )
        df[slice_column] = labels.mask(labels > 0)  # 0 on a lesion-free scan; unknown on one with a lesion
    return [scan for _, scan in pairs]


def scan_labels_tensor(table: pd.DataFrame) -> torch.Tensor | None:
    """``(N,)`` scan labels of single-label data or ``(N, L)`` 0/1 per label, int64, -1 where unknown; None when the
    table trains from slice labels (``table.attrs["scan_labels"]`` empty)."""
    columns = table.attrs.get("scan_labels")
    if not columns:
        return None
    values = table[columns[0]] if columns == [SCAN_LABEL] else table[list(columns)]
    return torch.from_numpy(values.astype("Int64").fillna(-1).to_numpy(dtype=np.int64))


def scan_ids(table: pd.DataFrame) -> np.ndarray:
    """``(N,)`` int64: each row's scan as a number, the same for the rows of one scan (:func:`scan_key`)."""
    key = scan_key(table)
    if key is None:
        raise ValueError(f"manifest {table.attrs.get('manifest', '')}: no 'scan' or 'patient_id' on every row")
    return pd.factorize(table[key])[0].astype(np.int64)
