"""Read one CT slice (DICOM, NIfTI or .npy) as float32 Hounsfield units, and lesion masks of the same size.

Every slice comes back rows x columns as a DICOM viewer shows it: rows toward posterior, columns toward patient left.
The DICOM part lives in `vit_ct.data.io.dicom`; this module picks the reader by file kind and handles NIfTI, .npy
and PNG.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
from PIL import Image

from vit_ct.data.io.dicom import CT_MODALITIES, pixel_spacing, probe_dicom, read_dicom_hu
from vit_ct.data.io.filecheck import UnreadableFileError, check_file, frame_index
from vit_ct.data.transforms.windows import AIR_HU

__all__ = [
    "AIR_HU",
    "CT_MODALITIES",
    "UnreadableFileError",
    "load_ct_slice",
    "load_mask",
    "probe_ct_slice",
    "probe_mask",
    "read_ct_slice",
]

# A CT slice in HU lies almost wholly between air (-1000) and the top of a 12-bit scanner's range (3071), bar the
# padding outside the scan circle (-2000, -3024) and metal. Stored values of another modality or a wrong rescale
# (an RT dose in cGy x 1e6, a slope in the thousands) leave most pixels outside.
HU_RANGE = (-1100.0, 3100.0)
# What the reader gives for a file: a change bumps it, so that slices cached by an older reader are read again.
# 2: RSNA's wrapped 12-bit values read unwrapped.
READER_VERSION = 2
HU_RANGE_MIN_FRACTION = 0.5


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
    if arr.size == 0:
        raise UnreadableFileError(path, f".npy has shape {arr.shape}: no pixels")
    if arr.ndim == 2:
        frame_index(path, 1, None if any_frame_if_2d else frame, "this 2-D .npy")
        return arr
    if arr.ndim == 3:
        return arr[:, :, frame_index(path, arr.shape[2], frame, "this 3-D .npy (last axis)")]
    raise UnreadableFileError(path, f".npy has shape {arr.shape}; expected (rows, columns) or (rows, columns, slices)")


def _finite(path: Path, arr: np.ndarray) -> np.ndarray:
    if arr.size == 0:
        raise UnreadableFileError(path, f"the slice has shape {arr.shape}: no pixels")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise UnreadableFileError(path, f"{int((~np.isfinite(arr)).sum())} pixel(s) are NaN or infinite")
    return arr


def _check_hu_range(path: Path, hu: np.ndarray) -> None:
    low, high = HU_RANGE
    inside = float(((hu >= low) & (hu <= high)).mean())
    if inside < HU_RANGE_MIN_FRACTION:
        raise UnreadableFileError(
            path,
            f"only {inside:.0%} of the pixels lie in the CT range {low:g}..{high:g} HU (values {hu.min():g} to"
            f" {hu.max():g}): not Hounsfield units? (load_ct_slice(..., modalities=None) takes values as they are)",
        )


def _binary(path: Path, arr: np.ndarray) -> np.ndarray:
    """`arr != 0` for a mask of 0 and one lesion value (1, 255, True); soft or multi-valued masks are refused, as
    thresholding them here would be a guess."""
    values = np.unique(arr)
    lesion = values[values != 0]
    if len(lesion) > 1 or (len(lesion) == 1 and lesion[0] < 0):
        shown = ", ".join(f"{v:g}" for v in values[:6].astype(float)) + (", ..." if len(values) > 6 else "")
        raise UnreadableFileError(
            path,
            f"mask holds {len(values)} distinct values ({shown}); expected a binary mask: 0 and one positive lesion"
            " value (e.g. 1 or 255). Threshold soft masks, or pick one label of a multi-label mask",
        )
    return arr != 0


# ---------------------------------------------------------------------------------------------------------- public


def load_ct_slice(
    path: str | os.PathLike,
    frame: int | None = None,
    *,
    modalities: tuple[str, ...] | None = CT_MODALITIES,
    stored_values_are_hu: bool = False,
) -> np.ndarray:
    """Load one CT slice in Hounsfield units.

    Args:
        path: DICOM file (any or no extension; detected by content, any transfer syntax pydicom can decode with
            pylibjpeg), NIfTI (`.nii`, `.nii.gz`) or `.npy` already in HU.
        frame: which slice of a multi-slice file: the frame of a multi-frame DICOM, or the index along the last axis
            of a 3-D NIfTI/.npy. `None` (default) is accepted only for files holding a single slice; a multi-slice
            file without `frame` raises rather than silently taking slice 0.
        modalities: DICOM Modality values accepted; other modalities (MR, NM, RT dose, ...) are refused, as their
            values are not HU. None accepts any file and takes its values as they are (no HU range check either).
        stored_values_are_hu: accept a CT DICOM that gives no rescale slope/intercept, taking stored values as HU
            (refused by default: some scanners store HU + 1024).

    Returns:
        (rows, columns) float32 HU, as pydicom's `pixel_array` (rows toward posterior, columns toward patient left
        for axial slices; NIfTI is reoriented to match). DICOM: stored x RescaleSlope + RescaleIntercept, taken from
        the frame's or shared functional groups of enhanced CT, else the top level (slope 1, intercept 0 when absent);
        PixelPaddingValue (to PixelPaddingRangeLimit) becomes air, -1000 HU. RSNA 2019's wrapped 12-bit slices
        (unsigned 12-bit, RescaleIntercept above -100, values showing air stored as 3096) are read unwrapped
        (`vit_ct.data.io.dicom.WRAP_PERIOD`). A new, writable array.

    Raises:
        UnreadableFileError: a `ValueError` naming the path and the reason (missing, empty, truncated, not DICOM,
            no pixel data, colour, NaN/inf pixels, no pixels, wrong dimensionality, frame out of range, no decoder,
            a modality other than `modalities`, a CT without rescale, fewer than half of the pixels in -1100..3100,
            12-bit values above 4095).
    """
    return read_ct_slice(path, frame, modalities=modalities, stored_values_are_hu=stored_values_are_hu)[0]


def read_ct_slice(
    path: str | os.PathLike,
    frame: int | None = None,
    *,
    modalities: tuple[str, ...] | None = CT_MODALITIES,
    stored_values_are_hu: bool = False,
) -> tuple[np.ndarray, str]:
    """:func:`load_ct_slice`'s HU and a note of what was corrected while reading ("" for nothing), e.g.
    :data:`vit_ct.data.io.dicom.UNWRAPPED` for RSNA's wrapped 12-bit slices: what the manifest check counts."""
    p = check_file(path)
    kind = _kind(p)
    note = ""
    if kind == "dicom":
        hu, note = read_dicom_hu(p, frame, modalities=modalities, stored_values_are_hu=stored_values_are_hu)
    elif kind == "nifti":
        hu = _load_nifti(p, frame)
    elif kind == "npy":
        hu = np.asarray(_npy(p, frame, "iuf"))
    else:
        raise UnreadableFileError(p, "PNG holds display grey levels, not HU; give DICOM, NIfTI or .npy in HU")
    # A copy of a memory-mapped .npy: torch.from_numpy warns on (and must not write through) a read-only map.
    hu = _finite(p, np.require(hu.astype(np.float32, copy=False), requirements=["C", "W", "O"]))
    if modalities is not None:
        _check_hu_range(p, hu)
    return hu, note


