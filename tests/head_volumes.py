"""Head CT volumes as NIfTI files, for the tests of the public-dataset converters: a head of brain-like HU with
bleeds of 75 HU at known voxels (nothing else in the volume is 75 HU), on the affines converters write."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np

from vit_ct.data.io.reader import load_ct_slice, load_mask

BLEED_HU = 75
# dcm2niix / ITK from axial DICOM: LPS flipped to RAS, so voxel axis 0 runs to the patient's left and axis 1 to the
# back; 0.45 mm pixels, 5 mm slices (CT-ICH, INSTANCE and BHSD volumes are of this kind).
DCM2NIIX_AFFINE = np.array([[-0.45, 0, 0, 57.4], [0, -0.45, 0, 71.2], [0, 0, 5.0, -42.5], [0, 0, 0, 1]])
# The same grid tilted by 12 degrees about the left-right axis (a gantry tilt), with its origin elsewhere.
_t = np.deg2rad(12)
TILTED_AFFINE = np.array([
    [-0.42, 0, 0, 60.0],
    [0, -0.42 * np.cos(_t), 5.0 * np.sin(_t), 80.0],
    [0, 0.42 * np.sin(_t), 5.0 * np.cos(_t), -30.0],
    [0, 0, 0, 1],
])  # fmt: skip


def head_hu(shape: tuple[int, int, int], seed: int) -> np.ndarray:
    """(rows, columns, slices) int16 HU: air outside an ellipse, brain (25..45 HU) inside; not square, so a transposed
    slice has another shape."""
    rng = np.random.default_rng(seed)
    ii, jj = np.mgrid[: shape[0], : shape[1]]
    inside = ((ii - shape[0] / 2) / (0.45 * shape[0])) ** 2 + ((jj - shape[1] / 2) / (0.45 * shape[1])) ** 2 < 1
    hu = np.where(inside[..., None], rng.integers(25, 46, shape), -1000)
    return hu.astype(np.int16)


def write_volume(path: Path, data: np.ndarray, affine: np.ndarray, *, stored_plus_1024: bool = False) -> None:
    """A NIfTI volume; ``stored_plus_1024`` stores HU + 1024 as uint16 with scl_inter -1024 (as some converters do)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if stored_plus_1024:
        img = nib.Nifti1Image((data.astype(np.int32) + 1024).astype(np.uint16), affine)
        img.header.set_slope_inter(1.0, -1024.0)
    else:
        img = nib.Nifti1Image(data, affine)
    nib.save(img, path)


def bleed_pixels_agree(image: Path, mask: Path, k: int) -> bool:
    """Whether the pixels `load_mask` marks on slice ``k`` are exactly the 75 HU pixels `load_ct_slice` shows there."""
    hu, lesion = load_ct_slice(image, k), load_mask(mask, k)
    return hu.shape == lesion.shape and np.array_equal(hu == BLEED_HU, lesion)
