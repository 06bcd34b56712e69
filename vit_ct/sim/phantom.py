"""Synthetic axial head-CT slices in HU: skull, brain, ventricles, look-alikes and acute bleeds, then a noisy scan.

Anatomy is drawn in numpy on a pixel grid from a `numpy.random.Generator`; `vit_ct.sim.scanner` adds the CT physics.
"""

import math
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import torch

from vit_ct.sim.scanner import FILTER_NAMES, simulate_acquisition

BLEED_TYPES = ("none", "intraparenchymal", "subdural", "epidural")


class Tissue(IntEnum):
    """Tissue codes of `SimulatedSlice.tissue`."""

    AIR = 0
    SCALP = 1
    BONE = 2  # cortical tables
    DIPLOE = 3  # cancellous bone between the tables
    CSF = 4
    GREY = 5
    WHITE = 6
    FALX = 7
    CALCIFICATION = 8  # pineal, choroid plexus, falx: bright look-alikes
    OEDEMA = 9
    BLEED = 10


@dataclass(frozen=True)
class PhantomConfig:
    """How synthetic slices are drawn.

    Args:
        size: rows and columns of a slice.
        pixel_spacing_mm: pixel size, mm (256 x 0.9 mm covers a 230 mm field of view).
        bleed_fraction: probability that a slice carries one acute bleed.
        bleed_types: kinds of bleed drawn for positive slices.
        bleed_type_weights: relative frequency of each of `bleed_types`.
        bleed_hu_range: HU of acute blood.
        low_contrast_fraction: share of bleeds drawn from the lowest 10 HU of `bleed_hu_range` (hard cases).
        small_fraction: share of bleeds only a few mm across or thick (hard cases).
        lookalike_probability: chance of each bright look-alike (pineal / choroid plexus / falx calcification).
        photons_per_ray_range: dose, unattenuated photons per detector bin and view, drawn log-uniformly.
        kernels: reconstruction filters drawn uniformly (see `vit_ct.sim.scanner.fourier_filter`).
        beam_hardening: strength of the bone beam-hardening term (0 disables it; costs ~20% more time).
    """

    size: int = 256
    pixel_spacing_mm: float = 0.9
    bleed_fraction: float = 0.5
    bleed_types: tuple[str, ...] = ("intraparenchymal", "subdural", "epidural")
    bleed_type_weights: tuple[float, ...] = (0.4, 0.35, 0.25)
    bleed_hu_range: tuple[float, float] = (50.0, 90.0)
    low_contrast_fraction: float = 0.25
    small_fraction: float = 0.25
    lookalike_probability: float = 0.3
    photons_per_ray_range: tuple[float, float] = (8.0e5, 3.0e6)
    kernels: tuple[str, ...] = ("cosine", "hamming", "hann")
    beam_hardening: float = 0.0

    def __post_init__(self):
        if self.size < 32:
            raise ValueError(f"size must be at least 32 pixels, got {self.size}")
        if self.size * self.pixel_spacing_mm < 200:
            raise ValueError(
                f"size * pixel_spacing_mm must cover a head (>= 200 mm), got {self.size * self.pixel_spacing_mm} mm"
            )
        for name in ("bleed_fraction", "low_contrast_fraction", "small_fraction", "lookalike_probability"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        unknown = set(self.bleed_types) - set(BLEED_TYPES[1:])
        if unknown or not self.bleed_types or len(self.bleed_type_weights) != len(self.bleed_types):
            raise ValueError(
                f"bleed_types must be non-empty, from {BLEED_TYPES[1:]}, with one weight each; "
                f"got {self.bleed_types} and weights {self.bleed_type_weights}"
            )
        if not set(self.kernels) <= set(FILTER_NAMES) or not self.kernels:
            raise ValueError(f"kernels must be non-empty and from {FILTER_NAMES}, got {self.kernels}")
        if not 0 < self.photons_per_ray_range[0] <= self.photons_per_ray_range[1]:
            raise ValueError(f"photons_per_ray_range must be (low, high) > 0, got {self.photons_per_ray_range}")


@dataclass(frozen=True)
class HeadShape:
    """One synthetic patient's head, shared by all of their slices. Lengths in mm, densities in HU."""

    centre_mm: tuple[float, float]
    rotation: float  # radians
    half_width_mm: float  # left-right, skin to skin at the widest level
    half_length_mm: float  # front-back
    wobble: np.ndarray = field(repr=False)  # (4, 2) amplitude and phase of radial harmonics 2..5
    scalp_mm: float = 4.0
    skull_mm: float = 6.0
    skull_wobble: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((3, 2)))
    diploe_fraction: float = 0.4
    bone_hu: float = 1300.0
    diploe_hu: float = 500.0
    scalp_hu: float = 40.0
    csf_rim_mm: float = 1.5
    csf_hu: float = 8.0
    grey_hu: float = 40.0
    white_hu: float = 25.0
    falx_hu: float = 50.0
    cortex_mm: float = 3.0
    ventricle_scale: float = 1.0
    n_sulci: int = 24
    sulcus_phase: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((3, 2)))


