"""The unit a slice's distances are measured in: mm on its own pixel spacing where it has one, else pixels of the
source slice, never a guessed field of view (the pointing tolerance and HD95 of :mod:`vit_ct.metrics.localisation`)."""

from __future__ import annotations

import math

import torch

# The side of the square a synthetic slice is padded to, in mm (256 x 0.9 mm; a typical head-CT reconstruction, 512 x
# 0.45 mm, spans the same): what the benchmarks state for synthetic sets. vit-ct's own metrics never assume it.
HEAD_FIELD_OF_VIEW_MM = 230.0


def slice_spacing(
    pixel_spacing_mm: float | torch.Tensor | None,
    source_shape: torch.Tensor | None,
    size: int,
    n: int,
    device: torch.device,
    *,
    default_mm: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The size of a pixel of the ``size`` x ``size`` grid the maps lie on, per slice, and its unit.

    Args:
        pixel_spacing_mm: mm per grid pixel, one for all or ``(n,)``; NaN (or None) where unknown.
        source_shape: ``(n, 2)`` rows, columns of each source slice (padded to a square of the longer side, then
            resized to ``size``); None: the maps' grid is the source's.
        size: Side of the maps' grid in pixels.
        n: Slices.
        device: Of the results.
        default_mm: mm per grid pixel where the slice gives none, when the caller knows it; None: no guess.

    Returns:
        ``(n,)`` float64 pixel size, and ``(n,)`` bool ``in_mm``: True where it is in mm, False where, the spacing
        being unknown, it is in pixels of the source slice (``max(rows, cols) / size``).
    """
    given = torch.full((n,), math.nan, dtype=torch.float64, device=device)
    if pixel_spacing_mm is not None:
        given = torch.as_tensor(pixel_spacing_mm, dtype=torch.float64, device=device).expand(n)
    if default_mm is not None:
        given = torch.where(torch.isnan(given), torch.full_like(given, float(default_mm)), given)
    in_mm = ~torch.isnan(given)
    if source_shape is None:
        source_px = torch.ones(n, dtype=torch.float64, device=device)
    else:
        source_px = torch.as_tensor(source_shape, device=device).amax(dim=-1).double() / size
    return torch.where(in_mm, given, source_px), in_mm


def pixel_units_note(tolerance_mm: float, counted: str = "slices") -> str:
    """One line saying what the scores of slices without a pixel spacing are measured in (``counted`` says which)."""
    return (
        f"{counted} without a pixel spacing (a .npy file, and no pixel_spacing_mm column in the manifest) are scored"
        f" in pixels of their source slice: a pointing tolerance of {tolerance_mm:g} pixels instead of"
        f" {tolerance_mm:g} mm, and HD95 as hd95_px; a pixel_spacing_mm column (mm per pixel) scores them in mm"
    )


def model_grid_spacing_mm(img_size: int, field_of_view_mm: float = HEAD_FIELD_OF_VIEW_MM) -> float:
    """Pixel size in mm on the ``img_size`` model grid of a slice whose padded square spans ``field_of_view_mm``."""
    return field_of_view_mm / img_size
