"""The scanner-randomised cohort for pretraining: heads of varied size, position and rotation, each patient scanned on
their own scanner (`vit_ct.sim.protocol`); a thick slice averages the anatomy over its slab (partial volume); bleeds
of all five kinds with mass effect; look-alikes including skull-base bone; rare metal implants."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from vit_ct.sim.anatomy import (
    HEAD_HEIGHT_MM,
    Anatomy,
    Geometry,
    HeadFrame,
    HeadShape,
    Tissue,
    draw_anatomy,
    harmonics,
    sample_head,
)  # fmt: skip
from vit_ct.sim.bleed import BLEED_TYPES, Bleed, draw_bleed, midline_shift, paint_bleed
from vit_ct.sim.lookalike import draw_lookalikes, paint_lookalikes
from vit_ct.sim.phantom import PhantomConfig, SimulatedSlice
from vit_ct.sim.projector import scan_circle
from vit_ct.sim.protocol import ScannerConfig, ScanProtocol, sample_motion, sample_protocol
from vit_ct.sim.scanner import simulate_acquisition

COHORT_STREAM = 7  # SeedSequence key: the cohort's patients never share draws with the demo set's (seed, index)
MASS_EFFECT_TYPES = ("intraparenchymal", "subdural", "epidural")  # drawn before the anatomy they displace


@dataclass(frozen=True)
class CohortConfig:
    """How the cohort's patients and lesions are drawn; `scanner` holds the scanner ranges.

    Args:
        size: rows and columns of a slice.
        bleed_fraction: probability that a slice carries one acute bleed.
        bleed_types: kinds of bleed drawn for positive slices (`BLEED_TYPES[1:]`).
        bleed_type_weights: relative frequency of each of `bleed_types`.
        bleed_hu_range: HU of acute blood.
        low_contrast_fraction: share of bleeds drawn from the lowest 10 HU of `bleed_hu_range`.
        small_fraction: share of bleeds only a few mm across or thick.
        small_radius_mm: radius range of small intraparenchymal bleeds, mm (1 mm: 2 mm across).
        lookalike_probability: chance of each bright look-alike where the anatomy has it.
        mass_effect: large intraparenchymal, subdural and epidural bleeds push the midline and squeeze a ventricle.
        metal_fraction: share of slices with a metal implant (clip, coil, shunt valve): a small spot of 8,000-20,000
            HU that starves its rays of photons and streaks.
        head_scale_range: head size (and all inside it) relative to the demo phantom's adult heads, uniform.
        head_offset_mm: largest distance of the head's centre from the scan centre, mm, uniform over a disk.
        head_rotation_deg: in-plane head rotation, uniform in [-this, this] degrees.
        sub_slice_mm: spacing of the levels a thick slice averages, mm.
        scanner: the scanner ranges.
    """

    size: int = 256
    bleed_fraction: float = 0.5
    bleed_types: tuple[str, ...] = BLEED_TYPES[1:]
    bleed_type_weights: tuple[float, ...] = (0.25, 0.2, 0.15, 0.15, 0.25)  # IVH on slices without ventricles: SAH
    bleed_hu_range: tuple[float, float] = (40.0, 90.0)
    low_contrast_fraction: float = 0.25
    small_fraction: float = 0.3
    small_radius_mm: tuple[float, float] = (1.0, 4.0)
    lookalike_probability: float = 0.4
    mass_effect: bool = True
    metal_fraction: float = 0.02
    head_scale_range: tuple[float, float] = (0.82, 1.08)
    head_offset_mm: float = 12.0
    head_rotation_deg: float = 20.0
    sub_slice_mm: float = 2.0
    scanner: ScannerConfig = field(default_factory=ScannerConfig)

    def __post_init__(self):
        self.phantom(230 / self.size)  # checks size and the lesion mix
        if not 0.5 <= self.small_radius_mm[0] <= self.small_radius_mm[1]:
            raise ValueError(f"small_radius_mm must be (low, high) with 0.5 <= low <= high, got {self.small_radius_mm}")
        if not 0.5 <= self.head_scale_range[0] <= self.head_scale_range[1] <= 1.3:
            raise ValueError(f"head_scale_range must lie within [0.5, 1.3], got {self.head_scale_range}")
        if self.head_offset_mm < 0 or not 0 <= self.head_rotation_deg <= 180 or self.sub_slice_mm <= 0:
            raise ValueError(
                f"need head_offset_mm >= 0, head_rotation_deg in [0, 180] and sub_slice_mm > 0; got "
                f"{self.head_offset_mm}, {self.head_rotation_deg}, {self.sub_slice_mm}"
            )
        if not 0 <= self.metal_fraction <= 1:
            raise ValueError(f"metal_fraction must be in [0, 1], got {self.metal_fraction}")

    def lesion_arguments(self, thickness_mm: float) -> dict:
        """The lesion mix as :func:`vit_ct.sim.bleed.draw_bleed` takes it, for a slab ``thickness_mm`` thick; every
        bleed in one hemisphere."""
        return {
            "hu_range": self.bleed_hu_range,
            "low_contrast_fraction": self.low_contrast_fraction,
            "small_fraction": self.small_fraction,
            "small_radius_mm": self.small_radius_mm,
            "slice_thickness_mm": thickness_mm,
            "one_hemisphere": True,
        }

    def phantom(self, pixel_spacing_mm: float) -> PhantomConfig:
        """The lesion mix as a `PhantomConfig` at this pixel size (its scanner fields are not used)."""
        return PhantomConfig(
            size=self.size,
            pixel_spacing_mm=pixel_spacing_mm,
            bleed_fraction=self.bleed_fraction,
            bleed_types=tuple(self.bleed_types),
            bleed_type_weights=tuple(self.bleed_type_weights),
            bleed_hu_range=tuple(self.bleed_hu_range),
            low_contrast_fraction=self.low_contrast_fraction,
            small_fraction=self.small_fraction,
            lookalike_probability=self.lookalike_probability,
        )


def _fitting_spacing(head: HeadShape, scale: float, size: int) -> float:
    """Smallest pixel size at which the whole head (its widest level, 0) lies inside the scan circle, with 3 mm to
    spare for the blur."""
    z = np.exp(1j * np.linspace(-np.pi, np.pi, 721)).astype(np.complex64)  # directions in the head's frame
    a, b = head.half_width_mm * scale, head.half_length_mm * scale
    skin = a * b / np.sqrt((b * z.real) ** 2 + (a * z.imag) ** 2) * (1 + harmonics(z, head.wobble, 2))  # mm
    points = complex(*head.centre_mm) + skin * z * np.exp(-1j * head.rotation)  # in the scanner's frame
    return (float(np.abs(points).max()) + 3) / (size // 2 - 1)


def draw_kind(rng: np.random.Generator, config: CohortConfig) -> str:
    if rng.random() >= config.bleed_fraction:
        return "none"
    weights = np.asarray(config.bleed_type_weights, float)
    return str(config.bleed_types[rng.choice(len(weights), p=weights / weights.sum())])


def _draw_metal(rng: np.random.Generator, g: Geometry, hu: np.ndarray) -> bool:
    """A small, very dense implant, painted into `hu` in place: an aneurysm clip or coil near the skull base's
    arteries, or a shunt valve against the skull. Returns whether the slice has one."""
    radius = rng.uniform(1.5, 4)
    if rng.random() < 0.5:
        centre = (rng.uniform(-20, 20), rng.uniform(-5, 25))  # near the circle of Willis, mm
        spot = np.hypot(g.x - centre[0], g.y - centre[1]) < radius
    else:
        angle = rng.uniform(-np.pi, np.pi)
        spot = (np.abs(np.angle(g.z * np.complex64(np.exp(-1j * angle)))) < radius / 70) & (np.abs(g.depth_inner) < 3)
    hu[spot] = rng.uniform(8000, 20000)
    return bool(spot.any())


def draw_thick_slice(
    rng: np.random.Generator, config: CohortConfig, head: HeadShape, frame: HeadFrame, level: float, thickness_mm: float
):
    """Draw one slice's lesions once and paint them on every level of its slab; the slice averages the levels.

    Returns:
        (`hu` float32 `(H, W)` slab average, bool mask of every pixel with blood anywhere in the slab, bleed type
        ("none" when the mask is empty), `tissue` of the middle level, whether it has metal).
    """
    n_levels = max(1, math.ceil(thickness_mm / config.sub_slice_mm - 1e-6))
    heights = ((np.arange(n_levels) + 0.5) / n_levels - 0.5) * thickness_mm  # mm above the slice's centre
    geometries = [Geometry(frame, head, level + dz / HEAD_HEIGHT_MM) for dz in heights]
    middle = n_levels // 2
    anatomy_seed = int(rng.integers(0, 2**63))  # the same sulci and midline at every level of the slab
    kind = draw_kind(rng, config)
    lesions = config.lesion_arguments(thickness_mm)
    bleed: Bleed | None = None
    shift = None
    if kind in MASS_EFFECT_TYPES:
        bleed = draw_bleed(rng, geometries[middle], kind, **lesions)
        shift = midline_shift(bleed, frame.fit) if config.mass_effect else None

    def anatomy_at(i: int):
        g = geometries[i]
        return draw_anatomy(np.random.default_rng(anatomy_seed), head, g, level + heights[i] / HEAD_HEIGHT_MM,
                            fissures=True, midline_shift=shift)  # fmt: skip

    anatomies = {middle: anatomy_at(middle)}
    if kind != "none" and bleed is None:
        bleed = draw_bleed(rng, geometries[middle], kind, anatomies[middle], **lesions)
    lookalikes = draw_lookalikes(rng, config.lookalike_probability, frame.fit, level, extended=True)
    hu, mask, tissue = paint_slab(geometries, heights, lambda i: anatomies[i] if i in anatomies else anatomy_at(i),
                                  lookalikes,
                                  bleed, [bleed is not None] * n_levels)  # fmt: skip
    metal = rng.random() < config.metal_fraction and _draw_metal(rng, geometries[middle], hu)
    if metal:
        tissue = np.where(hu > 5000, np.uint8(Tissue.METAL), tissue)
    # A bleed the grid cannot hold (sulci narrower than a coarse pixel) leaves the slice negative.
    return hu, mask, "none" if bleed is None or not mask.any() else bleed.kind, tissue, metal


def paint_slab(
    geometries: list[Geometry],
    offsets: np.ndarray,
    anatomy_at: Callable[[int], Anatomy],
    lookalikes: list,
    bleed: Bleed | None,
    reached: list[bool],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A slab's levels painted and averaged: at each level (``geometries``, ``offsets`` in mm above the slice's centre)
    its anatomy, the look-alikes, and the bleed where ``reached``.

    Returns:
        (``hu`` float32 ``(H, W)``, the slab's average; bool mask of every pixel with blood at some level; ``tissue``
        of the middle level).
    """
    hu_sum, mask, middle = None, np.zeros(geometries[0].frame.r.shape, bool), len(geometries) // 2
    for i, (g, dz) in enumerate(zip(geometries, offsets, strict=True)):
        anatomy = anatomy_at(i)
        paint_lookalikes(lookalikes, g, anatomy)
        if reached[i]:
            mask |= paint_bleed(bleed, g, anatomy, float(dz))
        hu_sum = anatomy.hu.astype(np.float64) if hu_sum is None else hu_sum + anatomy.hu
        if i == middle:
            tissue = anatomy.tissue
    return (hu_sum / len(geometries)).astype(np.float32), mask, tissue