@dataclass
class SimulatedSlice:
    """One synthetic slice.

    Attributes:
        hu: float32 `(H, W)` scanned image in HU (equal to `hu_true` when acquisition was skipped).
        hu_true: float32 `(H, W)` noiseless anatomy in HU.
        mask: bool `(H, W)`, exactly the pixels painted as bleed.
        label: 1 if a bleed is present, else 0.
        bleed_type: one of `BLEED_TYPES`.
        tissue: uint8 `(H, W)` `Tissue` codes of `hu_true`.
        field_of_view: bool `(H, W)`, inside the scan circle (outside: no data, PixelPaddingValue on disk).
        level: slice height in the head, 0 (ventricles) to 1 (vertex).
        photons_per_ray: dose used (0 when acquisition was skipped).
        kernel: reconstruction filter used ("" when acquisition was skipped).
        pixel_spacing_mm: pixel size, mm.
    """

    hu: np.ndarray
    hu_true: np.ndarray
    mask: np.ndarray
    label: int
    bleed_type: str
    tissue: np.ndarray
    field_of_view: np.ndarray
    level: float
    photons_per_ray: float
    kernel: str
    pixel_spacing_mm: float


def sample_head(rng: np.random.Generator) -> HeadShape:
    """Draw one patient's head shape, layer thicknesses and tissue densities."""
    return HeadShape(
        centre_mm=(rng.uniform(-4, 4), rng.uniform(-4, 4)),
        rotation=rng.uniform(-0.15, 0.15),
        half_width_mm=rng.uniform(66, 78),
        half_length_mm=rng.uniform(84, 98),
        wobble=np.stack([rng.uniform(0, 0.025, 4), rng.uniform(0, 2 * np.pi, 4)], 1),
        scalp_mm=rng.uniform(3, 6),
        skull_mm=rng.uniform(4.5, 8),
        skull_wobble=np.stack([rng.uniform(0, 0.25, 3), rng.uniform(0, 2 * np.pi, 3)], 1),
        diploe_fraction=rng.uniform(0.3, 0.5),
        bone_hu=rng.uniform(900, 1800),
        diploe_hu=rng.uniform(300, 700),
        scalp_hu=rng.uniform(25, 55),
        csf_rim_mm=rng.uniform(0.8, 2.5),
        csf_hu=rng.uniform(2, 13),
        grey_hu=rng.uniform(36, 44),
        white_hu=rng.uniform(21, 29),
        falx_hu=rng.uniform(40, 60),
        cortex_mm=rng.uniform(2.5, 3.5),
        ventricle_scale=rng.uniform(0.7, 1.4),
        n_sulci=int(rng.integers(18, 30)),
        sulcus_phase=np.stack([rng.uniform(0, 1.2, 3), rng.uniform(0, 2 * np.pi, 3)], 1),
    )


def _harmonics(z: np.ndarray, coefficients: np.ndarray, first: int) -> np.ndarray:
    """Sum of a_k cos((first + k) phi + p_k) over rows (a_k, p_k) of `coefficients`, given z = exp(i phi).

    Powers of z replace cos() calls: 5x faster on a 256x256 grid.
    """
    weights = coefficients[:, 0] * np.exp(1j * coefficients[:, 1])
    power = z**first
    total = np.zeros(z.shape, np.complex64)
    for weight in weights:
        total += np.complex64(weight) * power
        power = power * z
    return total.real


