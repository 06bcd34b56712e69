"""The manifest CSV that lists a user's own CT slices: read and check it, and check its files (the split by patient
is `vit_ct.data.manifests.splits`).

Its files are checked by `vit_ct.data.manifests.manifest_files` (re-exported here).

Columns (the README's manifest table): `image`, `label` (or named label columns; or scan labels, one per scan:
`scan_label`, `scan_<name>`, see `vit_ct.data.manifests.scan_labels`), `patient_id`, `scan`, `split`, `mask`, `slice`,
`pixel_spacing_mm`.
Rows are named by their line number in the CSV file (the header is line 1), as a text editor or spreadsheet shows.
"""

from __future__ import annotations

import csv
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from vit_ct.data.manifests.duplicates import check_duplicate_images
from vit_ct.data.manifests.manifest_files import BadFile, validate_manifest_files, write_bad_files
from vit_ct.data.manifests.scan_labels import SCAN_LABEL, derive_slice_labels, scan_label_column
from vit_ct.data.manifests.splits import SPLITS, assign_splits, check_patient_splits, list_lines

# mm per pixel of slices whose files carry no spacing (.npy); a DICOM's or NIfTI's own header wins
SPACING_COLUMN = "pixel_spacing_mm"

__all__ = [
    "SPACING_COLUMN",
    "SPLITS",
    "BadFile",
    "assign_splits",
    "check_duplicate_images",
    "check_label_range",
    "read_manifest",
    "validate_manifest_files",
    "write_bad_files",
]


def check_replaceable_manifest(path: str | os.PathLike) -> None:
    """``--overwrite`` replaces a manifest, never another file: refuse an existing ``path`` whose header names no
    ``image`` column (a file of the user's that merely has the name), naming it."""
    path = Path(path)
    if not path.is_file():
        return
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            header = next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError, csv.Error):
        header = []
    if "image" not in [column.strip() for column in header]:
        raise ValueError(
            f"{path} exists and is not a manifest (its first line names no image column); --overwrite replaces only a"
            " manifest: choose another output name, or move that file"
        )


def manifest_frame(row: pd.Series) -> int | None:
    """The row's ``slice`` (frame of a multi-frame DICOM, index along the last axis of a volume), None if empty."""
    return frame_number(row.get("slice"))


def frame_number(value) -> int | None:
    """A frame number as a table holds it: None for a single-frame file (pandas holds an empty one as NaN or <NA>)."""
    return None if value is None or pd.isna(value) else int(value)


def _not_utf8(path: Path) -> str:
    """Where a manifest is not UTF-8, by line and with its bad bytes escaped: e.g. a file name in another encoding
    (``slice\\xff.dcm``), which no UTF-8 CSV can list as it is."""
    data = path.read_bytes()
    try:
        data.decode("utf-8-sig")
    except UnicodeDecodeError as e:  # over the whole file, so that e.start is a position in it
        line = data.count(b"\n", 0, e.start) + 1
        text = data.splitlines()[line - 1].decode("utf-8", "backslashreplace")
        return (
            f"manifest {path} is not UTF-8 text: line {line} holds byte(s) of another encoding (shown as \\x..:"
            f" {text}); a manifest is a UTF-8 CSV, so a file whose name is not UTF-8 cannot be listed as it is: rename"
            " the file to UTF-8 and the line with it, or save the CSV as UTF-8"
        )
    return f"manifest {path} is not UTF-8 text"


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
    except UnicodeDecodeError:
        raise ValueError(_not_utf8(path)) from None
    except csv.Error as e:
        raise ValueError(f"manifest {path} is not a readable UTF-8 CSV: {e}") from None
    if header is None:
        raise ValueError(f"manifest {path} is empty; expected a CSV with a header row such as image,label,patient_id")
    bad = [line for line, row in zip(lines, rows, strict=True) if len(row) > len(header)]
    if bad:
        raise ValueError(f"manifest {path}: lines {list_lines(bad)} have more fields than the header ({len(header)})")
    return header, rows, lines


def _integers(
    df: pd.DataFrame, column: str, path: Path, *, allowed: str, valid, required: bool, blank_note: str = ""
) -> pd.Series:
    """Parse a text column of whole numbers ("3", "3.0"); empty cells are <NA> unless `required`, when the error
    about them ends with `blank_note`."""
    values, bad, blank = [], [], False
    for text, line in zip(df[column], df["manifest_line"], strict=True):
        if text == "":
            values.append(pd.NA)
            if required:
                bad.append(line)
                blank = True
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
            + (blank_note if blank else "")
        )
    return pd.Series(values, index=df.index, dtype="Int64")


def _scan_column_unread(df: pd.DataFrame, column: str) -> str:
    """How a slice-label column and its scan-label column (``label`` / ``scan_label``) combine, said where the slice
    column has empty cells and the scan column is there too ('' otherwise): the scan labels are not read at all, since
    they stand in only for a missing slice column; a user who filled ``scan_label`` expects them to fill the gaps."""
    scan_column = scan_label_column(column)
    if scan_column not in df.columns:
        return ""
    return (
        f"; '{scan_column}' is there too, but it is not read: scan labels stand in for '{column}' only where the"
        f" manifest has no '{column}' column, never for its empty cells (fill every row's '{column}', or remove the"
        f" '{column}' column to train from '{scan_column}', one label per scan)"
    )


