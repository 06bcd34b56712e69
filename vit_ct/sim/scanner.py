"""A CT scan in torch: blur, projections, beam hardening, Poisson photon counts, detector gains, patient motion,
filtered back-projection and HU calibration (the projector itself is `vit_ct.sim.projector`)."""

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from vit_ct.sim.projector import Kernel, default_angles, filtered_back_projection, forward_project, scan_circle

MU_WATER_PER_MM = 0.019  # linear attenuation of water at ~70 keV effective energy, 1/mm


class Reconstruction(NamedTuple):
    """A simulated scan.

    Attributes:
        hu: reconstructed image in HU, float32 `(B, H, W)`; -1000 (air) outside the field of view.
        field_of_view: bool `(B, H, W)`, True inside the reconstruction circle; pixels outside carry no data
            (the DICOM writer stores PixelPaddingValue there).
    """

    hu: torch.Tensor
    field_of_view: torch.Tensor


def gaussian_blur(image: torch.Tensor, sigma_px: float, *, by_shifts: bool = False) -> torch.Tensor:
    """Separable Gaussian blur of `(B, H, W)` images, sigma in pixels, zero-padded; 0 returns the input.

    `by_shifts` sums shifted copies instead of calling conv2d: equal to ~1e-7 and faster on CPU, where torch's
    single-channel conv2d is slow.
    """
    if sigma_px <= 0:
        return image
    radius = max(1, math.ceil(3 * sigma_px))
    taps = torch.exp(-0.5 * (torch.arange(-radius, radius + 1, dtype=image.dtype) / sigma_px) ** 2)
    taps = taps / taps.sum()
    if by_shifts:
        H, W = image.shape[-2:]
        rows = F.pad(image, (radius, radius))
        image = sum(rows[..., k : k + W] * tap for k, tap in enumerate(taps))
        columns = F.pad(image, (0, 0, radius, radius))
        return sum(columns[..., k : k + H, :] * tap for k, tap in enumerate(taps))
    rows = F.conv2d(image[:, None], taps.view(1, 1, 1, -1), padding=(0, radius))
    return F.conv2d(rows, taps.view(1, 1, -1, 1), padding=(radius, 0))[:, 0]


def _bone_line_integrals(hu: torch.Tensor, angles: torch.Tensor, pixel_spacing_mm: float, method: str) -> torch.Tensor:
    """Line integrals of bone's attenuation in excess of water, `(B, A, W)`; at half resolution when W is even.

    Beam hardening is a smooth, second-order effect, so a 2x coarser projection (4x cheaper) is enough.
    """
    bone = MU_WATER_PER_MM * (hu - 200).clamp(min=0) / 1000  # 1/mm
    if hu.shape[-1] % 2:
        return forward_project(bone, angles, pixel_spacing_mm=pixel_spacing_mm, method=method)
    coarse = F.avg_pool2d(bone[:, None], 2)[:, 0]
    coarse = forward_project(coarse, angles, pixel_spacing_mm=2 * pixel_spacing_mm, method=method)
    # Coarse bin k sits at fine position 2k + 0.5, which is what align_corners=False linear resampling assumes.
    return F.interpolate(coarse, size=hu.shape[-1], mode="linear", align_corners=False)


def moved_frames(mu: torch.Tensor, motion: torch.Tensor, pixel_spacing_mm: float) -> torch.Tensor:
    """The object in each of K poses during the scan, `(B, K, H, W)` from `(B, H, W)`.

    Args:
        mu: images `(B, H, W)`, zero (air) around the object.
        motion: `(B, K, 3)` rigid pose per frame: shift right and shift up in mm, in-plane rotation in radians;
            elements whose poses are all zero are repeated exactly (no resampling).
        pixel_spacing_mm: pixel size, mm.
    """
    B, H, _ = mu.shape
    K = motion.shape[1]
    frames = mu[:, None].expand(B, K, H, H).clone()
    moving = motion.abs().flatten(1).amax(1) > 0
    if moving.any():
        pose = motion[moving].reshape(-1, 3).double()
        half_mm = (H - 1) / 2 * pixel_spacing_mm  # normalised coordinates (align_corners=True) are mm / half_mm
        cos, sin = pose[:, 2].cos(), pose[:, 2].sin()
        theta = torch.stack(
            [
                torch.stack([cos, -sin, -pose[:, 0] / half_mm], -1),
                torch.stack([sin, cos, pose[:, 1] / half_mm], -1),  # rows run downwards: up is negative
            ],
            dim=1,
        ).float()  # (n, 2, 3), output -> input positions
        source = mu[moving][:, None].expand(-1, K, H, H).reshape(-1, 1, H, H)
        grid = F.affine_grid(theta, [len(theta), 1, H, H], align_corners=True)
        frames[moving] = F.grid_sample(source, grid, align_corners=True).reshape(-1, K, H, H)
    return frames