def _wrap(angle: np.ndarray) -> np.ndarray:
    """Angle in [-pi, pi]; rounding is 3x faster than a float modulo."""
    return angle - np.float32(2 * np.pi) * np.round(angle * np.float32(0.5 / np.pi))


def _ellipse(x, y, centre, axes, angle=0.0) -> np.ndarray:
    """Bool mask of an ellipse; lengths in mm, angle in radians."""
    dx, dy = x - centre[0], y - centre[1]
    u = dx * math.cos(angle) + dy * math.sin(angle)
    v = -dx * math.sin(angle) + dy * math.cos(angle)
    return (u / axes[0]) ** 2 + (v / axes[1]) ** 2 <= 1


class _Geometry:
    """Per-slice coordinates in the head's frame (x right, y anterior), in mm, and depths below the layers."""

    def __init__(self, config: PhantomConfig, head: HeadShape, level: float):
        offsets = (np.arange(config.size) - (config.size - 1) / 2) * config.pixel_spacing_mm
        xs, ys = offsets[None, :] - head.centre_mm[0], -offsets[:, None] - head.centre_mm[1]
        cos, sin = math.cos(head.rotation), math.sin(head.rotation)
        self.x = (cos * xs + sin * ys).astype(np.float32)  # (H, W)
        self.y = (-sin * xs + cos * ys).astype(np.float32)
        self.r = np.hypot(self.x, self.y)
        self.phi = np.arctan2(self.y, self.x)
        self.z = (self.x + 1j * self.y).astype(np.complex64) / np.maximum(self.r, 1e-6)  # exp(i phi)
        # Narrower cross-sections towards the vertex; heads shrink to fit a small field of view.
        fit = min(1.0, (config.size * config.pixel_spacing_mm / 2 - 4) / 110)
        scale = fit * math.sqrt(1 - (0.7 * level) ** 2)
        a, b = head.half_width_mm * scale, head.half_length_mm * scale
        cos_phi, sin_phi = self.z.real, self.z.imag
        outer = a * b / np.sqrt((b * cos_phi) ** 2 + (a * sin_phi) ** 2) * (1 + _harmonics(self.z, head.wobble, 2))
        self.depth = outer - self.r  # mm below the skin, radial approximation of the normal distance
        self.skull = head.skull_mm * fit * (1 + 0.6 * _harmonics(self.z, head.skull_wobble, 1))
        self.depth_inner = self.depth - head.scalp_mm * fit - self.skull  # mm below the inner table
        self.depth_brain = self.depth_inner - head.csf_rim_mm * (
            1 + 0.3 * (self.z**3 * np.complex64(np.exp(1j * head.rotation))).real
        )
        self.fit = fit


