"""The same image listed more than once in a manifest, by path or by identical file content under another name.

Copies must share one split (else the model is scored on images it trained on) and one label (else one of them is
wrong). Identity is the hash of the file's bytes, computed once per file by the manifest check, plus the slice index.
"""

from __future__ import annotations

import hashlib
import os
import warnings

import pandas as pd

from vit_ct.data.manifests.splits import image_keys, list_lines

_CHUNK = 1 << 20  # bytes read at a time while hashing


def file_digest(path: str | os.PathLike) -> str:
    """BLAKE2b of the file's bytes (hex): equal for byte-identical files under any name."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _labels(df: pd.DataFrame) -> pd.Series:
    columns = df.attrs.get("label_columns") or (["label"] if "label" in df.columns else [])
    return df[columns].astype(object).apply(lambda row: tuple(None if pd.isna(v) else int(v) for v in row), axis=1)


def check_duplicate_images(df: pd.DataFrame, where: str) -> None:
    """Refuse copies of one image with different labels or different given splits; warn once about the others.

    Args:
        df: a manifest table, with ``image_digest`` when its files were checked (`validate_manifest_files`).
        where: names the manifest in messages.

    Raises:
        ValueError: naming the CSV lines of each image whose copies disagree on their label or split.
    """
    if df.empty:
        return
    keys = image_keys(df)
    repeated = keys.duplicated(keep=False)
    if not repeated.any():
        return
    lines = df["manifest_line"] if "manifest_line" in df.columns else pd.Series(range(1, len(df) + 1), index=df.index)
    labels = _labels(df) if (df.attrs.get("label_columns") or "label" in df.columns) else None
    problems, by_path, by_content = [], [], []
    for _, group in df[repeated].groupby(keys[repeated], sort=False):
        rows = list(lines[group.index])
        if labels is not None:
            known = {value for value in labels[group.index] if None not in value}
            if len(known) > 1:
                problems.append(f"lines {list_lines(rows)} list one image with different labels")
        if "split" in group.columns and group["split"].dropna().nunique() > 1:
            problems.append(f"lines {list_lines(rows)} list one image in different splits")
        (by_path if group["image"].nunique() == 1 else by_content).append(rows)
    if problems:
        raise ValueError(
            f"{where}: copies of an image disagree (same path, or identical file content under another name):\n  "
            + "\n  ".join(problems)
        )

    def listing(groups: list[list[int]]) -> str:
        shown = "; ".join(list_lines(rows) for rows in groups[:5])
        return shown + (f"; and {len(groups) - 5} more images" if len(groups) > 5 else "")

    found = []
    if by_path:
        found.append(f"{len(by_path)} images listed more than once by the same path (lines {listing(by_path)})")
    if by_content:
        found.append(
            f"{len(by_content)} images stored as identical files under other names (lines {listing(by_content)})"
        )
    warnings.warn(
        f"{where}: {' and '.join(found)}; each image's copies are kept in one split", UserWarning, stacklevel=2
    )