def simulate_acquisition(
    hu: torch.Tensor | np.ndarray,
    *,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    photons_per_ray: float | torch.Tensor | np.ndarray = 1.5e6,
    kernel: str | Kernel | list[str | Kernel] = "hamming",
    pixel_spacing_mm: float = 0.9,
    n_angles: int | None = None,
    beam_hardening: float = 0.0,
    blur_px: float = 0.8,
    cupping: float = 0.0,
    detector_gains: torch.Tensor | None = None,
    motion: torch.Tensor | None = None,
    hu_gain: float | torch.Tensor = 1.0,
    hu_offset: float | torch.Tensor = 0.0,
    method: str = "sampled",
) -> Reconstruction:
    """Scan a noiseless HU map: projections, Poisson photon counts, log, filtered back-projection.

    Lower `photons_per_ray` (dose) gives more noise; rays through dense bone are photon-starved and streak.
    At the default dose and kernel, brain noise is ~5 HU at 256x256, 0.9 mm (N0 is per view, and 128 views
    stand in for a real scanner's ~1000, so it is higher than real per-view counts).

    Args:
        hu: noiseless Hounsfield units `(H, W)` or `(B, H, W)`, square.
        generator: torch random generator for the photon noise, or one per batch element (then each element's
            noise does not depend on the rest of the batch); None uses the global one.
        photons_per_ray: unattenuated photons per detector bin and view (N0), for the batch or `(B,)`.
        kernel: reconstruction filter (see `vit_ct.sim.projector.fourier_filter`), for the batch or one per element.
        pixel_spacing_mm: pixel size, mm.
        n_angles: views over 180 degrees; defaults to half the image width (at least 64).
        beam_hardening: strength of the bone beam-hardening term: measured line integral drops by this times
            the squared bone line integral (dark streaks between thick bone); 0 disables it.
        blur_px: Gaussian sigma, pixels, of the focal-spot and detector-aperture blur. It also band-limits the
            pixel-sharp phantom so that the default number of views does not alias (streaks from the skull).
        cupping: residual water beam hardening: the line integral drops by this times its square (positive: the
            centre of the head darker, "cupping"; negative: over-corrected, brighter).
        detector_gains: `(n_det,)` or `(B, n_det)` relative gain of each detector bin that the calibration missed
            (1: none); constant over the views, so each bad bin leaves a ring.
        motion: `(B, K, 3)` poses of the object during K equal groups of views (see `moved_frames`); None: still.
        hu_gain: calibration gain error, for the batch or `(B,)`: reconstructed HU are multiplied by it ...
        hu_offset: ... and shifted by this many HU (water reads `hu_offset`), inside the field of view.
        method: numerical path: "sampled" (the demo's, stable bit for bit) or "matrix" (the projector's sparse
            matrices, see `vit_ct.sim.projector`, and a blur by shifts; faster for batches, equal to ~1e-6
            before the photon noise, whose draw can then differ by a photon on a ray here and there).

    Returns:
        Reconstruction with `hu` shaped like the input.
    """
    hu = torch.as_tensor(hu, dtype=torch.float32)
    squeeze = hu.ndim == 2
    hu = hu[None] if squeeze else hu
    B, H, _ = hu.shape
    angles = default_angles(n_angles or max(64, H // 2))
    # Blurred in the image, not along the detector (equal in theory): bilinear ray sampling of a pixel-sharp image
    # aliases more (measured: 2.5 vs 1.8 HU of streaks in white matter).
    mu = (MU_WATER_PER_MM * (1 + hu / 1000)).clamp(min=0)  # 1/mm, zero (air) beyond the edges
    mu = gaussian_blur(mu, blur_px, by_shifts=method == "matrix")
    if motion is not None:
        mu = moved_frames(mu, torch.as_tensor(motion), pixel_spacing_mm)
    line_integrals = forward_project(mu, angles, pixel_spacing_mm=pixel_spacing_mm, method=method)
    if beam_hardening > 0:
        bone = _bone_line_integrals(hu, angles, pixel_spacing_mm, method)
        line_integrals = line_integrals - beam_hardening * bone**2
    if cupping:
        line_integrals = line_integrals - cupping * line_integrals**2
    n0 = torch.as_tensor(photons_per_ray, dtype=torch.float32).reshape(-1, 1, 1)
    expected = n0 * torch.exp(-line_integrals)  # photons reaching each detector bin, (B, A, n_det)
    if isinstance(generator, Sequence):
        if len(generator) != B:
            raise ValueError(f"generator gives {len(generator)} generators for a batch of {B}")
        counts = torch.stack([torch.poisson(e, generator=gen) for e, gen in zip(expected, generator, strict=True)])
    else:
        counts = torch.poisson(expected, generator=generator)
    counts = counts.clamp(min=0.5)  # a starved ray (0 photons) reads as half a photon
    if detector_gains is not None:
        counts = counts * torch.as_tensor(detector_gains, dtype=torch.float32).reshape(-1, 1, counts.shape[-1])
    measured = -torch.log(counts / n0)
    mu_rec = filtered_back_projection(
        measured, angles, filter_name=kernel, pixel_spacing_mm=pixel_spacing_mm, size=H, method=method
    )
    field_of_view = scan_circle(H, str(hu.device)).expand(B, H, H).clone()
    scanned = 1000 * (mu_rec / MU_WATER_PER_MM - 1)
    gain = torch.as_tensor(hu_gain, dtype=torch.float32).reshape(-1, 1, 1)
    offset = torch.as_tensor(hu_offset, dtype=torch.float32).reshape(-1, 1, 1)
    out = torch.where(field_of_view, scanned * gain + offset, torch.full_like(mu_rec, -1000.0))
    return Reconstruction(out[0], field_of_view[0]) if squeeze else Reconstruction(out, field_of_view)