def draw_patient(
    seed: int, index: int, config: CohortConfig
) -> tuple[np.random.Generator, HeadShape, float, ScanProtocol]:
    """Cohort patient `index`'s head (placed in the field of view), its scale and their scanner; and the generator,
    which then draws the first slice level."""
    rng = np.random.default_rng([seed, index, COHORT_STREAM])
    head = sample_head(rng)
    rotation = math.radians(config.head_rotation_deg)
    offset_mm, offset_angle = config.head_offset_mm * math.sqrt(rng.random()), rng.uniform(0, 2 * np.pi)
    head = replace(
        head,
        centre_mm=(offset_mm * math.cos(offset_angle), offset_mm * math.sin(offset_angle)),
        rotation=float(rng.uniform(-rotation, rotation)),
    )
    scale = float(rng.uniform(*config.head_scale_range))
    protocol = sample_protocol(
        rng, config.scanner, size=config.size, min_spacing_mm=_fitting_spacing(head, scale, config.size)
    )
    return rng, head, scale, protocol


def slice_generator(seed: int, index: int, slice_index: int) -> np.random.Generator:
    """The generator of one slice of cohort patient `index`: its lesions, motion, dose and noise."""
    return np.random.default_rng([seed, index, COHORT_STREAM, slice_index + 1])


