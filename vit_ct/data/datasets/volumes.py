"""CT volumes with label volumes (NIfTI), as the mask datasets distribute them: a manifest row per slice, slice labels
read from the label volume, and a binary mask on the CT's own grid.

Every one of these datasets indexes its label volume voxel for voxel like the CT (same array shape; the dataset's own
code never resamples), so a label volume is checked for shape and read as such; its affine only decides whether the
file can be named as it is (binary and on the CT's affine) or is written again as a binary mask with the CT's affine,
so that `load_mask` turns it to the screen exactly as `load_ct_slice` turns the CT.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import nibabel as nib
import numpy as np
import pandas as pd

from vit_ct.data.datasets.output import DatasetOutput
from vit_ct.data.datasets.rsna_manifest import RSNA_LABELS
from vit_ct.data.io.scans import nifti_scan, scan_table

SUBTYPES = RSNA_LABELS[:5]  # epidural, intraparenchymal, intraventricular, subarachnoid, subdural: RSNA's names
NIFTI_SUFFIXES = (".nii.gz", ".nii")
AFFINE_TOLERANCE_MM = 1e-3  # float32 headers round-trip affines to about 1e-5 mm
LEFT_OUT = "left_out"  # the side table (``OUT.left_out.csv``) of the volumes a converter left out, and why
LEFT_OUT_COLUMNS = ("file", "reason")
_CHUNK = 1 << 22  # bytes decompressed at a time when a .nii.gz is checked: its data is counted, never held


class Converted(NamedTuple):
    """A converter's result: the manifest rows and what the user should know about them (one line each)."""

    table: pd.DataFrame
    notes: list[str]


