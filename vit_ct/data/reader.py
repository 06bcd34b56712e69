"""Read one CT slice (DICOM, NIfTI or .npy) as float32 Hounsfield units, and lesion masks of the same size.

Every slice comes back rows x columns as a DICOM viewer shows it: rows toward posterior, columns toward patient left.
The DICOM part lives in `vit_ct.data.dicom`; this module picks the reader by file kind and handles NIfTI, .npy and PNG.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
from PIL import Image

from vit_ct.data.dicom import load_dicom, pixel_spacing, probe_dicom
from vit_ct.data.filecheck import UnreadableFileError, check_file, frame_index
from vit_ct.data.windows import AIR_HU

__all__ = ["AIR_HU", "UnreadableFileError", "load_ct_slice", "load_mask", "probe_ct_slice", "probe_mask"]


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith((".nii", ".nii.gz")):
        return "nifti"
    if name.endswith(".npy"):
        return "npy"
    if name.endswith(".png"):
        return "png"
    return "dicom"  # DICOM files often have no extension, or .dcm/.ima/a UID; detected by content


# ---------------------------------------------------------------------------------------------------------- NIfTI


def _nifti(path: Path) -> nib.Nifti1Image:
    try:
        img = nib.load(path)
    except Exception as e:
        raise UnreadableFileError(path, f"not a readable NIfTI file ({type(e).__name__}: {e})") from None
    if img.get_data_dtype().kind not in "biuf":
        raise UnreadableFileError(path, f"NIfTI data type {img.get_data_dtype()} is not a single-channel image")
    return img


def _nifti_slicer(path: Path, img: nib.Nifti1Image, frame: int | None, *, any_frame_if_2d: bool = False) -> tuple:
    """Index that selects one 2-D slice along the last spatial axis (trailing singleton axes dropped)."""
    shape = img.shape
    extra = 0
    while len(shape) - extra > 3 and shape[len(shape) - extra - 1] == 1:
        extra += 1
    spatial = shape[: len(shape) - extra]
    if len(spatial) not in (2, 3):
        raise UnreadableFileError(path, f"NIfTI has shape {shape}; expected a 2-D slice or a 3-D volume")
    if len(spatial) == 2:
        frame_index(path, 1, None if any_frame_if_2d else frame, "this 2-D NIfTI")
        return (slice(None), slice(None)) + (0,) * extra
    k = frame_index(path, spatial[2], frame, "this 3-D NIfTI (last axis)")
    return (slice(None), slice(None), k) + (0,) * extra


def _display_axes(affine: np.ndarray) -> tuple[bool, bool, bool]:
    """How a plane across voxel axis 2 maps to a DICOM-like display: (transpose, flip rows, flip columns).

    Display convention: axial rows A->P and columns R->L; coronal rows S->I, columns R->L; sagittal rows S->I,
    columns A->P. In RAS+ world terms each display index grows toward P, L or I, i.e. against the world axis.
    """
    ornt = nib.orientations.io_orientation(affine)  # per voxel axis: (world axis 0=R/L 1=A/P 2=S/I, +1 if toward R/A/S)
    if np.isnan(ornt).any():
        ornt = np.array([[0, 1], [1, 1], [2, 1]])  # degenerate affine: treat as RAS+
    through = int(ornt[2, 0])
    row_world = {2: 1, 1: 2, 0: 2}[through]
    transpose = int(ornt[0, 0]) != row_world  # voxel axis 1 must become the rows
    rows_voxel = 1 if transpose else 0
    return transpose, bool(ornt[rows_voxel, 1] > 0), bool(ornt[1 - rows_voxel, 1] > 0)


def _to_display(plane: np.ndarray, affine: np.ndarray) -> np.ndarray:
    transpose, flip_rows, flip_cols = _display_axes(affine)
    out = plane.T if transpose else plane
    if flip_rows:
        out = out[::-1, :]
    if flip_cols:
        out = out[:, ::-1]
    return np.ascontiguousarray(out)


def from_display(plane: np.ndarray, affine: np.ndarray) -> np.ndarray:
    """Inverse of the display reorientation: a (rows, columns) plane as `load_ct_slice` returns it, back on the
    NIfTI's own voxel axes 0 and 1 (for writing a volume on the file's grid)."""
    transpose, flip_rows, flip_cols = _display_axes(affine)
    out = plane
    if flip_cols:
        out = out[:, ::-1]
    if flip_rows:
        out = out[::-1, :]
    return np.ascontiguousarray(out.T if transpose else out)


def display_shape(img: nib.Nifti1Image) -> tuple[int, int]:
    """(rows, columns) of a NIfTI's slices as `load_ct_slice` returns them."""
    rows, cols = img.shape[:2]
    return (cols, rows) if _display_axes(img.affine)[0] else (rows, cols)