def _draw_anatomy(rng: np.random.Generator, head: HeadShape, g: _Geometry, level: float):
    """Paint the normal head; lengths in mm.

    Returns:
        `tissue` uint8 (H, W), `hu` float32 (H, W), and the midline as (distance across it in mm, bool mask of
        where the fissure runs) for the falx look-alike.
    """
    tissue = np.full(g.r.shape, Tissue.AIR, np.uint8)
    tissue[g.depth >= 0] = Tissue.SCALP
    scalp = g.depth - g.depth_inner - g.skull
    tissue[g.depth >= scalp] = Tissue.BONE
    below_outer_table = g.depth - scalp
    diploe = (below_outer_table >= 0.3 * g.skull) & (below_outer_table < (0.3 + head.diploe_fraction) * g.skull)
    tissue[diploe] = Tissue.DIPLOE
    tissue[g.depth_inner >= 0] = Tissue.CSF
    brain = g.depth_brain >= 0
    tissue[brain] = Tissue.WHITE
    db = g.depth_brain
    cortex = head.cortex_mm * g.fit
    tissue[brain & (db < cortex)] = Tissue.GREY

    # Sulci: lines where a winding phase crosses multiples of 2 pi, bending with depth and forking inward.
    k = head.n_sulci
    phase = k * (g.phi + 0.08 * _harmonics(g.z, head.sulcus_phase, 2)) + rng.uniform(0, 2 * np.pi)
    phase = phase + rng.uniform(-0.08, 0.08) * db
    index = np.round(phase / (2 * np.pi)).astype(np.int64) % k
    depths = (rng.uniform(6, 20, k) * g.fit)[index]  # mm, one per sulcus
    forks = depths * rng.uniform(0.35, 0.7, k)[index]
    spread = g.r / k  # mm per radian of phase
    half_width = 0.7  # mm
    distance = np.abs(_wrap(phase)) * spread
    for sign in (-1, 1):
        branch = np.abs(_wrap(phase + sign * 0.12 * np.clip(db - forks, 0, None))) * spread
        distance = np.where(db > forks, np.minimum(distance, branch), distance)
    inside = brain & (db < depths + cortex)
    tissue[inside & (distance < half_width + cortex) & (tissue == Tissue.WHITE)] = Tissue.GREY
    tissue[inside & (db < depths) & (distance < half_width)] = Tissue.CSF

    # Deep structures; ventricles shrink to nothing by level 0.65 (centrum semiovale and above).
    v = head.ventricle_scale * g.fit
    size = max(0.0, 1 - level / 0.65)
    gap_front, gap_back = 0.0, 0.0
    if level < 0.3:
        for side in (-1, 1):
            tissue[_ellipse(g.x, g.y, (side * 9 * v, -6 * v), (7 * v, 9 * v)) & brain] = Tissue.GREY  # thalamus
            tissue[_ellipse(g.x, g.y, (side * 11 * v, 12 * v), (4 * v, 7 * v)) & brain] = Tissue.GREY  # caudate
    if size > 0:
        half_length, half_width_v = (8 + 18 * size) * v, (1.5 + 4 * size) * v
        tilt = 0.1 + 0.25 * size
        for side in (-1, 1):
            centre = (side * (half_width_v + 1.5 + 2 * size), 3 * v)
            tissue[_ellipse(g.x, g.y, centre, (half_width_v, half_length), -side * tilt)] = Tissue.CSF
        gap_front, gap_back = 3 * v + half_length + 4, half_length - 3 * v + 4
    if level < 0.3:
        for side in (-1, 1):
            tissue[_ellipse(g.x, g.y, (side * (11 + 3 * v), -20 * v), (3 * v, 9 * v), side * 0.5)] = Tissue.CSF
        tissue[(np.abs(g.x) < 1 + 0.8 * v) & (g.y > -12 * v) & (g.y < 4 * v)] = Tissue.CSF  # third ventricle
        gap_back = max(gap_back, 30 * v)

    # Interhemispheric fissure (CSF lined by cortex) with the falx, a thin dense line, in it.
    midline = rng.uniform(-0.004, 0.004) * g.y**2
    across = np.abs(g.x - midline)
    along = (g.y > gap_front) | (g.y < -gap_back)
    fissure_width = rng.uniform(0.8, 1.6)
    tissue[brain & along & (across < fissure_width + cortex) & (tissue == Tissue.WHITE)] = Tissue.GREY
    tissue[(g.depth_inner >= 0) & along & (across < fissure_width)] = Tissue.CSF
    tissue[(g.depth_inner >= 0) & along & (across < 0.5)] = Tissue.FALX

    hu_of = np.zeros(len(Tissue), np.float32)
    hu_of[[Tissue.AIR, Tissue.SCALP, Tissue.BONE, Tissue.DIPLOE, Tissue.CSF, Tissue.GREY, Tissue.WHITE]] = (
        -1000,
        head.scalp_hu,
        head.bone_hu,
        head.diploe_hu,
        head.csf_hu,
        head.grey_hu,
        head.white_hu,
    )
    hu_of[Tissue.FALX] = head.falx_hu
    return tissue, hu_of[tissue], (across, along)


