"""Synthetic axial head-CT slices in HU: skull, brain, ventricles, look-alikes and acute bleeds, then a noisy scan.

Anatomy is drawn in numpy on a pixel grid from a `numpy.random.Generator` (bleeds in `vit_ct.sim.bleed`, look-alikes
in `vit_ct.sim.lookalike`); `vit_ct.sim.scanner` adds the CT physics.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from vit_ct.sim.anatomy import Geometry, HeadFrame, HeadShape, Tissue, draw_anatomy, sample_head
from vit_ct.sim.bleed import BLEED_TYPES, draw_bleed, paint_bleed
from vit_ct.sim.lookalike import draw_lookalikes, paint_lookalikes
from vit_ct.sim.projector import FILTER_NAMES, Kernel, scan_circle
from vit_ct.sim.scanner import simulate_acquisition

__all__ = [  # the anatomy's names, importable from here as before
    "BLEED_TYPES", "HeadShape", "PhantomConfig", "SimulatedSlice", "Tissue", "sample_head", "simulate_slice",
    "simulate_slices",
]  # fmt: skip


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
        kernels: reconstruction filters drawn uniformly: names or `Kernel`s (see `vit_ct.sim.projector.fourier_filter`).
        beam_hardening: strength of the bone beam-hardening term (0 disables it; else a coarser second projection).
        patient_bleed_fraction: share of patients who bleed at all, as scans are labelled: a patient drawn without
            one has no bleed on any slice; one drawn with one has a bleed on each slice with chance `bleed_fraction`.
            None: every patient's slices are drawn alike (each with chance `bleed_fraction`).
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
    kernels: tuple[str | Kernel, ...] = ("cosine", "hamming", "hann")
    beam_hardening: float = 0.0
    patient_bleed_fraction: float | None = None

    def __post_init__(self):
        if self.size < 32:
            raise ValueError(f"size must be at least 32 pixels, got {self.size}")
        if self.size * self.pixel_spacing_mm < 150:
            raise ValueError(
                f"size * pixel_spacing_mm must cover a head (>= 150 mm), got {self.size * self.pixel_spacing_mm} mm"
            )
        for name in ("bleed_fraction", "low_contrast_fraction", "small_fraction", "lookalike_probability",
                     "patient_bleed_fraction"):  # fmt: skip
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        unknown = set(self.bleed_types) - set(BLEED_TYPES[1:])
        if unknown or not self.bleed_types or len(self.bleed_type_weights) != len(self.bleed_types):
            raise ValueError(
                f"bleed_types must be non-empty, from {BLEED_TYPES[1:]}, with one weight each; "
                f"got {self.bleed_types} and weights {self.bleed_type_weights}"
            )
        if not self.kernels or not all(isinstance(k, Kernel) or k in FILTER_NAMES for k in self.kernels):
            raise ValueError(f"kernels must be non-empty, each from {FILTER_NAMES} or a Kernel, got {self.kernels}")
        if not 0 < self.photons_per_ray_range[0] <= self.photons_per_ray_range[1]:
            raise ValueError(f"photons_per_ray_range must be (low, high) > 0, got {self.photons_per_ray_range}")


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
        slice_thickness_mm: thickness of the slab the slice averages, mm.
        settings: the scanner's draws for this slice beyond the above (`vit_ct.sim.cohort`), for manifests.
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
    slice_thickness_mm: float = 5.0
    settings: dict = field(default_factory=dict)


def simulate_slices(
    rng: np.random.Generator,
    config: PhantomConfig = PhantomConfig(),  # noqa: B008 (frozen dataclass: immutable default)
    n: int = 1,
    *,
    head: HeadShape | None = None,
    levels: list[float] | None = None,
    bleed_types: list[str] | None = None,
    acquire: bool = True,
    method: str = "sampled",
) -> list[SimulatedSlice]:
    """Draw `n` slices of one head: anatomy one by one, then one batched acquisition (faster than slice by slice).

    Args:
        rng: source of all randomness; the same state gives identical slices.
        config: how slices are drawn.
        n: number of slices.
        head: the patient's head; drawn from `rng` when None.
        levels: slice heights in [0, 1] (0: ventricles, 1: vertex), one per slice; drawn when None.
        bleed_types: force each slice's bleed type (from `BLEED_TYPES`); drawn per `config` when None.
        acquire: simulate the scan; False returns the noiseless anatomy as `hu` (fast, for tests).
        method: the scan's numerical path (`vit_ct.sim.scanner.simulate_acquisition`): "sampled", bit for bit the
            demo's, or "matrix", faster for batches of slices (``benchmarks/simulator_throughput.py``; line
            integrals equal to ~1e-6; now and then a ray's Poisson draw differs by a photon).
    """
    head = head or sample_head(rng)
    if levels is not None and len(levels) != n or bleed_types is not None and len(bleed_types) != n:
        raise ValueError(f"levels and bleed_types need one entry per slice (n={n})")
    frame = HeadFrame.shrunk_to_fit(config.size, config.pixel_spacing_mm, head)
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
        g = Geometry(frame, head, level)
        anatomy = draw_anatomy(rng, head, g, level)
        paint_lookalikes(draw_lookalikes(rng, config.lookalike_probability, g.fit, level), g, anatomy)
        if bleed_type == "none":
            mask = np.zeros(g.r.shape, bool)
        else:
            bleed = draw_bleed(
                rng,
                g,
                bleed_type,
                anatomy,
                hu_range=config.bleed_hu_range,
                low_contrast_fraction=config.low_contrast_fraction,
                small_fraction=config.small_fraction,
            )
            bleed_type = bleed.kind
            mask = paint_bleed(bleed, g, anatomy)
        tissue, hu = anatomy.tissue, anatomy.hu
        low, high = np.log(config.photons_per_ray_range)
        doses.append(float(np.exp(rng.uniform(low, high))))
        kernel = rng.choice(config.kernels)
        kernels.append(kernel if isinstance(kernel, Kernel) else str(kernel))
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
            method=method,
        )
        hu_scanned, field_of_view = scan.hu.numpy(), scan.field_of_view.numpy()
    else:
        hu_scanned, field_of_view = hu_true, np.broadcast_to(scan_circle(config.size, "cpu").numpy(), hu_true.shape)
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
            kernel=(kernels[i] if isinstance(kernels[i], str) else kernels[i].name) if acquire else "",
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
