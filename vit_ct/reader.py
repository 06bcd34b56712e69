"""Read one CT slice (DICOM, NIfTI or .npy) as float32 Hounsfield units, and lesion masks of the same size.

Every slice comes back rows x columns as a DICOM viewer shows it: rows toward posterior, columns toward patient left.
"""

from __future__ import annotations

import os
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
from PIL import Image
from pydicom.dataset import Dataset
from pydicom.encaps import get_frame
from pydicom.errors import InvalidDicomError
from pydicom.pixels import get_decoder, pixel_array
from pydicom.pixels.utils import get_expected_length, get_nr_frames

AIR_HU = -1000.0  # what DICOM pixel padding (outside the scan circle) becomes
_MONOCHROME = ("MONOCHROME1", "MONOCHROME2")


class UnreadableFileError(ValueError):
    """A slice or mask that cannot be used; `path` and `reason` are kept for reports."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path, self.reason = str(path), reason
        super().__init__(f"cannot read {self.path}: {reason}")


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith((".nii", ".nii.gz")):
        return "nifti"
    if name.endswith(".npy"):
        return "npy"
    if name.endswith(".png"):
        return "png"
    return "dicom"  # DICOM files often have no extension, or .dcm/.ima/a UID; detected by content


def _check_file(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise UnreadableFileError(p, "file not found")
    if not p.is_file():
        raise UnreadableFileError(p, "not a file (a directory?)")
    if not os.access(p, os.R_OK):
        raise UnreadableFileError(p, "no permission to read the file")
    if p.stat().st_size == 0:
        raise UnreadableFileError(p, "file is empty (0 bytes)")
    return p


def _frame_index(path: Path, n: int, frame: int | None, what: str) -> int:
    """Validate `frame` against `n` slices; `frame=None` is allowed only when there is exactly one."""
    if frame is None:
        if n == 1:
            return 0
        raise UnreadableFileError(
            path, f"{what} holds {n} slices; choose one with frame= (the manifest's `slice` column), 0..{n - 1}"
        )
    if isinstance(frame, bool) or not isinstance(frame, (int, np.integer)):
        raise UnreadableFileError(path, f"frame must be an integer, got {frame!r}")
    if not 0 <= frame < n:
        raise UnreadableFileError(path, f"frame {frame} is out of range: {what} holds {n} slice(s), 0..{n - 1}")
    return int(frame)


# ---------------------------------------------------------------------------------------------------------- DICOM


def _read_dicom(path: Path) -> Dataset:
    """Parse the whole file (pixel bytes included, nothing decoded) and check it holds one greyscale image."""
    try:
        ds = pydicom.dcmread(path)
    except InvalidDicomError:
        # No 'DICM' prefix: old ACR-NEMA-style files still parse with force=True; anything else is not DICOM.
        try:
            ds = pydicom.dcmread(path, force=True)
        except Exception:
            ds = None
        if ds is None or "Rows" not in ds or not _has_pixels(ds):
            raise UnreadableFileError(
                path, "not a DICOM file (no 'DICM' header) nor a .nii/.nii.gz/.npy file by extension"
            ) from None
    except Exception as e:  # pydicom raises many exception types on damaged files
        raise UnreadableFileError(path, f"damaged or truncated DICOM ({type(e).__name__}: {e})") from None
    if not _has_pixels(ds):
        if len(ds) == 0 or ("Rows" in ds and "Columns" in ds):  # a header whose image never came
            raise UnreadableFileError(path, "DICOM has an image header but no pixel data: file truncated?")
        raise UnreadableFileError(
            path, f"DICOM has no pixel data (SOP class: {_sop_name(ds)}): not an image, or the file is truncated"
        )
    if "Rows" not in ds or "Columns" not in ds or not ds.Rows or not ds.Columns:
        raise UnreadableFileError(path, "DICOM header lacks Rows/Columns")
    photometric = ds.get("PhotometricInterpretation") or "MONOCHROME2"  # absent in some ACR-NEMA files
    if ds.get("SamplesPerPixel", 1) != 1 or photometric not in _MONOCHROME:
        raise UnreadableFileError(
            path,
            f"colour image (PhotometricInterpretation={photometric}, SamplesPerPixel={ds.get('SamplesPerPixel', 1)});"
            " expected a single-channel MONOCHROME1/2 CT slice",
        )
    syntax = ds.file_meta.get("TransferSyntaxUID") if hasattr(ds, "file_meta") else None
    if syntax is not None and "PixelData" in ds:
        try:
            available = get_decoder(syntax).is_available
        except NotImplementedError:
            available = False
        if not available:
            raise UnreadableFileError(
                path, f"no decoder installed for transfer syntax {syntax.name} ({syntax}); try pylibjpeg or GDCM"
            )
    return ds


def _has_pixels(ds: Dataset) -> bool:
    return any(k in ds for k in ("PixelData", "FloatPixelData", "DoubleFloatPixelData"))


def _sop_name(ds: Dataset) -> str:
    uid = ds.get("SOPClassUID") or getattr(ds, "file_meta", {}).get("MediaStorageSOPClassUID")
    return uid.name if uid is not None else "unknown"


def _dicom_frame(path: Path, ds: Dataset, frame: int | None) -> tuple[int, int]:
    """Return (frame index, number of frames)."""
    n = get_nr_frames(ds, warn=False)
    return _frame_index(path, n, frame, "this multi-frame DICOM"), n


def _check_dicom_bytes(path: Path, ds: Dataset, index: int, n: int) -> None:
    """Cheap integrity check of the pixel bytes, without decoding them."""
    if "PixelData" not in ds:
        return
    syntax = ds.file_meta.get("TransferSyntaxUID") if hasattr(ds, "file_meta") else None
    if syntax is None or not syntax.is_encapsulated:
        expected = get_expected_length(ds, "bytes")
        if len(ds.PixelData) < expected:
            raise UnreadableFileError(
                path, f"pixel data is truncated ({len(ds.PixelData)} of {expected} bytes expected)"
            )
        return
    try:
        get_frame(ds.PixelData, index, number_of_frames=n)
    except Exception as e:
        raise UnreadableFileError(path, f"compressed pixel data is damaged ({syntax.name}: {e})") from None


def _rescale(ds: Dataset, index: int) -> tuple[float, float] | None:
    """(slope, intercept): enhanced CT keeps them per frame or shared in functional groups, classic CT at top level."""
    for sequence, item in (("PerFrameFunctionalGroupsSequence", index), ("SharedFunctionalGroupsSequence", 0)):
        groups = ds.get(sequence)
        if groups and len(groups) > item:
            transform = groups[item].get("PixelValueTransformationSequence")
            if transform and (transform[0].get("RescaleSlope") is not None):
                return float(transform[0].RescaleSlope), float(transform[0].get("RescaleIntercept") or 0.0)
    if ds.get("RescaleSlope") is not None or ds.get("RescaleIntercept") is not None:
        slope = ds.get("RescaleSlope")
        return float(1.0 if slope is None else slope), float(ds.get("RescaleIntercept") or 0.0)
    return None


def _padding_mask(ds: Dataset, stored: np.ndarray) -> np.ndarray | None:
    """Pixels equal to PixelPaddingValue (or within its range limit), compared on stored values before rescale."""
    value = ds.get("PixelPaddingValue")
    if value is None or not np.issubdtype(stored.dtype, np.integer):
        return None
    limit = ds.get("PixelPaddingRangeLimit")
    bits = ds.get("BitsAllocated", 16)
    ends = [int(v) for v in (value, value if limit is None else limit)]
    if ds.get("PixelRepresentation", 0) == 1:  # a signed padding value may have been read as unsigned (VR US)
        ends = [v - 2**bits if v >= 2 ** (bits - 1) else v for v in ends]
    low, high = min(ends), max(ends)
    return (stored >= low) & (stored <= high)


def _load_dicom(path: Path, frame: int | None) -> np.ndarray:
    ds = _read_dicom(path)
    index, n = _dicom_frame(path, ds, frame)
    try:
        stored = pixel_array(ds, index=index if n > 1 else None)  # (rows, columns), decodes only that frame
    except Exception as e:
        syntax = ds.file_meta.get("TransferSyntaxUID", "unknown syntax") if hasattr(ds, "file_meta") else "?"
        name = getattr(syntax, "name", syntax)
        raise UnreadableFileError(path, f"cannot decode pixel data ({name}): {e}") from None
    if stored.ndim != 2:
        raise UnreadableFileError(path, f"decoded pixel data has shape {stored.shape}, expected (rows, columns)")
    rescale = _rescale(ds, index)
    if rescale is not None:
        slope, intercept = rescale
        hu = stored.astype(np.float64) * slope + intercept
    elif ds.get("ModalityLUTSequence"):
        hu = pydicom.pixels.apply_modality_lut(stored, ds).astype(np.float64)
    else:  # no rescale given: stored values are the output values (slope 1, intercept 0)
        hu = stored.astype(np.float64)
    pad = _padding_mask(ds, stored)
    if pad is not None:
        hu[pad] = AIR_HU
    return hu.astype(np.float32)


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
        _frame_index(path, 1, None if any_frame_if_2d else frame, "this 2-D NIfTI")
        return (slice(None), slice(None)) + (0,) * extra
    k = _frame_index(path, spatial[2], frame, "this 3-D NIfTI (last axis)")
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
    transpose = _display_axes(img.affine)[0]
    rows, cols = img.shape[:2]
    return (cols, rows) if transpose else (rows, cols)


# ---------------------------------------------------------------------------------------------------------- .npy


def _npy(path: Path, frame: int | None, kinds: str, *, any_frame_if_2d: bool = False) -> np.ndarray:
    """One (rows, columns) slice of a 2-D array or of a 3-D array along its last axis, memory-mapped."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as e:
        raise UnreadableFileError(path, f"not a readable .npy array ({type(e).__name__}: {e})") from None
    if arr.dtype.kind not in kinds:
        raise UnreadableFileError(path, f".npy has dtype {arr.dtype}; expected a real-valued single-channel array")
    if arr.ndim == 2:
        _frame_index(path, 1, None if any_frame_if_2d else frame, "this 2-D .npy")
        return arr
    if arr.ndim == 3:
        return arr[:, :, _frame_index(path, arr.shape[2], frame, "this 3-D .npy (last axis)")]
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
    p = _check_file(path)
    kind = _kind(p)
    if kind == "dicom":
        hu = _load_dicom(p, frame)
    elif kind == "nifti":
        hu = _load_nifti(p, frame)
    elif kind == "npy":
        hu = np.asarray(_npy(p, frame, "iuf"))
    else:
        raise UnreadableFileError(p, "PNG holds display grey levels, not HU; give DICOM, NIfTI or .npy in HU")
    return np.ascontiguousarray(_finite(p, hu.astype(np.float32, copy=False)))


