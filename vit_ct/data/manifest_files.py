"""The files a manifest names, checked before a run: every slice and mask read once by the loaders training uses,
each image file hashed (for copies of one image), and the unusable rows reported by CSV line or skipped.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
from rich.progress import MofNCompleteColumn, Progress

from vit_ct.data.dicom import CT_MODALITIES
from vit_ct.data.duplicates import check_duplicate_images, file_digest
from vit_ct.data.labels import lesion_rows
from vit_ct.data.reader import load_ct_slice, load_mask, read_modality

__all__ = ["BadFile", "validate_manifest_files", "write_bad_files"]


class BadFile(NamedTuple):
    """One unusable file found by `validate_manifest_files`."""

    line: int  # line number in the manifest CSV (header = line 1), or the 1-based row when the table has no CSV
    column: str  # "image" or "mask"
    path: str  # absolute path that was tried
    reason: str


def _check_row(
    image: str, frame: int | None, mask: str | None, positive: bool, read: dict
) -> tuple[list[tuple[str, str, str]], str | None]:
    """(column, path, reason) for each problem of one manifest row, and the digest of its image file.

    Reads the slice and mask with the loaders training uses, so whatever they would refuse in a worker later
    (NaN in a NIfTI or mask, values that are not HU, a soft mask) is found here, before the run starts.
    """
    try:
        shape = load_ct_slice(image, frame, **read).shape
        digest = file_digest(image)
    except Exception as e:  # UnreadableFileError, or anything unexpected from a decoder library
        return [("image", image, getattr(e, "reason", f"{type(e).__name__}: {e}"))], None
    if mask is None:
        return [], digest
    try:
        lesion = load_mask(mask, frame)
    except Exception as e:
        return [("mask", mask, getattr(e, "reason", f"{type(e).__name__}: {e}"))], digest
    if lesion.shape != shape:
        return [
            ("mask", mask, f"mask is {lesion.shape[0]}x{lesion.shape[1]} but the slice is {shape[0]}x{shape[1]}")
        ], digest
    if positive and not lesion.any():
        # An empty mask on a lesion slice would teach the patch head "no lesion anywhere" and drop the slice's
        # localisation score without a word.
        return [("mask", mask, "mask has no lesion pixel but the slice is labelled with a lesion")], digest
    return [], digest


def validate_manifest_files(
    df: pd.DataFrame,
    *,
    on_bad_file: str = "raise",
    progress: bool = True,
    modalities: Sequence[str] | None = CT_MODALITIES,
    stored_values_are_hu: bool = False,
) -> tuple[pd.DataFrame, list[BadFile]]:
    """Check every image and mask by reading it as training will, and find copies of one image.

    Each slice is read by `load_ct_slice` and each mask by `load_mask` (on a few threads), and each image file is
    hashed once. A row is bad when its image or mask cannot be used, the mask's size differs from the slice's, or a
    row labelled with a lesion has an empty mask.

    Args:
        df: a manifest table (`read_manifest`); uses `image`, and `mask`, `slice`, `label` (or the label columns),
            `manifest_line` when present.
        on_bad_file: "raise" to raise one error listing every bad row, or "skip" to drop those rows.
        progress: show a rich progress bar.
        modalities: DICOM Modality values accepted (`load_ct_slice`); None accepts any.
        stored_values_are_hu: accept CT DICOM without rescale tags, stored values taken as HU (`load_ct_slice`).

    Returns:
        The good rows (index kept) with an `image_digest` column (the hash of the image file's bytes), and the list of
        problems found, one `BadFile` per problem.

    Raises:
        ValueError: with `on_bad_file="raise"` when any file is unusable: every bad row with its CSV line, path
            and reason. Also (either way) when copies of one image have different labels or splits.
    """
    if on_bad_file not in ("raise", "skip"):
        raise ValueError(f"on_bad_file must be 'raise' or 'skip', got {on_bad_file!r}")
    if "image" not in df.columns:
        raise ValueError("the manifest table has no 'image' column")
    has_lines = "manifest_line" in df.columns
    lines = df["manifest_line"].tolist() if has_lines else list(range(1, len(df) + 1))
    frames = df["slice"].tolist() if "slice" in df.columns else [None] * len(df)
    masks = df["mask"].tolist() if "mask" in df.columns else [None] * len(df)
    read = {
        "modalities": None if modalities is None else tuple(modalities),
        "stored_values_are_hu": stored_values_are_hu,
    }
    jobs = [
        (
            str(image),
            None if pd.isna(frame) else int(frame),
            None if mask is None or pd.isna(mask) else str(mask),
            positive,
        )
        for image, frame, mask, positive in zip(
            df["image"], frames, masks, lesion_rows(df, df.attrs.get("label_columns")), strict=True
        )
    ]
    found: dict[int, list[tuple[str, str, str]]] = {}
    digests: list[str | None] = [None] * len(jobs)
    with (
        Progress(*Progress.get_default_columns(), MofNCompleteColumn(), disable=not progress) as bar,
        ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 1) + 4)) as pool,
    ):
        task = bar.add_task("Checking manifest files", total=len(jobs))
        futures = {pool.submit(_check_row, *job, read): i for i, job in enumerate(jobs)}
        for future in as_completed(futures):
            problems, digests[futures[future]] = future.result()
            if problems:
                found[futures[future]] = problems
            bar.advance(task)
    bad = [BadFile(int(lines[i]), *problem) for i in sorted(found) for problem in found[i]]
    if bad and on_bad_file == "raise":
        where = f"line number in {df.attrs['manifest']}" if has_lines and df.attrs.get("manifest") else "1-based row"
        word = "line" if has_lines else "row"
        listing = "\n".join(f"  {word} {b.line}: {b.column} {b.path}: {b.reason}" for b in bad)
        raise ValueError(
            f"{len(found)} of {len(df)} manifest rows name unusable files ({word} = {where}):\n{listing}\n"
            "Fix or remove these rows, or skip them (on_bad_file='skip')."
        )
    keep = np.ones(len(df), dtype=bool)
    keep[list(found)] = False
    good = df.assign(image_digest=digests)[keep]
    where = f"manifest {df.attrs.get('manifest', '')}".rstrip()
    if read["modalities"] != CT_MODALITIES:
        _warn_other_modalities(good, where, read["modalities"])
    check_duplicate_images(good, where)
    return good, bad


def _warn_other_modalities(df: pd.DataFrame, where: str, modalities: tuple[str, ...] | None) -> None:
    """Accepted non-CT slices are counted once per manifest, so their share is never a surprise."""
    found = pd.Series([read_modality(image) for image in df["image"]], dtype=object).dropna()
    other = found[found != "CT"].replace("", "no Modality").value_counts()
    if other.empty:
        return
    counts = ", ".join(f"{name} {count}" for name, count in other.items())
    warnings.warn(
        f"{where}: {other.sum()} of {len(df)} slices are not CT ({counts}), accepted by modalities={modalities}:"
        " their values are used as if they were Hounsfield units",
        UserWarning,
        stacklevel=3,
    )


def write_bad_files(bad: Sequence[BadFile], path: str | os.PathLike) -> Path:
    """Write the rows `validate_manifest_files` skipped as a CSV (line, column, path, reason) and return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(list(bad), columns=list(BadFile._fields)).to_csv(path, index=False)
    return path