def _draw_lookalikes(rng, config: PhantomConfig, g: _Geometry, level, tissue, hu, midline) -> None:
    """Bright calcifications a detector must not call a bleed (100-400 HU), painted in place."""
    across, along = midline
    p, v = config.lookalike_probability, g.fit
    spots = []
    if level < 0.3 and rng.random() < p:
        spots.append(_ellipse(g.x, g.y, (0, rng.uniform(-16, -12) * v), (rng.uniform(1, 2.5),) * 2))  # pineal
    if level < 0.3 and rng.random() < p:
        for side in (-1, 1):  # choroid plexus in the atria
            radius = rng.uniform(1, 3)
            spots.append(_ellipse(g.x, g.y, (side * rng.uniform(11, 14) * v, -20 * v), (radius, radius)))
    if rng.random() < p:  # falx calcification
        start = rng.choice([-1, 1]) * rng.uniform(10, 50) * v
        segment = (g.y > start) & (g.y < start + rng.uniform(5, 20))
        spots.append(segment & along & (across < rng.uniform(0.6, 1.5)) & (g.depth_inner >= 0))
    for spot in spots:
        tissue[spot] = Tissue.CALCIFICATION
        hu[spot] = rng.uniform(100, 400)


def _draw_bleed(rng, config: PhantomConfig, g: _Geometry, bleed_type, tissue, hu) -> np.ndarray:
    """Paint one acute bleed in place; returns its bool mask (the oedema rim is not part of it)."""
    low, high = config.bleed_hu_range
    small = rng.random() < config.small_fraction
    bleed_hu = (
        rng.uniform(low, low + 10) if rng.random() < config.low_contrast_fraction else rng.uniform(low + 10, high)
    )
    brain = g.depth_brain >= 0
    if bleed_type == "intraparenchymal":
        radius = rng.uniform(1.5, 4) if small else rng.uniform(4, 25) * g.fit
        candidates = np.flatnonzero(brain & (g.depth_brain > 1.2 * radius + 2))
        if candidates.size == 0:
            candidates = np.flatnonzero(g.depth_brain >= g.depth_brain.max() - 1)
        centre = np.unravel_index(rng.choice(candidates), g.r.shape)
        dx, dy = g.x - g.x[centre], g.y - g.y[centre]
        rho = np.hypot(dx, dy)
        shape = np.stack([rng.uniform(0, 0.12, 3), rng.uniform(0, 2 * np.pi, 3)], 1)
        outline = radius * (1 + _harmonics((dx + 1j * dy).astype(np.complex64) / np.maximum(rho, 1e-6), shape, 2))
        mask = brain & (rho < outline)
        if rng.random() < 0.6:
            rim = (rho < outline + rng.uniform(1.5, 5)) & ~mask & np.isin(tissue, (Tissue.GREY, Tissue.WHITE))
            tissue[rim] = Tissue.OEDEMA
            hu[rim] = rng.uniform(10, 20)
    else:
        centre = rng.uniform(-np.pi, np.pi)
        if bleed_type == "subdural":  # crescent along the inner table, thin at both ends
            extent = rng.uniform(0.25, 0.5) if small else rng.uniform(0.6, 1.3)
            thickness = rng.uniform(1, 3) if small else rng.uniform(3, 12)
            u = _wrap(g.phi - centre) / extent
            profile = thickness * g.fit * (1 - u**2)
        else:  # epidural: biconvex lens against the skull
            extent = rng.uniform(0.12, 0.25) if small else rng.uniform(0.25, 0.5)
            thickness = rng.uniform(2.5, 5) if small else rng.uniform(6, 22)
            u = _wrap(g.phi - centre) / extent
            profile = thickness * g.fit * np.sqrt(np.clip(1 - u**2, 0, None))
        mask = (np.abs(u) < 1) & (g.depth_inner >= 0) & (g.depth_inner < profile)
    tissue[mask] = Tissue.BLEED
    hu[mask] = bleed_hu
    return mask