def probe_ct_slice(path: str | os.PathLike, frame: int | None = None) -> tuple[int, int]:
    """Check a slice cheaply, without decoding pixels, and return its (rows, columns).

    DICOM: parses the file, checks pixel data is present, single-channel, the frame exists, a decoder is installed,
    and (uncompressed) the pixel bytes are complete or (compressed) the frame's fragments can be found. NIfTI: header
    only (shape, dimensionality, frame). `.npy`: header, plus the slice's values for NaN/inf (memory-mapped).
    A file that passes can still fail in `load_ct_slice` if compressed data is corrupt inside a frame.

    Raises:
        UnreadableFileError: as `load_ct_slice`.
    """
    p = _check_file(path)
    kind = _kind(p)
    if kind == "dicom":
        ds = _read_dicom(p)
        index, n = _dicom_frame(p, ds, frame)
        _check_dicom_bytes(p, ds, index, n)
        rescale = _rescale(ds, index)
        if rescale is not None and not np.isfinite(rescale).all():
            raise UnreadableFileError(p, f"rescale slope/intercept {rescale} are not finite")
        return int(ds.Rows), int(ds.Columns)
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
    p = _check_file(path)
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
    p = _check_file(path)
    kind = _kind(p)
    if kind == "png":
        width, height = _png(p, decode=False).size
        return height, width
    if kind == "npy":
        return _npy(p, frame, "biuf", any_frame_if_2d=True).shape
    if kind == "nifti":
        return _probe_nifti(p, frame, any_frame_if_2d=True)
    raise UnreadableFileError(p, "unsupported mask format; expected .png, .npy, .nii or .nii.gz")
