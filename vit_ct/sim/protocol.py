"""Scanner randomisation: the ranges (`ScannerConfig`), one patient's scanner and protocol drawn from them
(`ScanProtocol`: field of view, slice thickness, kernel, dose, beam hardening, calibration, detector gains), and the
motion of a patient during one slice."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from vit_ct.sim.projector import FILTER_NAMES, Kernel

SLICE_THICKNESSES_MM = (0.625, 1.0, 1.25, 2.0, 2.5, 3.0, 5.0)  # what head-CT series are reconstructed at
REFERENCE_SPACING_MM, REFERENCE_THICKNESS_MM = 0.9, 5.0  # where `photons_per_ray_range` applies as it stands


def _check_range(name: str, value: tuple[float, float], low: float = -math.inf, high: float = math.inf) -> None:
    if len(value) != 2 or not low <= value[0] <= value[1] <= high:
        raise ValueError(f"{name} must be (low, high) with {low} <= low <= high <= {high}, got {value}")


@dataclass(frozen=True)
class ScannerConfig:
    """Ranges of the scanner and protocol. Drawn per patient (a patient is scanned on one scanner) unless said.

    Args:
        pixel_spacing_mm_range: pixel size, uniform; raised where needed for the head to fit the field of view.
        slice_thicknesses_mm: reconstructed slice thicknesses to draw from (partial volume over the slab).
        slice_thickness_weights: relative frequency of each of `slice_thicknesses_mm`.
        half_response_range: sharpness of the kernel (`Kernel.half_response`, fraction of Nyquist), uniform.
        edge_boost_range: edge enhancement of the kernel (`Kernel.edge_boost`), uniform.
        window_kernel_fraction: share of patients reconstructed with a named window (`FILTER_NAMES`) instead.
        photons_per_ray_range: dose, photons per detector bin and view at 0.9 mm pixels and 5 mm slices,
            log-uniform; scaled by the pixel spacing (a bin collects photons over its width) and by the square root
            of the slice thickness (a thin slice collects fewer, and thin-slice protocols raise the tube current,
            making up half of the loss in log).
        dose_modulation: per-slice dose factor (tube-current modulation), log-uniform in [1 / this, this].
        blur_px_range: focal-spot and detector blur, Gaussian sigma in pixels, uniform.
        beam_hardening_range: strength of the bone beam-hardening term (dark streaks between thick bone), uniform.
        cupping_range: residual water beam hardening (positive: a darker centre), uniform.
        hu_offset_range: HU calibration offset (what water reads), uniform.
        hu_gain_range: HU calibration gain, uniform.
        ring_fraction: share of scanners with miscalibrated detector bins (ring artefacts).
        ring_gain_error: largest relative gain error of a miscalibrated bin.
        motion_fraction: share of slices during which the patient moves (per slice).
        motion_mm: largest shift during one slice's rotation, mm.
        motion_deg: largest in-plane rotation during one slice's rotation, degrees.
        n_angles: views over 180 degrees (0: half the slice width); one geometry keeps the projector's cache warm.
    """

    pixel_spacing_mm_range: tuple[float, float] = (0.7, 1.0)
    slice_thicknesses_mm: tuple[float, ...] = SLICE_THICKNESSES_MM
    slice_thickness_weights: tuple[float, ...] = (0.15, 0.1, 0.15, 0.1, 0.15, 0.1, 0.25)
    half_response_range: tuple[float, float] = (0.4, 1.0)
    edge_boost_range: tuple[float, float] = (0.0, 0.6)
    window_kernel_fraction: float = 0.3
    photons_per_ray_range: tuple[float, float] = (1.0e6, 1.5e7)
    dose_modulation: float = 1.25
    blur_px_range: tuple[float, float] = (0.7, 1.1)
    beam_hardening_range: tuple[float, float] = (0.0, 0.12)
    cupping_range: tuple[float, float] = (-0.001, 0.002)
    hu_offset_range: tuple[float, float] = (-5.0, 5.0)
    hu_gain_range: tuple[float, float] = (0.98, 1.02)
    ring_fraction: float = 0.25
    ring_gain_error: float = 0.01
    motion_fraction: float = 0.1
    motion_mm: float = 3.0
    motion_deg: float = 3.0
    n_angles: int = 0

    def __post_init__(self):
        _check_range("pixel_spacing_mm_range", self.pixel_spacing_mm_range, 0.1, 5)
        if not self.slice_thicknesses_mm or len(self.slice_thickness_weights) != len(self.slice_thicknesses_mm):
            raise ValueError(
                f"slice_thicknesses_mm must be non-empty with one weight each, got {self.slice_thicknesses_mm} and "
                f"{self.slice_thickness_weights}"
            )
        if min(self.slice_thicknesses_mm) <= 0 or min(self.slice_thickness_weights) < 0:
            raise ValueError(f"slice thicknesses must be > 0 and weights >= 0, got {self.slice_thicknesses_mm}")
        Kernel(self.half_response_range[0], self.edge_boost_range[0])  # checks the ends of both ranges
        Kernel(self.half_response_range[1], self.edge_boost_range[1])
        _check_range("half_response_range", self.half_response_range)
        _check_range("edge_boost_range", self.edge_boost_range)
        _check_range("photons_per_ray_range", self.photons_per_ray_range, 1.0)
        _check_range("blur_px_range", self.blur_px_range, 0.0)
        _check_range("beam_hardening_range", self.beam_hardening_range, 0.0)
        _check_range("cupping_range", self.cupping_range, -0.05, 0.05)
        _check_range("hu_offset_range", self.hu_offset_range)
        _check_range("hu_gain_range", self.hu_gain_range, 0.5, 2.0)
        for name in ("window_kernel_fraction", "ring_fraction", "motion_fraction", "ring_gain_error"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.dose_modulation < 1 or self.motion_mm < 0 or self.motion_deg < 0 or self.n_angles < 0:
            raise ValueError(
                f"need dose_modulation >= 1, motion_mm >= 0, motion_deg >= 0 and n_angles >= 0; got "
                f"{self.dose_modulation}, {self.motion_mm}, {self.motion_deg}, {self.n_angles}"
            )


@dataclass(frozen=True)
class ScanProtocol:
    """One patient's scanner and protocol (shared by all of their slices).

    Attributes:
        pixel_spacing_mm: pixel size, mm.
        slice_thickness_mm: slab each slice averages, mm.
        kernel: reconstruction kernel, a named window or a `Kernel`.
        photons_per_ray: photons per detector bin and view of this pixel size and thickness, before modulation.
        blur_px: focal-spot and detector blur, pixels.
        beam_hardening: bone beam-hardening strength.
        cupping: residual water beam hardening.
        hu_offset: calibration offset, HU.
        hu_gain: calibration gain.
        detector_gains: `(n_det,)` relative gain of each detector bin (1 where calibrated).
        n_angles: views over 180 degrees.
    """

    pixel_spacing_mm: float
    slice_thickness_mm: float
    kernel: str | Kernel
    photons_per_ray: float
    blur_px: float
    beam_hardening: float
    cupping: float
    hu_offset: float
    hu_gain: float
    detector_gains: np.ndarray = field(repr=False, compare=False)
    n_angles: int

    @property
    def kernel_name(self) -> str:
        return self.kernel if isinstance(self.kernel, str) else self.kernel.name

    def record(self) -> dict[str, float | str | int]:
        """The draws as manifest columns."""
        bad = np.abs(self.detector_gains - 1) > 0
        return {
            "kernel": self.kernel_name,
            "pixel_spacing_mm": round(self.pixel_spacing_mm, 4),
            "slice_thickness_mm": self.slice_thickness_mm,
            "blur_px": round(self.blur_px, 3),
            "beam_hardening": round(self.beam_hardening, 3),
            "cupping": round(self.cupping, 5),
            "hu_offset": round(self.hu_offset, 2),
            "hu_gain": round(self.hu_gain, 4),
            "ring_bins": int(bad.sum()),  # mirrored pairs count twice
            "ring_gain_error": round(float(np.abs(self.detector_gains - 1).max()), 5),
        }


def sample_protocol(
    rng: np.random.Generator, config: ScannerConfig, *, size: int, min_spacing_mm: float = 0.0
) -> ScanProtocol:
    """Draw one patient's scanner and protocol.

    Args:
        rng: source of the draws.
        config: the ranges.
        size: rows and columns of the slices (detector bins: one per pixel).
        min_spacing_mm: smallest pixel size at which the patient's head fits the field of view; the spacing is
            drawn from the range above it (or is it, when it lies above the whole range).
    """
    low, high = config.pixel_spacing_mm_range
    spacing = float(rng.uniform(max(low, min_spacing_mm), max(high, min_spacing_mm)))
    weights = np.asarray(config.slice_thickness_weights, float)
    thickness = float(config.slice_thicknesses_mm[rng.choice(len(weights), p=weights / weights.sum())])
    if rng.random() < config.window_kernel_fraction:
        kernel = str(rng.choice(FILTER_NAMES))
    else:
        kernel = Kernel(float(rng.uniform(*config.half_response_range)), float(rng.uniform(*config.edge_boost_range)))
    dose = math.exp(rng.uniform(*np.log(config.photons_per_ray_range)))
    photons = dose * (spacing / REFERENCE_SPACING_MM) * math.sqrt(thickness / REFERENCE_THICKNESS_MM)
    gains = np.ones(size)
    if rng.random() < config.ring_fraction:  # a few bins off, either way
        bad = rng.choice(size // 2, size=min(size // 2, 1 + rng.poisson(2)), replace=False)
        gains[bad] = 1 + rng.uniform(-1, 1, len(bad)) * config.ring_gain_error
        # A third-generation scanner's detector channel sees its rays from all 360 degrees: in these 180 degrees of
        # parallel views that is the bin and its mirror image, so the ring closes (one bin alone draws a half ring).
        gains[size - 1 - bad] = gains[bad]
    return ScanProtocol(
        pixel_spacing_mm=spacing,
        slice_thickness_mm=thickness,
        kernel=kernel,
        photons_per_ray=photons,
        blur_px=float(rng.uniform(*config.blur_px_range)),
        beam_hardening=float(rng.uniform(*config.beam_hardening_range)),
        cupping=float(rng.uniform(*config.cupping_range)),
        hu_offset=float(rng.uniform(*config.hu_offset_range)),
        hu_gain=float(rng.uniform(*config.hu_gain_range)),
        detector_gains=gains,
        n_angles=config.n_angles or max(64, size // 2),
    )


def sample_motion(rng: np.random.Generator, config: ScannerConfig, n_frames: int = 8) -> np.ndarray:
    """Poses of the patient during one slice's rotation, `(n_frames, 3)`: shift right and up (mm) and rotation
    (radians) of each group of views, drifting from rest along a smooth path; all zero for a still patient."""
    if rng.random() >= config.motion_fraction:
        return np.zeros((n_frames, 3))
    shift = rng.uniform(-1, 1, 2) * config.motion_mm / math.sqrt(2)
    end = np.array([*shift, math.radians(rng.uniform(-1, 1) * config.motion_deg)])
    onset, power = rng.uniform(0, 0.7), rng.uniform(0.5, 2)  # when the movement starts, how it accelerates
    time = np.linspace(0, 1, n_frames)
    progress = np.clip((time - onset) / (1 - onset), 0, 1) ** power
    return progress[:, None] * end[None, :]