def _load_nifti(path: Path, frame: int | None, *, any_frame_if_2d: bool = False) -> np.ndarray:
    img = _nifti(path)
    slicer = _nifti_slicer(path, img, frame, any_frame_if_2d=any_frame_if_2d)
    try:
        plane = np.asarray(img.dataobj[slicer])  # reads one slice; the proxy applies scl_slope/scl_inter
    except Exception as e:
        raise UnreadableFileError(
            path, f"NIfTI data cannot be read, file truncated? ({type(e).__name__}: {e})"
        ) from None
    return _to_display(plane, img.affine)


def _probe_nifti(path: Path, frame: int | None, *, any_frame_if_2d: bool = False) -> tuple[int, int]:
    img = _nifti(path)
    _nifti_slicer(path, img, frame, any_frame_if_2d=any_frame_if_2d)
    return display_shape(img)


# ---------------------------------------------------------------------------------------------------------- .npy


# numpy parses a .npy header with `ast.literal_eval`, which on CPython 3.11 fails now and then with "SystemError: AST
# constructor recursion depth mismatch" when several threads parse at once (CPython gh-106905, fixed in 3.12), and the
# manifest check reads files in threads: one header at a time.
_NPY_HEADER_LOCK = threading.Lock()


def _npy(path: Path, frame: int | None, kinds: str, *, any_frame_if_2d: bool = False) -> np.ndarray:
    """One (rows, columns) slice of a 2-D array or of a 3-D array along its last axis, memory-mapped."""
    try:
        with _NPY_HEADER_LOCK:  # memory-mapped: only the header is parsed here
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as e:
        raise UnreadableFileError(path, f"not a readable .npy array ({type(e).__name__}: {e})") from None
    if arr.dtype.kind not in kinds:
        raise UnreadableFileError(path, f".npy has dtype {arr.dtype}; expected a real-valued single-channel array")
    if arr.ndim == 2:
        frame_index(path, 1, None if any_frame_if_2d else frame, "this 2-D .npy")
        return arr
    if arr.ndim == 3:
        return arr[:, :, frame_index(path, arr.shape[2], frame, "this 3-D .npy (last axis)")]
    raise UnreadableFileError(path, f".npy has shape {arr.shape}; expected (rows, columns) or (rows, columns, slices)")


def _finite(path: Path, arr: np.ndarray) -> np.ndarray:
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise UnreadableFileError(path, f"{int((~np.isfinite(arr)).sum())} pixel(s) are NaN or infinite")
    return arr


# ---------------------------------------------------------------------------------------------------------- public


def load_ct_slice(path: str | os.PathLike, frame: int | None = None) -> np.ndarray:
    """Load one CT slice in Hounsfield units.

    Args:
        path: DICOM file (any or no extension; detected by content, any transfer syntax pydicom can decode with
            pylibjpeg), NIfTI (`.nii`, `.nii.gz`) or `.npy` already in HU.
        frame: which slice of a multi-slice file: the frame of a multi-frame DICOM, or the index along the last axis
            of a 3-D NIfTI/.npy. `None` (default) is accepted only for files holding a single slice; a multi-slice
            file without `frame` raises rather than silently taking slice 0.

    Returns:
        (rows, columns) float32 HU, as pydicom's `pixel_array` (rows toward posterior, columns toward patient left
        for axial slices; NIfTI is reoriented to match). DICOM: stored x RescaleSlope + RescaleIntercept, taken from
        the frame's or shared functional groups of enhanced CT, else the top level (slope 1, intercept 0 when absent);
        PixelPaddingValue (to PixelPaddingRangeLimit) becomes air, -1000 HU. Any single-channel MONOCHROME1/2 image
        is accepted (for non-CT modalities the values are whatever the rescale gives).

    Raises:
        UnreadableFileError: a `ValueError` naming the path and the reason (missing, empty, truncated, not DICOM,
            no pixel data, colour, NaN/inf pixels, wrong dimensionality, frame out of range, no decoder).
    """
    p = check_file(path)
    kind = _kind(p)
    if kind == "dicom":
        hu = load_dicom(p, frame)
    elif kind == "nifti":
        hu = _load_nifti(p, frame)
    elif kind == "npy":
        hu = np.asarray(_npy(p, frame, "iuf"))
    else:
        raise UnreadableFileError(p, "PNG holds display grey levels, not HU; give DICOM, NIfTI or .npy in HU")
    return np.ascontiguousarray(_finite(p, hu.astype(np.float32, copy=False)))