def simulate_cohort_patient(
    seed: int,
    index: int,
    n_slices: int,
    config: CohortConfig = CohortConfig(),
    *,
    acquire: bool = True,  # noqa: B008
) -> list[SimulatedSlice]:
    """The slices of cohort patient `index`: one head and one scanner, evenly spaced levels from low to high, scanned
    in one batch (the projector's sparse matrices pay off from a few slices up).

    Seeded by (seed, index) alone and each slice by (seed, index, slice), so a patient does not depend on which
    worker draws it, in what order, or how many slices were drawn before it.

    Args:
        seed: seed of the cohort.
        index: the patient.
        n_slices: slices of the patient.
        config: how the cohort is drawn.
        acquire: simulate the scan; False returns the noiseless slab averages as `hu` (fast, for tests).
    """
    rng, head, scale, protocol = draw_patient(seed, index, config)
    frame = HeadFrame(config.size, protocol.pixel_spacing_mm, head, scale)
    start = rng.uniform(0.0, 0.25)
    levels = start + (1 - start) * np.arange(n_slices) / n_slices

    def draw(k: int, slice_rng: np.random.Generator):
        return draw_thick_slice(slice_rng, config, head, frame, float(levels[k]), protocol.slice_thickness_mm)

    return acquire_slices(seed, index, levels, draw, protocol, scale, config, acquire=acquire)


