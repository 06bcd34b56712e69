"""The manifest CSV that lists a user's own CT slices: read and check it, and check its files (the split by patient
is `vit_ct.data.splits`).

Columns (the README's manifest table): `image`, `label` (or named label columns), `patient_id`, `split`, `mask`,
`slice`.
Rows are named by their line number in the CSV file (the header is line 1), as a text editor or spreadsheet shows.
"""

from __future__ import annotations

import csv
import math
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
from vit_ct.data.reader import load_ct_slice, load_mask, read_modality
from vit_ct.data.splits import SPLITS, assign_splits, check_patient_splits, list_lines

__all__ = [
    "SPLITS",
    "BadFile",
    "assign_splits",
    "check_duplicate_images",
    "check_label_range",
    "read_manifest",
    "validate_manifest_files",
    "write_bad_files",
]


class BadFile(NamedTuple):
    """One unusable file found by `validate_manifest_files`."""

    line: int  # line number in the manifest CSV (header = line 1), or the 1-based row when the table has no CSV
    column: str  # "image" or "mask"
    path: str  # absolute path that was tried
    reason: str


def manifest_frame(row: pd.Series) -> int | None:
    """The row's ``slice`` (frame of a multi-frame DICOM, index along the last axis of a volume), None if empty."""
    value = row.get("slice")
    return None if value is None or pd.isna(value) else int(value)