def _dicom_header(path: Path) -> pydicom.Dataset:
    try:
        return pydicom.dcmread(path, stop_before_pixels=True, force=True)
    except Exception as e:
        raise UnreadableFileError(path, f"cannot read the DICOM header ({type(e).__name__}: {e})") from None


def read_modality(path: str | os.PathLike) -> str | None:
    """A DICOM file's Modality, upper case ("" when it names none); None for NIfTI and .npy, which carry none."""
    p = check_file(path)
    return str(_dicom_header(p).get("Modality") or "").strip().upper() if _kind(p) == "dicom" else None


def read_pixel_spacing(path: str | os.PathLike, frame: int | None = None) -> tuple[float, float] | None:
    """In-plane pixel spacing of a slice in mm, (rows, columns), from the file's header: DICOM PixelSpacing (or the
    enhanced-CT functional groups), NIfTI voxel sizes of the slice's two axes; None for `.npy` or a header without it
    (callers then assume a field of view)."""
    p = check_file(path)
    kind = _kind(p)
    if kind == "dicom":
        return pixel_spacing(_dicom_header(p), frame or 0)
    if kind == "nifti":
        zooms = _nifti(p).header.get_zooms()
        if len(zooms) < 2 or not all(z > 0 for z in zooms[:2]):
            return None
        return float(zooms[0]), float(zooms[1])  # order is immaterial to the callers, which use the mean
    return None