def check_choice(value: str, name: str, choices: Sequence[str]) -> str:
    """``value`` when it is one of ``choices``, else a ValueError naming the option ``name``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


# How far below ROOT a set's folder is looked for: PhysioNet's `wget -r` tree puts CT-ICH 4 levels down
# (physionet.org/files/ct-ich/1.3.1/), Kaggle's RSNA zip 2 (rsna-intracranial-hemorrhage-detection twice).
SEARCH_DEPTH = 5


def find_folders(root: Path, holds: Callable[[Path], bool], depth: int = SEARCH_DEPTH) -> list[Path]:
    """The folders at or below ``root`` (down to ``depth`` levels, hidden ones skipped) for which ``holds`` is true,
    shallowest first; the search does not go below a folder that holds."""
    found, level = [], [root]
    for _ in range(depth + 1):
        below = []
        for folder in level:
            if holds(folder):
                found.append(folder)
                continue
            try:
                with os.scandir(folder) as entries:  # file type from the listing: no stat per file of a big folder
                    below += sorted(Path(e.path) for e in entries if not e.name.startswith(".") and e.is_dir())
            except OSError:  # unreadable: nothing found there
                continue
        level = below
    return found


def one_folder(found: list[Path], root: Path, what: str, holding: str, layout: str) -> Path:
    """The one folder of ``found`` (:func:`find_folders`), else a ValueError naming ``root``, what the folder must
    hold and every match where there are several."""
    if len(found) == 1:
        return found[0]
    if found:
        listed = "; ".join(str(f) for f in found[:10]) + (f"; and {len(found) - 10} more" if len(found) > 10 else "")
        raise ValueError(f"{what}: {len(found)} folders under {root} hold {holding}: {listed}; pass the one to read")
    raise ValueError(
        f"{what}: neither {root} nor a folder up to {SEARCH_DEPTH} levels below it holds {holding}; expected {layout}"
    )


def dataset_folder(root: Path, entries: Sequence[str], what: str, layout: str) -> Path:
    """``root`` when it holds every one of ``entries``, else the one folder below it that does (an archive's top
    folder, a mirror's tree: :func:`find_folders`).

    Raises:
        ValueError: naming ``root``, the entries and the ``layout`` expected, or every folder that holds them.
    """
    found = find_folders(root, lambda folder: all((folder / e).exists() for e in entries))
    if not found:
        missing = ", ".join(e for e in entries if not (root / e).exists())
        raise ValueError(
            f"{what}: {root} lacks {missing}, and no folder up to {SEARCH_DEPTH} levels below it holds"
            f" {' and '.join(entries)}; expected {layout}"
        )
    return one_folder(found, root, what, " and ".join(entries), layout)


def nifti_stem(path: Path) -> str | None:
    """File name without .nii / .nii.gz, or None for a file that is not NIfTI."""
    name = path.name
    for suffix in NIFTI_SUFFIXES:
        if name.lower().endswith(suffix) and not name.startswith("."):
            return name[: -len(suffix)]
    return None


def nifti_files(folder: Path) -> dict[str, Path]:
    """The NIfTI files of a folder by stem."""
    return {stem: p for p in sorted(folder.iterdir()) if p.is_file() and (stem := nifti_stem(p)) is not None}


def load_volume(path: Path, what: str) -> nib.Nifti1Image:
    """A 3-D NIfTI image (trailing axes of length 1 dropped), header only."""
    try:
        img = nib.load(path)
    except Exception as e:
        raise ValueError(f"{what} {path}: not a readable NIfTI file ({type(e).__name__}: {e})") from None
    shape = img.shape
    while len(shape) > 3 and shape[-1] == 1:
        shape = shape[:-1]
    if len(shape) != 3:
        raise ValueError(f"{what} {path} has shape {img.shape}; expected a 3-D volume (rows, columns, slices)")
    return img


def incomplete_data(path: Path) -> str | None:
    """Why a NIfTI file's voxel data is incomplete, or None when it holds every byte its header promises (offset +
    shape x data type): the converters read headers only, so a truncated copy would pass into the manifest and fail
    only when training reads its slices.

    An uncompressed ``.nii`` is checked by its size (no data read). A ``.nii.gz`` is decompressed once, counted and
    thrown away (a gzip stream gives its true length only at its end: the 4-byte length of its trailer is exactly what
    a truncated copy lacks).
    """
    try:
        header = nib.load(path).header
    except Exception as e:  # nibabel raises many types for a file cut inside its header
        return f"not a readable NIfTI file ({type(e).__name__}: {e})"
    expected = int(header.get_data_offset()) + int(np.prod(header.get_data_shape())) * header.get_data_dtype().itemsize
    if not path.name.lower().endswith(".gz"):
        size = path.stat().st_size
        if size >= expected:
            return None
        return f"truncated: {size:,} of the {expected:,} bytes its header's shape and data type need"
    try:
        size, ended = _gzip_length(path)
    except zlib.error as e:
        return f"corrupt: its gzip stream cannot be decompressed ({e})"
    if size < expected:
        cut = "is cut" if not ended else "ends"
        return f"truncated: its gzip stream {cut} after {size:,} of the {expected:,} bytes its header needs"
    if not ended:
        return f"truncated: its gzip stream is cut after the {expected:,} bytes its header needs, before its end"
    return None


def _gzip_length(path: Path) -> tuple[int, bool]:
    """The bytes a gzip file decompresses to, counted a bounded piece at a time (a mask of zeros grows 1000-fold), and
    whether its last stream ended (False: the file was cut); a file of several gzip members is read through."""
    size, decompressor = 0, zlib.decompressobj(wbits=31)  # 31: a gzip header and trailer
    with open(path, "rb") as file:
        while data := file.read(_CHUNK):
            while data.strip(b"\0") if decompressor.eof else data:  # zeros after a member: padding, as gzip reads it
                if decompressor.eof:  # another member follows the one that ended
                    decompressor = zlib.decompressobj(wbits=31)
                size += len(decompressor.decompress(data, _CHUNK))
                data = decompressor.unused_data if decompressor.eof else decompressor.unconsumed_tail
    return size, decompressor.eof


def complete_volumes(paths: Sequence[Path], *, on_missing: str, what: str, left_out: list[tuple[str, str]]) -> bool:
    """Whether every volume of one case (its CT, its label volume) holds all its voxel data (:func:`incomplete_data`).
    A case with an incomplete one is handled as a case whose files are missing: ``on_missing="raise"`` refuses it,
    "skip" leaves it out, each incomplete file and its reason added to ``left_out`` (:data:`LEFT_OUT`'s rows).

    Raises:
        ValueError: with ``on_missing="raise"``, naming the file and why.
    """
    faults = [(path, reason) for path in paths if (reason := incomplete_data(path)) is not None]
    if faults and on_missing == "raise":
        path, reason = faults[0]
        raise ValueError(
            f"{what}: {path} is {reason}; expected a complete volume (copy it again, or on_missing='skip' leaves its"
            " case out)"
        )
    left_out += [(str(path), reason) for path, reason in faults]
    return not faults


def left_out_note(left_out: list[tuple[str, str]], out: DatasetOutput) -> list[str]:
    """The incomplete volumes ``left_out`` (:func:`complete_volumes`) in one note, and their table (``file``,
    ``reason``) added beside the manifest (``OUT.left_out.csv``); no note without any."""
    if not left_out:
        return []
    out.add_table(LEFT_OUT, pd.DataFrame(left_out, columns=list(LEFT_OUT_COLUMNS)))
    shown = ", ".join(f"{Path(f).name} ({reason.split(':')[0]})" for f, reason in left_out[:5])
    more = f" and {len(left_out) - 5} more" if len(left_out) > 5 else ""
    return count_note(
        len(left_out),
        f"volume(s) with incomplete voxel data, their scans left out: {shown}{more} (each with its reason in"
        f" {out.stem}.{LEFT_OUT}.csv beside the manifest)",
    )


def read_labels(img: nib.Nifti1Image, path: Path, ct: nib.Nifti1Image, ct_path: Path, what: str) -> np.ndarray:
    """A label volume (`load_volume`) as integers (rows, columns, slices), checked to be whole numbers >= 0 on the
    CT's array shape."""
    if img.shape[:3] != ct.shape[:3]:
        raise ValueError(
            f"{what} {path} has shape {img.shape[:3]} but its CT {ct_path} has {ct.shape[:3]}; expected the same"
            " voxels, one label per CT voxel"
        )
    try:
        data = np.asanyarray(img.dataobj).reshape(img.shape[:3])  # applies scl_slope / scl_inter
    except Exception as e:
        raise ValueError(f"{what} {path}: voxel data cannot be read ({type(e).__name__}: {e})") from None
    if data.dtype.kind == "f" and (not np.isfinite(data).all() or (data != np.round(data)).any()):
        raise ValueError(f"{what} {path} holds values that are not whole numbers; expected a label volume")
    if data.min() < 0:
        raise ValueError(f"{what} {path} holds negative values ({data.min():g}); expected labels 0 (none) or more")
    return data.astype(np.int64) if data.dtype.kind in "fb" else data  # integer files keep their (small) type


def same_grid(a: nib.Nifti1Image, b: nib.Nifti1Image) -> bool:
    return bool(np.allclose(a.affine, b.affine, atol=AFFINE_TOLERANCE_MM))


def volume_rows(
    ct_path: Path, ct: nib.Nifti1Image, out: DatasetOutput, *, scan_id: str, patient_id: str
) -> pd.DataFrame:
    """One row per slice of a CT volume: ``image``, ``slice`` (index along the last axis), ``patient_id``, ``scan``,
    ``scan_slice``, ``position_mm`` (along the slice normal, as `vit-ct manifest` writes them)."""
    table = scan_table([nifti_scan(ct_path)]).drop(columns=["label", "study_uid", "series_uid"])
    table["image"] = out.reference(ct_path)
    table["scan"] = scan_id
    table["patient_id"] = patient_id
    if len(table) != ct.shape[2]:
        raise AssertionError(f"{ct_path}: {len(table)} rows for {ct.shape[2]} slices")
    return table


def label_values(labels: np.ndarray) -> list[int]:
    """The values a label volume holds, ascending. A count per value (labels are small integers >= 0): faster
    than np.unique's sort or hash on a whole volume."""
    return np.flatnonzero(np.bincount(labels.ravel(order="K"))).tolist()  # "K": no copy of a Fortran-ordered array


def lesion_pixels(labels: np.ndarray, value: int | None = None) -> np.ndarray:
    """Lesion voxels per slice, (slices,) int: non-zero voxels, or those holding ``value``."""
    return (labels != 0 if value is None else labels == value).sum(axis=(0, 1))


class MaskReference(NamedTuple):
    text: str  # the ``mask`` cell
    rewritten: str | None  # why the mask was written again beside the manifest, None when the dataset's file is named


def mask_reference(
    mask_path: Path, mask: nib.Nifti1Image, labels: np.ndarray, ct: nib.Nifti1Image, out: DatasetOutput, scan_id: str
) -> MaskReference:
    """How the manifest names a binary mask of ``labels != 0``: the dataset's own file when `load_mask` reads it as
    such (0 and one lesion value, on the CT's affine), else a binary volume written beside the manifest."""
    binary = len([v for v in label_values(labels) if v != 0]) <= 1
    if binary and same_grid(mask, ct):
        return MaskReference(out.reference(mask_path), None)
    why = "labels other than 0 and one lesion value" if not binary else "an affine other than its CT's"
    return MaskReference(out.write_mask(scan_id, labels != 0, ct.affine), why)


def add_scan_labels(table: pd.DataFrame) -> pd.DataFrame:
    """``scan_label`` and ``scan_<subtype>``: the largest slice label of each scan (a bleed anywhere in it)."""
    for column in ("label", *SUBTYPES):
        if column in table.columns:
            name = "scan_label" if column == "label" else f"scan_{column}"
            table[name] = table.groupby("scan")[column].transform("max").astype(int)
    return table


def count_note(count: int, text: str) -> list[str]:
    """One note, ``"<count> <text>"``, or none when nothing was counted."""
    return [f"{count} {text}"] if count else []


class VolumePair(NamedTuple):
    stem: str
    image: Path
    labels: Path


def pair_volumes(images: Path, labels: Path, *, on_missing: str, what: str, notes: list[str]) -> list[VolumePair]:
    """CT volumes and label volumes matched by file name (``NAME.nii.gz`` in both folders).

    Raises:
        ValueError: with ``on_missing="raise"``, naming the files that have no partner (else they are noted).
    """
    cts, masks = nifti_files(images), nifti_files(labels)
    alone = [f"{cts[s]} (no {labels / s}.nii.gz)" for s in cts if s not in masks]
    alone += [f"{masks[s]} (no {images / s}.nii.gz)" for s in masks if s not in cts]
    if alone and on_missing == "raise":
        shown = ", ".join(alone[:10]) + (" ..." if len(alone) > 10 else "")
        raise ValueError(
            f"{what}: {len(alone)} volume(s) without their partner: {shown}; expected a label volume of the same name"
            " for each CT volume (on_missing='skip' leaves them out)"
        )
    notes += count_note(len(alone), f"volume(s) without their partner, left out: {', '.join(alone[:5])}")
    pairs = [VolumePair(s, cts[s], masks[s]) for s in cts if s in masks]
    if not pairs:
        raise ValueError(f"{what}: no CT volume in {images} has a label volume in {labels} (NAME.nii.gz in both)")
    return pairs


class LabelledVolume(NamedTuple):
    table: pd.DataFrame  # its manifest rows
    mask: MaskReference


def labelled_rows(
    pair: VolumePair, out: DatasetOutput, *, scan_id: str, patient_id: str, classes: dict[int, str] | None, what: str
) -> LabelledVolume:
    """Rows of one CT volume labelled from its label volume: ``label`` (a bleed voxel in the slice), one 0/1 column
    per class of ``classes`` (label value -> column name), ``mask`` (binary, see `mask_reference`), ``mask_pixels``.

    Raises:
        ValueError: a label value outside ``classes`` (with 0), naming the file.
    """
    ct = load_volume(pair.image, f"{what} CT")
    mask = load_volume(pair.labels, f"{what} label volume")
    labels = read_labels(mask, pair.labels, ct, pair.image, f"{what} label volume")
    if classes is not None:
        unknown = sorted(set(label_values(labels)) - {0, *classes})
        if unknown:
            expected = ", ".join(f"{v} ({name})" for v, name in classes.items())
            raise ValueError(f"{what} label volume {pair.labels} holds the values {unknown}; expected 0 or {expected}")
    table = volume_rows(pair.image, ct, out, scan_id=scan_id, patient_id=patient_id)
    pixels = lesion_pixels(labels)
    table["label"] = (pixels > 0).astype(int)
    for value, name in (classes or {}).items():
        table[name] = (lesion_pixels(labels, value) > 0).astype(int)
    reference = mask_reference(pair.labels, mask, labels, ct, out, scan_id)
    table["mask"] = reference.text
    table["mask_pixels"] = pixels
    return LabelledVolume(table, reference)