def _read_rows(path: Path) -> tuple[list[str], list[list[str]], list[int]]:
    """Header, data rows and the CSV line each row starts on; the csv module keeps line numbers exact."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:  # -sig: spreadsheets often write a byte-order mark
            reader = csv.reader(f)
            header: list[str] | None = None
            rows, lines = [], []
            start = 1
            for record in reader:
                if any(cell.strip() for cell in record):
                    if header is None:
                        header = [cell.strip() for cell in record]
                    else:
                        rows.append(record)
                        lines.append(start)
                start = reader.line_num + 1
    except (UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"manifest {path} is not a readable UTF-8 CSV: {e}") from None
    if header is None:
        raise ValueError(f"manifest {path} is empty; expected a CSV with a header row such as image,label,patient_id")
    bad = [line for line, row in zip(lines, rows, strict=True) if len(row) > len(header)]
    if bad:
        raise ValueError(f"manifest {path}: lines {list_lines(bad)} have more fields than the header ({len(header)})")
    return header, rows, lines


def _integers(df: pd.DataFrame, column: str, path: Path, *, allowed: str, valid, required: bool) -> pd.Series:
    """Parse a text column of whole numbers ("3", "3.0"); empty cells are <NA> unless `required`."""
    values, bad = [], []
    for text, line in zip(df[column], df["manifest_line"], strict=True):
        if text == "":
            values.append(pd.NA)
            if required:
                bad.append(line)
            continue
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if not (number.is_integer() and valid(int(number))):
            bad.append(line)
            values.append(pd.NA)
        else:
            values.append(int(number))
    if bad:
        raise ValueError(
            f"manifest {path}: column '{column}' must hold {allowed}; bad value on lines {list_lines(bad)}"
        )
    return pd.Series(values, index=df.index, dtype="Int64")


def _blank_to_none(texts: pd.Series) -> pd.Series:
    return pd.Series([None if t == "" or pd.isna(t) else t for t in texts], index=texts.index, dtype=object)


def _resolve(texts: pd.Series, folder: Path) -> pd.Series:
    def one(text: str):
        if text == "":
            return None
        p = Path(os.path.expanduser(text))
        return os.path.normpath(p if p.is_absolute() else folder / p)

    return pd.Series([one(t) for t in texts], index=texts.index, dtype=object)


def read_manifest(
    path: str | os.PathLike, *, label_columns: Sequence[str] | None = None, require_labels: bool = True
) -> pd.DataFrame:
    """Read and check a manifest CSV.

    Args:
        path: the CSV file. Relative `image`/`mask` paths are taken relative to its folder.
        label_columns: names of 0/1 columns for multi-label data (e.g. RSNA's five ICH types); `None` means one
            integer `label` column (0 = no lesion).
        require_labels: if False, unlabelled rows (empty label cells, or no `label` column at all) are allowed and
            get <NA>, e.g. for prediction on new data.

    Returns:
        One row per slice: `image` and `mask` as absolute paths (`image_ref`, `mask_ref`: the text as written),
        the label column(s) as Int64, `patient_id` and `split` (lower case) as text or <NA>, `slice` as Int64 or <NA>,
        `manifest_line` (the row's line in the CSV), and any other columns untouched as text.
        `df.attrs["label_columns"]` holds the multi-label names (or None) and `df.attrs["manifest"]` the CSV path.

    Raises:
        ValueError: naming the file and the CSV line numbers, for a missing/empty/unreadable CSV, a missing `image`,
            `label` or named label column, empty image cells, labels that are not integers >= 0 (0/1 for
            multi-label), unknown split names, a bad `slice`, or a patient given two different splits.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"manifest {path} not found")
    header, rows, lines = _read_rows(path)
    if not rows:
        raise ValueError(f"manifest {path} has a header but no data rows")
    dupes = sorted({c for c in header if header.count(c) > 1})
    if dupes:
        raise ValueError(f"manifest {path}: column(s) {dupes} appear more than once in the header")
    width = len(header)
    df = pd.DataFrame([[cell.strip() for cell in row] + [""] * (width - len(row)) for row in rows], columns=header)
    df = df.astype(object)
    df["manifest_line"] = lines

    def need(column: str, why: str) -> None:
        if column not in df.columns:
            hint = ""
            if len(header) == 1 and any(sep in header[0] for sep in ";\t|"):
                hint = f" (the header reads {header[0]!r}: is the file comma-separated?)"
            raise ValueError(f"manifest {path} lacks the '{column}' column {why}; header: {header}{hint}")

    need("image", "(path of each slice)")
    empty = [line for text, line in zip(df["image"], lines, strict=True) if text == ""]
    if empty:
        raise ValueError(f"manifest {path}: empty 'image' on lines {list_lines(empty)}")
    folder = path.resolve().parent
    df["image_ref"] = df["image"]
    df["image"] = _resolve(df["image"], folder)

    if label_columns is None:
        if "label" in df.columns:
            df["label"] = _integers(
                df, "label", path, allowed="integers >= 0", valid=lambda v: v >= 0, required=require_labels
            )
        elif require_labels:
            need("label", "(integer class, 0 = no lesion; or pass label_columns for multi-label data)")
        else:
            df["label"] = pd.array([pd.NA] * len(df), dtype="Int64")
    else:
        label_columns = [label_columns] if isinstance(label_columns, str) else list(label_columns)
        if not label_columns:
            raise ValueError("label_columns is empty; give the names of the 0/1 label columns, or None")
        for column in label_columns:
            need(column, "(named in label_columns)")
            df[column] = _integers(
                df, column, path, allowed="0 or 1", valid=lambda v: v in (0, 1), required=require_labels
            )

    if "mask" in df.columns:
        df["mask_ref"] = _blank_to_none(df["mask"])
        df["mask"] = _resolve(df["mask"], folder)
    if "slice" in df.columns:
        df["slice"] = _integers(df, "slice", path, allowed="integers >= 0", valid=lambda v: v >= 0, required=False)
    if "patient_id" in df.columns:
        df["patient_id"] = _blank_to_none(df["patient_id"])
    if "split" in df.columns:
        df["split"] = _blank_to_none(df["split"].str.lower())
        unknown = [line for s, line in zip(df["split"], lines, strict=True) if s is not None and s not in SPLITS]
        if unknown:
            raise ValueError(
                f"manifest {path}: 'split' must be one of {', '.join(SPLITS)} or empty;"
                f" bad on lines {list_lines(unknown)}"
            )
        check_patient_splits(df, f"manifest {path}")
    df.attrs["label_columns"] = label_columns
    df.attrs["manifest"] = str(path)
    return df


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


def _positive(df: pd.DataFrame) -> list[bool]:
    """Rows labelled with a lesion (class > 0, or any multi-label column 1); unlabelled rows are not."""
    columns = df.attrs.get("label_columns")
    if columns:
        return [bool(v) for v in (df[list(columns)].fillna(0).to_numpy(dtype=float) == 1).any(axis=1)]
    if "label" in df.columns:
        return [bool(v) for v in df["label"].fillna(0).to_numpy(dtype=float) > 0]
    return [False] * len(df)


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
        for image, frame, mask, positive in zip(df["image"], frames, masks, _positive(df), strict=True)
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


def check_label_range(df: pd.DataFrame, num_classes: int, *, option: str = "--model.num_classes") -> None:
    """Check that every single-label row's class fits a model with `num_classes` outputs.

    Multi-label tables (`df.attrs["label_columns"]`) hold 0/1 columns, already checked by `read_manifest`.

    Raises:
        ValueError: naming the manifest, the lines whose label is `num_classes` or more, and `option`.
    """
    if df.attrs.get("label_columns") or "label" not in df.columns:
        return
    labels = df["label"]
    over = labels.notna() & (labels.fillna(0) >= num_classes)
    if over.any():
        lines = df.loc[over, "manifest_line"].tolist() if "manifest_line" in df.columns else list(df.index[over])
        where = f"manifest {df.attrs.get('manifest', '')}"
        raise ValueError(
            f"{where}: labels must be 0..{num_classes - 1} for num_classes={num_classes}"
            f" but reach {int(labels[over].max())} on lines {list_lines(lines)}; set {option} {int(labels.max()) + 1}"
            " or fix those rows"
        )


def write_bad_files(bad: Sequence[BadFile], path: str | os.PathLike) -> Path:
    """Write the rows `validate_manifest_files` skipped as a CSV (line, column, path, reason) and return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(list(bad), columns=list(BadFile._fields)).to_csv(path, index=False)
    return path