def simulate_slices(
    rng: np.random.Generator,
    config: PhantomConfig = PhantomConfig(),  # noqa: B008 (frozen dataclass: immutable default)
    n: int = 1,
    *,
    head: HeadShape | None = None,
    levels: list[float] | None = None,
    bleed_types: list[str] | None = None,
    acquire: bool = True,
) -> list[SimulatedSlice]:
    """Draw `n` slices of one head: anatomy one by one, then one batched acquisition (~1.3x faster than singly).

    Args:
        rng: source of all randomness; the same state gives identical slices.
        config: how slices are drawn.
        n: number of slices.
        head: the patient's head; drawn from `rng` when None.
        levels: slice heights in [0, 1] (0: ventricles, 1: vertex), one per slice; drawn when None.
        bleed_types: force each slice's bleed type (from `BLEED_TYPES`); drawn per `config` when None.
        acquire: simulate the scan; False returns the noiseless anatomy as `hu` (fast, for tests).
    """
    head = head or sample_head(rng)
    if levels is not None and len(levels) != n or bleed_types is not None and len(bleed_types) != n:
        raise ValueError(f"levels and bleed_types need one entry per slice (n={n})")
    slices, doses, kernels, generators = [], [], [], []
    for i in range(n):
        level = float(rng.uniform(0, 1)) if levels is None else float(levels[i])
        if bleed_types is not None:
            bleed_type = bleed_types[i]
            if bleed_type not in BLEED_TYPES:
                raise ValueError(f"bleed type must be one of {BLEED_TYPES}, got {bleed_type!r}")
        elif rng.random() < config.bleed_fraction:
            weights = np.asarray(config.bleed_type_weights, float)
            bleed_type = str(rng.choice(config.bleed_types, p=weights / weights.sum()))
        else:
            bleed_type = "none"
        g = _Geometry(config, head, level)
        tissue, hu, midline = _draw_anatomy(rng, head, g, level)
        _draw_lookalikes(rng, config, g, level, tissue, hu, midline)
        mask = (
            np.zeros(tissue.shape, bool)
            if bleed_type == "none"
            else _draw_bleed(rng, config, g, bleed_type, tissue, hu)
        )
        low, high = np.log(config.photons_per_ray_range)
        doses.append(float(np.exp(rng.uniform(low, high))))
        kernels.append(str(rng.choice(config.kernels)))
        generators.append(torch.Generator().manual_seed(int(rng.integers(0, 2**62))))
        slices.append((hu, mask, bleed_type, tissue, level))

    hu_true = np.stack([s[0] for s in slices])
    if acquire:
        scan = simulate_acquisition(
            hu_true,
            generator=generators,
            photons_per_ray=np.asarray(doses),
            kernel=kernels,
            pixel_spacing_mm=config.pixel_spacing_mm,
            beam_hardening=config.beam_hardening,
        )
        hu_scanned, field_of_view = scan.hu.numpy(), scan.field_of_view.numpy()
    else:
        offsets = np.arange(config.size) - (config.size - 1) / 2
        inside = offsets[:, None] ** 2 + offsets[None, :] ** 2 <= (config.size // 2) ** 2
        hu_scanned, field_of_view = hu_true, np.broadcast_to(inside, hu_true.shape)
    return [
        SimulatedSlice(
            hu=hu_scanned[i].copy(),
            hu_true=hu,
            mask=mask,
            label=int(bleed_type != "none"),
            bleed_type=bleed_type,
            tissue=tissue,
            field_of_view=field_of_view[i].copy(),
            level=level,
            photons_per_ray=doses[i] if acquire else 0.0,
            kernel=kernels[i] if acquire else "",
            pixel_spacing_mm=config.pixel_spacing_mm,
        )
        for i, (hu, mask, bleed_type, tissue, level) in enumerate(slices)
    ]


def simulate_slice(
    rng: np.random.Generator,
    config: PhantomConfig = PhantomConfig(),  # noqa: B008 (frozen dataclass: immutable default)
    *,
    head: HeadShape | None = None,
    level: float | None = None,
    bleed_type: str | None = None,
    acquire: bool = True,
) -> SimulatedSlice:
    """Draw one slice; same arguments as `simulate_slices` for a single slice."""
    return simulate_slices(
        rng,
        config,
        1,
        head=head,
        levels=None if level is None else [level],
        bleed_types=None if bleed_type is None else [bleed_type],
        acquire=acquire,
    )[0]