def _warn_unread_scan_column(df: pd.DataFrame, column: str, path: Path) -> None:
    """Where unlabelled rows are allowed (predict, report): one warning that the empty cells of ``column`` stay
    unlabelled although its scan-label column is there (:func:`_scan_column_unread`)."""
    scan_column = scan_label_column(column)
    empty = df.loc[df[column].isna(), "manifest_line"].tolist()
    if empty and scan_column in df.columns:
        warnings.warn(
            f"manifest {path}: '{column}' is empty on lines {list_lines(empty)}, which are read as unlabelled;"
            f" '{scan_column}' is there too, but scan labels stand in for '{column}' only where the manifest has no"
            f" '{column}' column, never for its empty cells",
            stacklevel=3,
        )


def _spacings(df: pd.DataFrame, path: Path) -> pd.Series:
    """Parse `pixel_spacing_mm`: mm per pixel, one number or ``row\\column`` as DICOM's PixelSpacing writes it (their
    mean: the model grid's pixels are square); empty cells are NaN (the file's own spacing, or none)."""
    values, bad = [], []
    for text, line in zip(df[SPACING_COLUMN], df["manifest_line"], strict=True):
        try:
            numbers = [float(part) for part in text.split("\\")] if text != "" else [math.nan]
        except ValueError:
            numbers = [-1.0]
        if text != "" and not (len(numbers) <= 2 and all(math.isfinite(v) and v > 0 for v in numbers)):
            bad.append(line)
        values.append(sum(numbers) / len(numbers))
    if bad:
        raise ValueError(
            f"manifest {path}: column '{SPACING_COLUMN}' must hold mm per pixel, one number > 0 or row\\column (e.g."
            f" 0.45 or 0.45\\0.45), or be empty; bad value on lines {list_lines(bad)}"
        )
    return pd.Series(values, index=df.index, dtype="float64")


def _blank_to_none(texts: pd.Series) -> pd.Series:
    return pd.Series([None if t == "" or pd.isna(t) else t for t in texts], index=texts.index, dtype=object)


def _resolve(texts: pd.Series, folder: Path) -> pd.Series:
    base = str(folder)

    def one(text: str):  # os.path on strings: a tenth of pathlib's cost, which a later run paid on every row
        if text == "":
            return None
        return os.path.normpath(os.path.join(base, os.path.expanduser(text)))  # an absolute text stays as it is

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
        `pixel_spacing_mm` as float64 (NaN where empty), `manifest_line` (the row's line in the CSV), and any other
        columns untouched as text.
        `df.attrs["label_columns"]` holds the multi-label names (or None) and `df.attrs["manifest"]` the CSV path.
        With scan labels standing in for a missing slice-label column, `df.attrs["scan_labels"]` names their columns
        and the slice column holds what they allow (:func:`vit_ct.data.manifests.scan_labels.derive_slice_labels`).

    Raises:
        ValueError: naming the file and the CSV line numbers, for a missing/empty/unreadable CSV, a missing `image`,
            `label` or named label column, empty image cells, labels that are not integers >= 0 (0/1 for
            multi-label), unknown split names, a bad `slice` or `pixel_spacing_mm`, or a patient given two different
            splits.
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

    scan_pairs = []  # (slice-label column, scan-label column standing in for it)
    if label_columns is None:
        if "label" in df.columns:
            df["label"] = _integers(
                df, "label", path, allowed="integers >= 0", valid=lambda v: v >= 0, required=require_labels,
                blank_note=_scan_column_unread(df, "label"),
            )  # fmt: skip
            _warn_unread_scan_column(df, "label", path)
        elif SCAN_LABEL in df.columns:
            scan_pairs.append(("label", SCAN_LABEL))
        elif require_labels:
            need("label", "(integer class, 0 = no lesion; scan_label, one per scan; or label_columns for multi-label)")
        else:
            df["label"] = pd.array([pd.NA] * len(df), dtype="Int64")
    else:
        label_columns = [label_columns] if isinstance(label_columns, str) else list(label_columns)
        if not label_columns:
            raise ValueError("label_columns is empty; give the names of the 0/1 label columns, or None")
        for column in label_columns:
            if column not in df.columns and scan_label_column(column) in df.columns:
                scan_pairs.append((column, scan_label_column(column)))
                continue
            need(column, f"(named in label_columns; or {scan_label_column(column)}, one label per scan)")
            df[column] = _integers(
                df, column, path, allowed="0 or 1", valid=lambda v: v in (0, 1), required=require_labels,
                blank_note=_scan_column_unread(df, column),
            )  # fmt: skip
            _warn_unread_scan_column(df, column, path)

    if "mask" in df.columns:
        df["mask_ref"] = _blank_to_none(df["mask"])
        df["mask"] = _resolve(df["mask"], folder)
    if "slice" in df.columns:
        df["slice"] = _integers(df, "slice", path, allowed="integers >= 0", valid=lambda v: v >= 0, required=False)
    if SPACING_COLUMN in df.columns:
        df[SPACING_COLUMN] = _spacings(df, path)
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
    if scan_pairs:

        def parse(column: str) -> pd.Series:
            if column == SCAN_LABEL:  # a class, as `label`
                return _integers(df, column, path, allowed="integers >= 0", valid=lambda v: v >= 0, required=True)
            return _integers(df, column, path, allowed="0 or 1", valid=lambda v: v in (0, 1), required=True)

        df.attrs["scan_labels"] = derive_slice_labels(df, scan_pairs, path, parse=parse)
    df.attrs["label_columns"] = label_columns
    df.attrs["manifest"] = str(path)
    return df


def check_label_range(df: pd.DataFrame, num_classes: int, *, option: str = "--model.labels.num_classes") -> None:
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
