"""Acute intracranial bleeds of the five RSNA kinds with exact masks: intraparenchymal, subdural, epidural,
subarachnoid and intraventricular. Drawn once per slice in mm, then painted at any level of a thick slice."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from vit_ct.sim.anatomy import Anatomy, Geometry, Tissue, harmonics, wrap_angle

BLEED_TYPES = ("none", "intraparenchymal", "subdural", "epidural", "subarachnoid", "intraventricular")


@dataclass(frozen=True)
class Bleed:
    """One bleed. Lengths in mm in the head's frame, angles in radians.

    Attributes:
        kind: one of `BLEED_TYPES[1:]`.
        hu: density of the blood.
        centre: intraparenchymal, intraventricular clot: (x, y) of its centre; subdural, epidural: (angle around
            the head, 0); subarachnoid: (angle of the blood-filled sector, its half width).
        size: intraparenchymal: radius; subdural, epidural: thickness at the centre before the head's `fit`;
            intraventricular: clot radius, or for a fluid level the height of blood above the ventricles' lowest
            point; subarachnoid: 1 when the cisterns and fissures fill too, else 0.
        extent: subdural, epidural: angular half extent.
        shape: intraparenchymal: `(3, 2)` outline harmonics.
        oedema: intraparenchymal: (rim width, HU) of the oedema around it, or None.
        layered: intraventricular: a fluid level (blood sinks towards the table) instead of a clot.
        z_offset_mm: height of the bleed's centre above the slice's centre (thick slices).
        z_half_mm: half height: the bleed narrows as sqrt(1 - (dz / z_half_mm)^2) above and below its centre.
    """

    kind: str
    hu: float
    centre: tuple[float, float]
    size: float
    extent: float = 0.0
    shape: np.ndarray | None = field(default=None, repr=False, compare=False)
    oedema: tuple[float, float] | None = None
    layered: bool = False
    z_offset_mm: float = 0.0
    z_half_mm: float = math.inf

    def narrowing(self, dz_mm: float) -> float:
        """Factor on the bleed's size at `dz_mm` above the slice's centre: 1 at its centre, 0 beyond its height."""
        if math.isinf(self.z_half_mm):
            return 1.0
        return math.sqrt(max(0.0, 1 - ((dz_mm - self.z_offset_mm) / self.z_half_mm) ** 2))


def draw_bleed(
    rng: np.random.Generator,
    g: Geometry,
    kind: str,
    anatomy: Anatomy | None = None,
    *,
    hu_range: tuple[float, float],
    low_contrast_fraction: float,
    small_fraction: float,
    small_radius_mm: tuple[float, float] = (1.5, 4.0),
    slice_thickness_mm: float | None = None,
    one_hemisphere: bool = False,
) -> Bleed:
    """Draw one bleed of `kind` for the slice of geometry `g` (the demo's phantom draws them in this order).

    Args:
        rng: source of the draws.
        g: geometry of the slice (its centre level for a thick slice).
        kind: one of `BLEED_TYPES[1:]`; an intraventricular bleed on a slice without ventricles becomes subarachnoid.
        anatomy: the slice's anatomy; needed for subarachnoid and intraventricular bleeds (sulci, ventricles).
        hu_range: HU of acute blood.
        low_contrast_fraction: share drawn from the lowest 10 HU of `hu_range`.
        small_fraction: share only a few mm across or thick.
        small_radius_mm: radius range of small intraparenchymal bleeds.
        slice_thickness_mm: for thick slices: also draw the bleed's height and where the slice cuts it.
        one_hemisphere: keep intraparenchymal bleeds off the midline (the falx separates the hemispheres).
    """
    low, high = hu_range
    small = rng.random() < small_fraction
    hu = rng.uniform(low, low + 10) if rng.random() < low_contrast_fraction else rng.uniform(low + 10, high)
    if kind == "intraventricular" and not (anatomy.ventricles & (anatomy.tissue == Tissue.CSF)).any():
        kind = "subarachnoid"
    if kind == "intraparenchymal":
        radius = rng.uniform(*small_radius_mm) if small else rng.uniform(4, 25) * g.fit
        brain = g.depth_brain >= 0
        room = brain & (g.depth_brain > 1.2 * radius + 2)
        candidates = np.flatnonzero(room & (np.abs(g.x) > 1.1 * radius + 2) if one_hemisphere else room)
        if candidates.size == 0:
            candidates = np.flatnonzero(g.depth_brain >= g.depth_brain.max() - 1)
        pixel = np.unravel_index(rng.choice(candidates), g.r.shape)
        shape = np.stack([rng.uniform(0, 0.12, 3), rng.uniform(0, 2 * np.pi, 3)], 1)
        oedema = None
        if rng.random() < 0.6:
            width = rng.uniform(1.5, 5)
            oedema = (width, rng.uniform(10, 20))
        bleed = Bleed(kind, hu, (g.x[pixel], g.y[pixel]), radius, shape=shape, oedema=oedema)
        z_half = radius * rng.uniform(0.7, 1.3) if slice_thickness_mm else math.inf
    elif kind in ("subdural", "epidural"):
        angle = rng.uniform(-np.pi, np.pi)
        if kind == "subdural":  # crescent along the inner table, thin at both ends
            extent = rng.uniform(0.25, 0.5) if small else rng.uniform(0.6, 1.3)
            thickness = rng.uniform(1, 3) if small else rng.uniform(3, 12)
        else:  # epidural: biconvex lens against the skull
            extent = rng.uniform(0.12, 0.25) if small else rng.uniform(0.25, 0.5)
            thickness = rng.uniform(2.5, 5) if small else rng.uniform(6, 22)
        bleed = Bleed(kind, hu, (angle, 0.0), thickness, extent=extent)
        z_half = rng.uniform(20, 60) if slice_thickness_mm else math.inf
    elif kind == "subarachnoid":  # blood in the sulci of a sector; large ones fill the fissures and cisterns too
        angle, half_width = rng.uniform(-np.pi, np.pi), rng.uniform(0.04, 0.15) if small else rng.uniform(0.3, 1.2)
        half_width = _widen_to_a_sulcus(g, anatomy, angle, half_width)
        bleed = Bleed(kind, hu, (angle, half_width), float(not small and rng.random() < 0.6))
        z_half = math.inf
    elif kind == "intraventricular":
        spaces = anatomy.ventricles & (anatomy.tissue == Tissue.CSF)
        if rng.random() < 0.6:  # layering: blood sinks towards the table, a flat level in the scanner's frame
            height = rng.uniform(1, 3) if small else rng.uniform(3, 10)
            bleed = Bleed(kind, hu, (0.0, float(g.y_scanner[spaces].min())), height, layered=True)
        else:
            pixel = np.unravel_index(rng.choice(np.flatnonzero(spaces)), g.r.shape)
            radius = rng.uniform(1.5, 3) if small else rng.uniform(4, 12)
            bleed = Bleed(kind, hu, (g.x[pixel], g.y[pixel]), radius)
        z_half = math.inf
    else:
        raise ValueError(f"bleed type must be one of {BLEED_TYPES[1:]}, got {kind!r}")
    if slice_thickness_mm:  # the bleed's centre lies inside the slab, so some of it always shows
        offset = rng.uniform(-0.5, 0.5) * min(slice_thickness_mm, z_half)
        bleed = replace(bleed, z_offset_mm=offset, z_half_mm=z_half)
    return bleed


def _widen_to_a_sulcus(g: Geometry, anatomy: Anatomy, angle: float, half_width: float) -> float:
    """The sector's half width, doubled until it holds some sulcal CSF (a narrow sector can fall between sulci)."""
    sulcal = anatomy.sulci & (anatomy.tissue == Tissue.CSF)
    distance = np.abs(wrap_angle(g.phi - np.float32(angle)))
    while half_width < np.pi and np.count_nonzero(sulcal & (distance < half_width)) < 4:
        half_width *= 2
    return half_width


def paint_bleed(bleed: Bleed, g: Geometry, anatomy: Anatomy, dz_mm: float = 0.0) -> np.ndarray:
    """Paint the bleed into `anatomy.tissue` and `anatomy.hu` in place at the level of geometry `g`, `dz_mm` above
    the slice's centre; returns its bool mask (an oedema rim is not part of it)."""
    factor = bleed.narrowing(dz_mm)
    tissue, hu = anatomy.tissue, anatomy.hu
    if bleed.kind == "intraparenchymal":
        brain = g.depth_brain >= 0
        dx, dy = g.x - bleed.centre[0], g.y - bleed.centre[1]
        rho = np.hypot(dx, dy)
        radius = bleed.size if factor == 1 else bleed.size * factor
        outline = radius * (1 + harmonics((dx + 1j * dy).astype(np.complex64) / np.maximum(rho, 1e-6), bleed.shape, 2))
        mask = brain & (rho < outline) if factor > 0 else np.zeros(g.r.shape, bool)
        if bleed.oedema is not None and factor > 0:
            width, oedema_hu = bleed.oedema
            rim = (rho < outline + width) & ~mask & np.isin(tissue, (Tissue.GREY, Tissue.WHITE))
            tissue[rim] = Tissue.OEDEMA
            hu[rim] = oedema_hu
    elif bleed.kind in ("subdural", "epidural"):
        u = wrap_angle(g.phi - bleed.centre[0]) / bleed.extent
        thickness = bleed.size if factor == 1 else bleed.size * factor
        if bleed.kind == "subdural":
            profile = thickness * g.fit * (1 - u**2)
        else:
            profile = thickness * g.fit * np.sqrt(np.clip(1 - u**2, 0, None))
        mask = (np.abs(u) < 1) & (g.depth_inner >= 0) & (g.depth_inner < profile)
    elif bleed.kind == "subarachnoid":
        angle, half_width = bleed.centre
        spaces = anatomy.sulci & (np.abs(wrap_angle(g.phi - np.float32(angle))) < half_width)
        mask = (spaces | anatomy.cisterns if bleed.size else spaces) & (tissue == Tissue.CSF)
    else:
        ventricles = anatomy.ventricles & (tissue == Tissue.CSF)
        if bleed.layered:
            mask = ventricles & (g.y_scanner < bleed.centre[1] + bleed.size)
        else:
            mask = ventricles & (np.hypot(g.x - bleed.centre[0], g.y - bleed.centre[1]) < bleed.size)
    tissue[mask] = Tissue.BLEED
    hu[mask] = bleed.hu
    return mask


def midline_shift(bleed: Bleed, fit: float) -> tuple[float, float] | None:
    """Mass effect of a large intraparenchymal, subdural or epidural bleed: (shift right in mm, anterior position of
    its peak in mm), away from the bleed; None when it would be under 0.5 mm."""
    if bleed.kind == "intraparenchymal":
        amount, (x, y) = 0.45 * (bleed.size - 10), bleed.centre
    elif bleed.kind in ("subdural", "epidural"):
        thickness = bleed.size * fit
        amount = 0.6 * (thickness - 4) if bleed.kind == "subdural" else 0.45 * (thickness - 6)
        x, y = math.cos(bleed.centre[0]), 60 * math.sin(bleed.centre[0])
    else:
        return None
    if amount < 0.5:
        return None
    return (-math.copysign(min(amount, 12.0), x), float(y))