def acquire_slices(
    seed: int,
    index: int,
    levels: np.ndarray,
    draw,
    protocol: ScanProtocol,
    scale: float,
    config: CohortConfig,
    *,
    acquire: bool = True,
) -> list[SimulatedSlice]:
    """Cohort patient `index`'s slices at `levels` through their scanner, in one batch: each slice drawn by
    `draw(k, slice_rng)` (its `draw_thick_slice` tuple) from the slice's own generator, which then draws the slice's
    motion, dose and noise."""
    drawn, motions, doses, generators = [], [], [], []
    for k in range(len(levels)):
        slice_rng = slice_generator(seed, index, k)
        drawn.append(draw(k, slice_rng))
        motions.append(sample_motion(slice_rng, config.scanner))
        modulation = config.scanner.dose_modulation
        doses.append(protocol.photons_per_ray * math.exp(slice_rng.uniform(-1, 1) * math.log(modulation)))
        generators.append(torch.Generator().manual_seed(int(slice_rng.integers(0, 2**62))))
    hu_true = np.stack([d[0] for d in drawn])
    if acquire:
        hu_scanned, field_of_view = _scan(hu_true, protocol, np.stack(motions), doses, generators)
    else:
        hu_scanned, field_of_view = hu_true, np.broadcast_to(scan_circle(config.size, "cpu").numpy(), hu_true.shape)
    record = protocol.record()
    return [
        SimulatedSlice(
            hu=hu_scanned[k].copy(),
            hu_true=hu,
            mask=mask,
            label=int(kind != "none"),
            bleed_type=kind,
            tissue=tissue,
            field_of_view=field_of_view[k].copy(),
            level=float(levels[k]),
            photons_per_ray=round(doses[k], 1) if acquire else 0.0,
            kernel=protocol.kernel_name if acquire else "",
            pixel_spacing_mm=protocol.pixel_spacing_mm,
            slice_thickness_mm=protocol.slice_thickness_mm,
            settings={
                **record,
                "head_scale": round(scale, 3),
                "motion_mm": round(_largest_shift_mm(motions[k], config.size * protocol.pixel_spacing_mm / 2), 2),
                "metal": int(metal),
            },
        )
        for k, (hu, mask, kind, tissue, metal) in enumerate(drawn)
    ]


def _largest_shift_mm(motion: np.ndarray, radius_mm: float) -> float:
    """Largest displacement of a point of the field of view during the slice, mm."""
    return float(np.abs(motion[:, :2]).max(initial=0.0) + np.abs(motion[:, 2]).max(initial=0.0) * radius_mm)


def _scan(hu_true, protocol: ScanProtocol, motions: np.ndarray, doses, generators):
    """The patient's slices through their scanner, in one batch."""
    scan = simulate_acquisition(
        hu_true,
        generator=generators,
        photons_per_ray=np.asarray(doses),
        kernel=protocol.kernel,
        pixel_spacing_mm=protocol.pixel_spacing_mm,
        n_angles=protocol.n_angles,
        beam_hardening=protocol.beam_hardening,
        blur_px=protocol.blur_px,
        cupping=protocol.cupping,
        detector_gains=torch.from_numpy(protocol.detector_gains),
        motion=torch.from_numpy(motions) if motions.any() else None,
        hu_gain=protocol.hu_gain,
        hu_offset=protocol.hu_offset,
        method="matrix",
    )
    return scan.hu.numpy(), scan.field_of_view.numpy()
