"""Three orthogonal views (axial, coronal, sagittal) of a map over its CT volume, through the map's maximum, in the
radiological convention (patient's right on the image's left), with each view's true aspect in mm."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
from matplotlib.figure import Figure

from vit_ct.data.transforms.windows import DISPLAY_WINDOW
from vit_ct.explain.overlay import render_overlay
from vit_ct.files import atomic_write


def canonical_views(volume: np.ndarray, affine: np.ndarray, voxel: tuple[int, int, int]) -> dict[str, np.ndarray]:
    """Axial, coronal and sagittal planes of ``volume`` through ``voxel`` (its own voxel indices), reoriented to RAS+
    and laid out for display: axial rows A->P, columns R->L; coronal and sagittal rows S->I."""
    ornt = nib.orientations.io_orientation(affine)
    data = nib.orientations.apply_orientation(volume, ornt)  # axes now R, A, S (increasing toward them)
    x, y, z = nib.orientations.apply_orientation(_point_volume(volume.shape, voxel), ornt).nonzero()
    x, y, z = int(x[0]), int(y[0]), int(z[0])
    return {
        "axial": data[::-1, ::-1, z].T,
        "coronal": data[::-1, y, ::-1].T,
        "sagittal": data[x, ::-1, ::-1].T,
    }


def _point_volume(shape, voxel) -> np.ndarray:
    point = np.zeros(shape, dtype=bool)
    point[voxel] = True
    return point


def render_orthogonal_views(
    ct: np.ndarray,
    heat: np.ndarray,
    affine: np.ndarray,
    path: str | Path,
    *,
    window: tuple[float, float] = DISPLAY_WINDOW,
    title: str = "",
) -> None:
    """Save a PNG of the three views of ``heat`` over ``ct`` (HU) through the voxel where ``heat`` peaks.

    Args:
        ct: (i, j, k) HU volume.
        heat: Map on the same grid, non-negative.
        affine: Voxel -> RAS+ mm (the NIfTI's).
        path: PNG to write.
        window: (centre, width) HU of the grey image.
        title: Shown above the views.
    """
    voxel = np.unravel_index(int(np.argmax(heat)), heat.shape)
    ct_views = canonical_views(ct, affine, voxel)
    heat_views = canonical_views(heat, affine, voxel)
    ornt = nib.orientations.io_orientation(affine)
    # mm per voxel along R, A, S
    size = {int(axis): float(mm) for (axis, _), mm in zip(ornt, nib.affines.voxel_sizes(affine), strict=True)}
    aspects = {"axial": size[1] / size[0], "coronal": size[2] / size[0], "sagittal": size[2] / size[1]}
    fig = Figure(figsize=(12, 4.4))  # no pyplot: the caller's backend (a notebook's) stays as it is
    axes = fig.subplots(1, 3)
    for ax, name in zip(axes, ("axial", "coronal", "sagittal"), strict=True):
        rgb = render_overlay(ct_views[name].astype(np.float32), heat_views[name], window=window)
        ax.imshow(rgb, aspect=aspects[name], interpolation="nearest")
        ax.set_title(name)
        ax.axis("off")
    fig.suptitle(f"{title}  (rollout over the CT, through its maximum; patient's right on the left)")
    fig.tight_layout()
    with atomic_write(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
