"""Whole scans of cohort patients: contiguous slices through one head at a fixed spacing, as a scanner reconstructs a
routine head CT, with each lesion drawn once per patient as a 3-D object that every slice it reaches shows.

The cohort's patients (:func:`vit_ct.sim.cohort.simulate_cohort_patient`) are slices spread over the head, each with
its own lesions: a slice tells nothing about the next. Here, as in a real scan, a bleed spans the slices it reaches,
widest at its centre and narrowing above and below it (an ellipsoid's cross-sections); subarachnoid and
intraventricular blood reach a drawn height range; the sulci, the midline and the look-alikes (calcifications,
skull-base bone) are the same head's on every slice. This is what reading a slice with its neighbours learns from.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from vit_ct.sim.anatomy import HEAD_HEIGHT_MM, Geometry, HeadFrame, HeadShape, draw_anatomy
from vit_ct.sim.bleed import Bleed, draw_bleed, midline_shift
from vit_ct.sim.cohort import MASS_EFFECT_TYPES, CohortConfig, acquire_slices, draw_kind, draw_patient, paint_slab
from vit_ct.sim.lookalike import draw_lookalikes
from vit_ct.sim.phantom import SimulatedSlice

# Height range of subarachnoid and intraventricular blood, which the slice drawing leaves unbounded, mm (half heights)
SPREAD_HALF_MM = (8.0, 25.0)


def simulate_cohort_scan(
    seed: int,
    index: int,
    n_slices: int,
    config: CohortConfig = CohortConfig(),  # noqa: B008 (frozen dataclass: immutable default)
    *,
    spacing_mm: float = 5.0,
    acquire: bool = True,
) -> list[SimulatedSlice]:
    """Cohort patient `index` scanned as `n_slices` contiguous slices `spacing_mm` apart (lowest first): their head
    and scanner (:func:`~vit_ct.sim.cohort.draw_patient`), at most one bleed, drawn with probability
    `config.bleed_fraction` for the patient, its height within the scanned range; every slice whose slab it reaches
    shows it (a slice's label is whether its mask holds any blood). Look-alikes and the anatomy are the patient's own
    on every slice; no metal implants.

    Args:
        seed: seed of the cohort (the same patient's head and scanner as `simulate_cohort_patient`).
        index: the patient.
        n_slices: slices of the scan.
        config: how the cohort is drawn.
        spacing_mm: distance between the slices' centres, mm (each averages the protocol's slice thickness).
        acquire: simulate the scanner; False returns the noiseless slab averages (fast, for tests).

    Raises:
        ValueError: the scan would not fit the head's height (`vit_ct.sim.anatomy.HEAD_HEIGHT_MM`).
    """
    span = (n_slices - 1) * spacing_mm
    if n_slices < 1 or not spacing_mm > 0 or span > HEAD_HEIGHT_MM:
        raise ValueError(
            f"a scan of {n_slices} slices {spacing_mm} mm apart must fit the head's {HEAD_HEIGHT_MM:g} mm"
            f" (n_slices >= 1, spacing_mm > 0, (n_slices - 1) x spacing_mm <= {HEAD_HEIGHT_MM:g})"
        )
    rng, head, scale, protocol = draw_patient(seed, index, config)
    frame = HeadFrame(config.size, protocol.pixel_spacing_mm, head, scale)
    heights = rng.uniform(0.0, HEAD_HEIGHT_MM - span) + spacing_mm * np.arange(n_slices)  # mm above level 0
    anatomy_seed, lookalike_seed = (int(v) for v in rng.integers(0, 2**63, size=2))
    thickness = protocol.slice_thickness_mm
    lesion = draw_scan_bleed(rng, config, head, frame, heights, thickness, anatomy_seed)

    def draw(k: int, slice_rng: np.random.Generator):
        return draw_scan_slice(config, head, frame, float(heights[k]), thickness, lesion, anatomy_seed, lookalike_seed)

    return acquire_slices(seed, index, heights / HEAD_HEIGHT_MM, draw, protocol, scale, config, acquire=acquire)


def draw_scan_bleed(
    rng: np.random.Generator,
    config: CohortConfig,
    head: HeadShape,
    frame: HeadFrame,
    heights: np.ndarray,
    thickness_mm: float,
    anatomy_seed: int,
) -> tuple[Bleed, float] | None:
    """The patient's bleed and the height of its centre (mm above level 0, within the scanned `heights`), or None."""
    kind = draw_kind(rng, config)
    if kind == "none":
        return None
    centre_mm = float(rng.uniform(heights[0], heights[-1]))
    level = centre_mm / HEAD_HEIGHT_MM
    g = Geometry(frame, head, level)
    anatomy = draw_anatomy(np.random.default_rng(anatomy_seed), head, g, level, fissures=True)
    bleed = draw_bleed(rng, g, kind, anatomy, **config.lesion_arguments(thickness_mm))
    if math.isinf(bleed.z_half_mm):
        bleed = replace(bleed, z_half_mm=float(rng.uniform(*SPREAD_HALF_MM)))
    return replace(bleed, z_offset_mm=0.0), centre_mm


def draw_scan_slice(
    config: CohortConfig,
    head: HeadShape,
    frame: HeadFrame,
    height_mm: float,
    thickness_mm: float,
    lesion: tuple[Bleed, float] | None,
    anatomy_seed: int,
    lookalike_seed: int,
):
    """One slice of the scan, as :func:`~vit_ct.sim.cohort.draw_thick_slice` returns it (slab average, blood mask,
    bleed type, middle tissue, no metal), with the patient's lesion painted where the slab reaches it."""
    n_levels = max(1, math.ceil(thickness_mm / config.sub_slice_mm - 1e-6))
    offsets = ((np.arange(n_levels) + 0.5) / n_levels - 0.5) * thickness_mm  # mm above the slice's centre
    bleed = None if lesion is None else replace(lesion[0], z_offset_mm=lesion[1] - height_mm)
    reached = [bleed is not None and bleed.narrowing(float(dz)) > 0 for dz in offsets]
    shift = None
    if any(reached) and bleed.kind in MASS_EFFECT_TYPES and config.mass_effect:
        shift = midline_shift(bleed, frame.fit)
    lookalikes = draw_lookalikes(np.random.default_rng(lookalike_seed), config.lookalike_probability, frame.fit,
                                 height_mm / HEAD_HEIGHT_MM, extended=True)  # fmt: skip
    levels = [(height_mm + dz) / HEAD_HEIGHT_MM for dz in offsets]
    geometries = [Geometry(frame, head, level) for level in levels]

    def anatomy_at(i: int):
        return draw_anatomy(np.random.default_rng(anatomy_seed), head, geometries[i], levels[i], fissures=True,
                            midline_shift=shift)  # fmt: skip

    hu, mask, tissue = paint_slab(geometries, offsets, anatomy_at, lookalikes, bleed, reached)
    # A bleed the grid cannot hold (sulci narrower than a coarse pixel) leaves the slice negative.
    return hu, mask, "none" if bleed is None or not mask.any() else bleed.kind, tissue, False