def probe_ct_slice(
    path: str | os.PathLike,
    frame: int | None = None,
    *,
    modalities: tuple[str, ...] | None = CT_MODALITIES,
    stored_values_are_hu: bool = False,
) -> tuple[int, int]:
    """Check a slice cheaply, without decoding pixels, and return its (rows, columns).

    DICOM: parses the file, checks pixel data is present, single-channel, the frame exists, a decoder is installed,
    and (uncompressed) the pixel bytes are complete or (compressed) the frame's fragments can be found. NIfTI: header
    only (shape, dimensionality, frame). `.npy`: header, plus the slice's values for NaN/inf (memory-mapped).
    A file that passes can still fail in `load_ct_slice` (corrupt compressed data, NaN in a NIfTI, values outside
    the HU range): the manifest check calls the loaders themselves.

    Raises:
        UnreadableFileError: as `load_ct_slice`.
    """
    p = check_file(path)
    kind = _kind(p)
    if kind == "dicom":
        return probe_dicom(p, frame, modalities=modalities, stored_values_are_hu=stored_values_are_hu)
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
    """Load a lesion mask: non-zero = lesion, from a binary mask (0 and one lesion value).

    Args:
        path: PNG (grey, palette or colour; alpha ignored), `.npy`, or NIfTI (reoriented as in `load_ct_slice`).
        frame: slice index along the last axis of a 3-D `.npy`/NIfTI, as in `load_ct_slice`. Ignored for a mask
            holding one slice (PNG, 2-D), which belongs to whichever slice its manifest row names.

    Returns:
        (rows, columns) bool.

    Raises:
        UnreadableFileError: a `ValueError` naming the path and the reason, also for a soft or multi-valued mask.
    """
    p = check_file(path)
    kind = _kind(p)
    if kind == "png":
        img = _png(p, decode=True)
        arr = np.asarray(img)
        if arr.ndim == 3:  # (rows, columns, channels): one value per colour, alpha excluded
            arr = arr[..., :-1] if img.mode in ("LA", "RGBA", "PA") else arr
            colours, codes = np.unique(arr.reshape(-1, arr.shape[-1]), axis=0, return_inverse=True)
            black = not colours[0].any()  # rows sort lexicographically: black comes first when present
            arr = codes.reshape(arr.shape[:2]) + (0 if black else 1)  # 0 = black, one code per other colour
        return np.ascontiguousarray(_binary(p, _finite(p, arr)))
    if kind == "npy":
        arr = np.asarray(_npy(p, frame, "biuf", any_frame_if_2d=True))
    elif kind == "nifti":
        arr = _load_nifti(p, frame, any_frame_if_2d=True)
    else:
        raise UnreadableFileError(p, "unsupported mask format; expected .png, .npy, .nii or .nii.gz")
    return np.ascontiguousarray(_binary(p, _finite(p, arr)))


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
