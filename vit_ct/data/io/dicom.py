"""Read one DICOM CT slice as float32 Hounsfield units: any transfer syntax pydicom can decode, classic or enhanced
(multi-frame) CT, rescale and pixel padding applied; or check it cheaply without decoding the pixels.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pydicom
from pydicom.dataset import Dataset
from pydicom.encaps import get_frame
from pydicom.errors import InvalidDicomError
from pydicom.pixels import get_decoder, pixel_array
from pydicom.pixels.utils import get_expected_length, get_nr_frames

from vit_ct.data.io.filecheck import UnreadableFileError, frame_index
from vit_ct.data.transforms.windows import AIR_HU

_MONOCHROME = ("MONOCHROME1", "MONOCHROME2")
CT_MODALITIES = ("CT",)  # DICOM Modality values whose rescaled values are Hounsfield units
MEDIA_DIRECTORY = "1.2.840.10008.1.3.10"  # the SOP class of a DICOMDIR, an export's index of its files
# RSNA 2019's known fault: a share of its slices declare unsigned 12-bit values (BitsStored 12, PixelRepresentation 0)
# and a RescaleIntercept near 0, while their stored values are HU + 1000 modulo 4096 less 1000: air (-1000 HU) is
# stored as 3096, fat (-100 HU) as 3996, brain (40 HU) as 40. The fix the competition's pipelines apply (Jeremy Howard's
# Kaggle notebook "Cleaning the data for rapid prototyping", 2019, `fix_pxrepr`; `correct_dcm` in the kernels after
# it): stored + 1000 modulo 4096, intercept -1000. vit-ct applies it where the header says so and the pixels show it.
WRAP_PERIOD, WRAP_SHIFT = 4096, 1000  # 12 bits; the offset the wrapped values were stored with
WRAP_INTERCEPT_ABOVE = -100.0  # an intercept this high cannot give air from unsigned values: the header's half
WRAP_EVIDENCE = 0.01  # share of the pixels stored at 3096 and above (air and fat once unwrapped): the pixels' half
UNWRAPPED = "wrapped 12-bit values corrected"  # the note of a slice read so
NOTES = {  # each note the reader gives, said in full once a run
    UNWRAPPED: "RSNA 2019's known fault: unsigned 12-bit values with RescaleIntercept above -100 that store air as"
    " 3096; read as (stored + 1000) mod 4096 - 1000 HU",
}


def read_dicom(path: Path) -> Dataset:
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
            path, f"DICOM has no pixel data (SOP class: {sop_name(ds)}): not an image, or the file is truncated"
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


def sop_name(ds: Dataset) -> str:
    """The object's SOP class by name (a DICOMDIR has only its file meta's), or "unknown"."""
    uid = ds.get("SOPClassUID") or getattr(ds, "file_meta", {}).get("MediaStorageSOPClassUID")
    return uid.name if uid is not None else "unknown"


def _dicom_frame(path: Path, ds: Dataset, frame: int | None) -> tuple[int, int]:
    """Return (frame index, number of frames)."""
    n = get_nr_frames(ds, warn=False)
    return frame_index(path, n, frame, "this multi-frame DICOM"), n


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


def pixel_spacing(ds: Dataset, index: int = 0) -> tuple[float, float] | None:
    """(row, column) spacing in mm: enhanced CT keeps it per frame or shared in functional groups
    (PixelMeasuresSequence), classic CT at the top level (PixelSpacing); None when the file gives none."""
    for sequence, item in (("PerFrameFunctionalGroupsSequence", index), ("SharedFunctionalGroupsSequence", 0)):
        groups = ds.get(sequence)
        if groups and len(groups) > item:
            measures = groups[item].get("PixelMeasuresSequence")
            if measures and measures[0].get("PixelSpacing") is not None:
                return _positive_pair(measures[0].PixelSpacing)
    return _positive_pair(ds.get("PixelSpacing"))


def _positive_pair(value) -> tuple[float, float] | None:
    try:
        row, column = (float(v) for v in value)
    except (TypeError, ValueError):
        return None
    return (row, column) if row > 0 and column > 0 else None


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


def check_values_are_hu(
    path: Path, ds: Dataset, index: int, *, modalities: tuple[str, ...] | None, stored_values_are_hu: bool
) -> None:
    """Refuse a file whose values are not Hounsfield units: another modality (MR, NM, RT dose...), or a CT that gives
    no rescale, whose stored values are HU on some scanners and HU + 1024 on others.

    Args:
        modalities: accepted DICOM Modality values; None accepts any (their values are used as if HU).
        stored_values_are_hu: take a CT without rescale slope/intercept (or modality LUT) as stored = HU.
    """
    modality = str(ds.get("Modality") or "").strip().upper()
    if modalities is not None and modality not in {m.strip().upper() for m in modalities}:
        what = f"Modality {modality}" if modality else "no Modality"
        raise UnreadableFileError(
            path,
            f"DICOM has {what} ({sop_name(ds)}), expected {'/'.join(modalities)}: its values are not Hounsfield"
            " units; to use it anyway, accept its modality (load_ct_slice(..., modalities=...),"
            " --data.init_args.modalities)",
        )
    if (
        modality == "CT"
        and not stored_values_are_hu
        and _rescale(ds, index) is None
        and not ds.get("ModalityLUTSequence")
    ):
        raise UnreadableFileError(
            path,
            "CT without RescaleSlope/RescaleIntercept: its stored values may be HU or HU + 1024 depending on the"
            " scanner; restore the tags, or state that stored values are HU (stored_values_are_hu=True,"
            " --data.init_args.stored_values_are_hu true)",
        )


def _wrapped_12_bit(path: Path, ds: Dataset, stored: np.ndarray, rescale: tuple[float, float] | None) -> bool:
    """Whether the slice has RSNA's wrapped 12-bit values (:data:`WRAP_PERIOD`): the header's pattern (unsigned
    12-bit, an intercept above :data:`WRAP_INTERCEPT_ABOVE`) and the pixels' (at least :data:`WRAP_EVIDENCE` of them
    stored where air and fat wrap to). Refused by name where the header has the pattern and a few pixels lie there
    but too few to tell a wrap from metal: its values cannot be trusted either way."""
    if rescale is None or ds.get("BitsStored") != 12 or ds.get("PixelRepresentation", 0) != 0:
        return False
    if rescale[1] <= WRAP_INTERCEPT_ABOVE or not np.issubdtype(stored.dtype, np.integer) or stored.size == 0:
        return False
    share = float((stored >= WRAP_PERIOD - WRAP_SHIFT).mean())
    if 0 < share < WRAP_EVIDENCE:
        raise UnreadableFileError(
            path, f"unsigned 12-bit values with RescaleIntercept {rescale[1]:g} (no air can be stored so) and"
            f" {share:.2%} of the pixels stored at {WRAP_PERIOD - WRAP_SHIFT} or above: too few to read as RSNA's"
            f" wrapped air, too many for metal; its Hounsfield units cannot be trusted"
        )  # fmt: skip
    return share >= WRAP_EVIDENCE


def read_dicom_hu(
    path: Path,
    frame: int | None,
    *,
    modalities: tuple[str, ...] | None = CT_MODALITIES,
    stored_values_are_hu: bool = False,
) -> tuple[np.ndarray, str]:
    """(rows, columns) float32 HU of one frame: rescale from the functional groups or the top level (or the modality
    LUT), pixel padding set to air (-1000 HU); refused unless its values are HU (`check_values_are_hu`). With it a
    note of what was corrected on the way ("" for nothing): :data:`UNWRAPPED` for RSNA's wrapped 12-bit slices, read
    as ``(stored + 1000) mod 4096`` with intercept -1000."""
    ds = read_dicom(path)
    index, n = _dicom_frame(path, ds, frame)
    check_values_are_hu(path, ds, index, modalities=modalities, stored_values_are_hu=stored_values_are_hu)
    try:
        stored = pixel_array(ds, index=index if n > 1 else None)  # (rows, columns), decodes only that frame
    except Exception as e:
        syntax = ds.file_meta.get("TransferSyntaxUID", "unknown syntax") if hasattr(ds, "file_meta") else "?"
        name = getattr(syntax, "name", syntax)
        raise UnreadableFileError(path, f"cannot decode pixel data ({name}): {e}") from None
    if stored.ndim != 2:
        raise UnreadableFileError(path, f"decoded pixel data has shape {stored.shape}, expected (rows, columns)")
    rescale = _rescale(ds, index)
    pad = _padding_mask(ds, stored)
    note = ""
    if rescale is not None and _wrapped_12_bit(path, ds, stored if pad is None else stored[~pad], rescale):
        slope, _ = rescale
        hu = stored.astype(np.float64) + WRAP_SHIFT
        hu[hu >= WRAP_PERIOD] -= WRAP_PERIOD  # (stored + 1000) mod 4096: stored values are below 4096 (12 bits)
        hu = hu * slope - WRAP_SHIFT
        note = UNWRAPPED
    elif rescale is not None:
        slope, intercept = rescale
        hu = stored.astype(np.float64) * slope + intercept
    elif ds.get("ModalityLUTSequence"):
        hu = pydicom.pixels.apply_modality_lut(stored, ds).astype(np.float64)
    else:  # no rescale given (and accepted above): stored values are the output values (slope 1, intercept 0)
        hu = stored.astype(np.float64)
    if pad is not None:
        hu[pad] = AIR_HU
    return hu.astype(np.float32), note


def read_deferred(path: Path) -> Dataset:
    """The whole header, values above 256 bytes (the pixel data) left on disk with their lengths known."""
    return pydicom.dcmread(path, defer_size=256)


def pixel_bytes_problem(path: Path, ds: Dataset | None = None) -> str | None:
    """Why a DICOM file's pixel data cannot be decoded, from its header and its size (the pixel bytes are not read
    where they are uncompressed): fewer bytes declared than Rows x Columns x frames x bits need, or a file that ends
    before them (RSNA 2019's ``ID_6431af929.dcm``). Compressed data is read and its fragments found (`probe_dicom`).
    None where nothing is wrong. ``ds``: the file as :func:`read_deferred` read it, where the caller has it."""
    try:
        ds = read_deferred(path) if ds is None else ds
        try:
            raw = ds.get_item("PixelData", keep_deferred=True)
        except TypeError:  # a pydicom without keep_deferred: the bytes are read and checked below instead
            raw = None
        syntax = ds.file_meta.get("TransferSyntaxUID") if hasattr(ds, "file_meta") else None
        if raw is None or syntax is None or syntax.is_encapsulated or raw.length == 0xFFFFFFFF:
            probe_dicom(path, None if get_nr_frames(ds, warn=False) == 1 else 0)
            return None
        expected = get_expected_length(ds, "bytes")
    except UnreadableFileError as e:
        return e.reason
    except Exception as e:  # pydicom raises many exception types on damaged files
        return f"damaged or truncated DICOM ({type(e).__name__}: {e})"
    if raw.length < expected:
        return f"pixel data is truncated ({raw.length} of {expected} bytes declared)"
    size = os.path.getsize(path)
    if raw.value_tell + raw.length > size:
        return f"pixel data is truncated (the file ends {raw.value_tell + raw.length - size} bytes before it does)"
    return None


def probe_dicom(
    path: Path,
    frame: int | None,
    *,
    modalities: tuple[str, ...] | None = CT_MODALITIES,
    stored_values_are_hu: bool = False,
) -> tuple[int, int]:
    """(rows, columns) of a DICOM slice, checked without decoding: pixel data present, single-channel, the frame
    exists, a decoder is installed, uncompressed bytes complete or compressed fragments found, values are HU
    (modality, rescale given) and the rescale finite."""
    ds = read_dicom(path)
    index, n = _dicom_frame(path, ds, frame)
    check_values_are_hu(path, ds, index, modalities=modalities, stored_values_are_hu=stored_values_are_hu)
    _check_dicom_bytes(path, ds, index, n)
    rescale = _rescale(ds, index)
    if rescale is not None and not np.isfinite(rescale).all():
        raise UnreadableFileError(path, f"rescale slope/intercept {rescale} are not finite")
    return int(ds.Rows), int(ds.Columns)
