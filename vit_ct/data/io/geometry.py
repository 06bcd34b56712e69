"""Where a slice lies in its scan: the plane of a DICOM frame, the slice normal, a volume's slice positions, and one
slice's scan and position read from its file alone (what orders the slices of a scan, and finds a slice's
neighbours)."""

from __future__ import annotations

import functools
import os

import nibabel as nib
import numpy as np
import pydicom
from pydicom.dataset import Dataset

NIFTI_SUFFIXES = (".nii", ".nii.gz")


def frame_plane(ds: Dataset, index: int, attribute: str, sequence: str):
    """A plane attribute of one frame: per-frame, then shared functional groups (enhanced CT), then the top level."""
    for groups_name, item in (("PerFrameFunctionalGroupsSequence", index), ("SharedFunctionalGroupsSequence", 0)):
        groups = ds.get(groups_name)
        if groups and len(groups) > item:
            plane = groups[item].get(sequence)
            if plane and plane[0].get(attribute) is not None:
                return plane[0].get(attribute)
    return ds.get(attribute)


def slice_normal(orientation: np.ndarray) -> np.ndarray:
    """Unit normal of a slice plane: row direction x column direction (ImageOrientationPatient, LPS)."""
    normal = np.cross(orientation[0], orientation[1])
    return normal / np.linalg.norm(normal)


def slice_place(image: str | os.PathLike, frame: int | None) -> tuple[str | None, float | None]:
    """Where one slice lies, from its file alone: the scan it belongs to (a DICOM file's SeriesInstanceUID, a NIfTI
    volume's path) and its position in mm along the slice normal (ImagePositionPatient on the normal of
    ImageOrientationPatient, per frame for enhanced CT; a volume's affine), as :func:`find_scans` orders slices; None
    for what the file does not say (other formats, unreadable files, missing attributes)."""
    path = str(image)
    if path.lower().endswith(NIFTI_SUFFIXES):
        positions = _nifti_positions(path)
        k = frame or 0
        return path, (positions[k] if positions is not None and k < len(positions) else None)
    try:
        ds = pydicom.dcmread(path, stop_before_pixels=True)
    except Exception:
        return None, None
    series = str(ds.get("SeriesInstanceUID") or "") or None
    index = frame or 0
    position = frame_plane(ds, index, "ImagePositionPatient", "PlanePositionSequence")
    orientation = frame_plane(ds, index, "ImageOrientationPatient", "PlaneOrientationSequence")
    if position is None or orientation is None or len(position) != 3 or len(orientation) != 6:
        return series, None
    normal = slice_normal(np.array([float(v) for v in orientation]).reshape(2, 3))
    return series, float(np.array([float(v) for v in position]) @ normal)


@functools.lru_cache(maxsize=64)
def _nifti_positions(path: str) -> tuple[float, ...] | None:
    """Positions in mm along the normal of a NIfTI volume's slices (:func:`nifti_scan`'s), None if unreadable."""
    try:
        img = nib.load(path)
    except Exception:
        return None
    return tuple(volume_positions(img.affine, img.shape[2] if len(img.shape) >= 3 else 1))


def volume_positions(affine: np.ndarray, depth: int) -> list[float]:
    """Positions in mm along the slice normal (the affine's third axis) of a volume's ``depth`` slices."""
    normal = affine[:3, 2] / (np.linalg.norm(affine[:3, 2]) or 1.0)
    return [float((affine @ [0, 0, k, 1])[:3] @ normal) for k in range(depth)]
