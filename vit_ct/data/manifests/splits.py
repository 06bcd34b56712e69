"""Seeded train/val/test split of a manifest by patient, stratified by lesion presence, so that no patient's
slices land in two splits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from vit_ct.data.manifests.labels import lesion_scan_rows

SPLITS = ("train", "val", "test")
SPLIT_FRACTIONS = (0.7, 0.15, 0.15)  # train / val / test shares of the patients when a manifest names no split
_MAX_LISTED = 20  # line numbers named in one error message


def list_lines(values: Sequence[int]) -> str:
    """Line numbers for an error message, the first 20 named and the rest counted."""
    shown = ", ".join(str(v) for v in values[:_MAX_LISTED])
    return shown + (f" (and {len(values) - _MAX_LISTED} more)" if len(values) > _MAX_LISTED else "")


def image_keys(df: pd.DataFrame) -> pd.Series:
    """One key per distinct image: the file's digest (``image_digest``, from the manifest check) or, without one, its
    path; plus the slice index, since the slices of one volume are different images."""
    if "image_digest" in df.columns:
        files = df["image_digest"]
    elif "image" in df.columns:
        files = df["image"]
    else:
        files = pd.Series([f"row:{i}" for i in range(len(df))], index=df.index)
    frames = df["slice"] if "slice" in df.columns else pd.Series(pd.NA, index=df.index)
    return pd.Series(
        [f"{file}#{'' if pd.isna(frame) else int(frame)}" for file, frame in zip(files, frames, strict=True)],
        index=df.index,
    )


def check_patient_splits(df: pd.DataFrame, where: str) -> None:
    """A patient given two different splits would leak slices between training and evaluation."""
    if "patient_id" not in df.columns or "split" not in df.columns:
        return
    given = df[df["patient_id"].notna() & df["split"].notna()]
    problems = []
    for patient, group in given.groupby("patient_id", sort=True):
        if group["split"].nunique() > 1:
            splits = ", ".join(f"{s} (lines {list_lines(list(g['manifest_line']))})" for s, g in group.groupby("split"))
            problems.append(f"patient {patient!r}: {splits}")
    if problems:
        raise ValueError(f"{where}: patients appear in more than one split:\n  " + "\n  ".join(problems))


def _split_groups(df: pd.DataFrame) -> pd.Series:
    """One key per group of rows that must share a split: the rows of a patient (a row without `patient_id` is its
    own patient), joined with every other patient's rows that hold a copy of one of its images."""
    patients = df["patient_id"] if "patient_id" in df.columns else pd.Series(None, index=df.index, dtype=object)
    keys = [f"patient:{p}" if pd.notna(p) else f"row:{i}" for i, p in enumerate(patients)]
    parent = {key: key for key in keys}

    def root(key: str) -> str:
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    first: dict[str, str] = {}  # image key -> the group of its first copy
    for key, image in zip(keys, image_keys(df), strict=True):
        if image in first:
            parent[root(key)] = root(first[image])
        else:
            first[image] = key
    return pd.Series([root(key) for key in keys], index=df.index)


def assign_splits(
    df: pd.DataFrame,
    *,
    fractions: Sequence[float] = SPLIT_FRACTIONS,
    seed: int = 0,
    label_columns: Sequence[str] | None = None,
) -> pd.DataFrame:
    """Fill missing `split` values with a seeded split by patient, stratified by lesion presence.

    Rows that already have a split keep it, and unsplit rows of such a patient join it. Copies of one image (same
    path, or same file content by `image_digest`) join one group with their patients. The other patients (a row
    without `patient_id` is its own patient) are shuffled with `seed`; within the patients with and without a lesion
    separately, each split with a non-zero fraction first gets one patient when there are enough, then every
    patient goes to the split furthest below its share of slices. Deterministic for a given table and seed.

    Args:
        df: a manifest table (`read_manifest`).
        fractions: shares of slices for train, val and test; non-negative, summing to 1.
        seed: random seed of the shuffle.
        label_columns: multi-label columns (a row is positive if any is 1); default `df.attrs["label_columns"]`,
            else `label` > 0.

    Returns:
        A copy of `df` whose `split` column is filled for every row.
    """
    fractions = tuple(float(f) for f in fractions)
    if len(fractions) != 3 or any(not f >= 0 for f in fractions) or not math.isclose(sum(fractions), 1.0):
        raise ValueError(f"fractions must be 3 non-negative shares (train, val, test) summing to 1, got {fractions}")
    out = df.copy()
    if "split" not in out.columns:
        out["split"] = None
    out["split"] = out["split"].astype(object).where(out["split"].notna(), None)
    if not out["split"].dropna().isin(SPLITS).all():
        raise ValueError(f"split values must be one of {SPLITS} or missing, got {sorted(set(out['split'].dropna()))}")
    check_patient_splits(out, "assign_splits")
    if out["split"].notna().all():
        return out

    keys = _split_groups(out)
    given = out["split"].notna()
    mixed = out[given].groupby(keys[given])["split"].nunique() > 1
    if mixed.any():
        lines = (
            out["manifest_line"]
            if "manifest_line" in out.columns
            else pd.Series(range(1, len(out) + 1), index=out.index)
        )
        groups = [list_lines(list(lines[keys == key])) for key in mixed.index[mixed]]
        raise ValueError(
            "assign_splits: rows that must share a split (one patient, or copies of one image) are given different"
            " splits, on lines " + "; ".join(groups)
        )
    known = out.loc[given].groupby(keys[given])["split"].first()
    fill = keys.map(known)
    out["split"] = out["split"].where(out["split"].notna(), fill)

    positive = pd.Series(lesion_scan_rows(out, label_columns or df.attrs.get("label_columns")), index=out.index)
    group_positive = positive.groupby(keys).any()
    group_size = keys.value_counts()
    open_groups = sorted(set(keys[out["split"].isna()]))
    rng = np.random.default_rng(seed)
    share = dict(zip(SPLITS, fractions, strict=True))
    assigned: dict[str, str] = {}
    for stratum in (True, False):
        members = [g for g in open_groups if group_positive[g] == stratum]
        members = [members[i] for i in rng.permutation(len(members))]
        in_stratum = keys.map(group_positive) == stratum
        count = {s: int(((out["split"] == s) & in_stratum).sum()) for s in SPLITS}
        total = int(in_stratum.sum())
        for split in SPLITS:  # every split gets a patient of this stratum when there are enough
            if share[split] > 0 and count[split] == 0 and members:
                group = members.pop(0)
                assigned[group] = split
                count[split] += int(group_size[group])
        for group in members:
            split = max((s for s in SPLITS if share[s] > 0), key=lambda s: share[s] * total - count[s])
            assigned[group] = split
            count[split] += int(group_size[group])
    out["split"] = out["split"].where(out["split"].notna(), keys.map(assigned))
    return out