def read_pixel_spacing(path: str | os.PathLike, frame: int | None = None) -> tuple[float, float] | None:
    """In-plane pixel spacing of a slice in mm, (rows, columns), from the file's header: DICOM PixelSpacing (or the
    enhanced-CT functional groups), NIfTI voxel sizes of the slice's two axes; None for `.npy` or a header without it
    (callers then assume a field of view)."""
    p = check_file(path)
    kind = _kind(p)
    if kind == "dicom":
        try:
            ds = pydicom.dcmread(p, stop_before_pixels=True, force=True)
        except Exception as e:
            raise UnreadableFileError(p, f"cannot read the DICOM header ({type(e).__name__}: {e})") from None
        return pixel_spacing(ds, frame or 0)
    if kind == "nifti":
        zooms = _nifti(p).header.get_zooms()
        if len(zooms) < 2 or not all(z > 0 for z in zooms[:2]):
            return None
        return float(zooms[0]), float(zooms[1])  # order is immaterial to the callers, which use the mean
    return None


def probe_ct_slice(path: str | os.PathLike, frame: int | None = None) -> tuple[int, int]:
    """Check a slice cheaply, without decoding pixels, and return its (rows, columns).

    DICOM: parses the file, checks pixel data is present, single-channel, the frame exists, a decoder is installed,
    and (uncompressed) the pixel bytes are complete or (compressed) the frame's fragments can be found. NIfTI: header
    only (shape, dimensionality, frame). `.npy`: header, plus the slice's values for NaN/inf (memory-mapped).
    A file that passes can still fail in `load_ct_slice` if compressed data is corrupt inside a frame.

    Raises:
        UnreadableFileError: as `load_ct_slice`.
    """
    p = check_file(path)
    kind = _kind(p)
    if kind == "dicom":
        return probe_dicom(p, frame)
    if kind == "nifti":
        return _probe_nifti(p, frame)
    if kind == "npy":
        return _finite(p, np.asarray(_npy(p, frame, "iuf"))).shape
    raise UnreadableFileError(p, "PNG holds display grey levels, not HU; give DICOM, NIfTI or .npy in HU")


def _png(path: Path, *, decode: bool) -> Image.Image:
    try:
        img = Image.open(path)
        if decode:
            img.load()
        else:
            img.verify()  # checks chunk CRCs without decoding; the image cannot be used afterwards
            img = Image.open(path)
    except Exception as e:
        raise UnreadableFileError(path, f"not a readable PNG ({type(e).__name__}: {e})") from None
    return img


def load_mask(path: str | os.PathLike, frame: int | None = None) -> np.ndarray:
    """Load a lesion mask: non-zero = lesion.

    Args:
        path: PNG (grey, palette or colour; alpha ignored), `.npy`, or NIfTI (reoriented as in `load_ct_slice`).
        frame: slice index along the last axis of a 3-D `.npy`/NIfTI, as in `load_ct_slice`. Ignored for a mask
            holding one slice (PNG, 2-D), which belongs to whichever slice its manifest row names.

    Returns:
        (rows, columns) bool.

    Raises:
        UnreadableFileError: a `ValueError` naming the path and the reason.
    """
    p = check_file(path)
    kind = _kind(p)
    if kind == "png":
        img = _png(p, decode=True)
        arr = np.asarray(img)
        if arr.ndim == 3:  # (rows, columns, channels): any non-zero colour channel, alpha excluded
            arr = arr[..., :-1] if img.mode in ("LA", "RGBA", "PA") else arr
            arr = arr.any(axis=-1)
        return np.ascontiguousarray(arr != 0)
    if kind == "npy":
        arr = np.asarray(_npy(p, frame, "biuf", any_frame_if_2d=True))
    elif kind == "nifti":
        arr = _load_nifti(p, frame, any_frame_if_2d=True)
    else:
        raise UnreadableFileError(p, "unsupported mask format; expected .png, .npy, .nii or .nii.gz")
    return np.ascontiguousarray(_finite(p, arr) != 0)


def probe_mask(path: str | os.PathLike, frame: int | None = None) -> tuple[int, int]:
    """Check a mask cheaply (PNG chunk checksums, NIfTI/.npy headers) and return its (rows, columns).

    Raises:
        UnreadableFileError: as `load_mask`.
    """
    p = check_file(path)
    kind = _kind(p)
    if kind == "png":
        width, height = _png(p, decode=False).size
        return height, width
    if kind == "npy":
        return _npy(p, frame, "biuf", any_frame_if_2d=True).shape
    if kind == "nifti":
        return _probe_nifti(p, frame, any_frame_if_2d=True)
    raise UnreadableFileError(p, "unsupported mask format; expected .png, .npy, .nii or .nii.gz")
