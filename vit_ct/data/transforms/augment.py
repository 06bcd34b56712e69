"""Training augmentation on whole batches, after they reach the device: one sampling grid per slice for flips,
rotations, scaling and shifts (image, lesion mask and head mask move together), then noise and contrast.

Run per slice in the DataLoader (MONAI dictionary transforms), the same augmentation cost a quarter of a 2-core
training step in the main process and sent every op of the model through ``MetaTensor``; here it is a handful of
batched tensor ops, on the GPU when there is one, and the model sees plain tensors.

Each batch draws its parameters from a generator seeded by ``(seed, rank, batch number)``, so a run resumed from a
checkpoint draws the same augmentation as the run it continues.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

GEOMETRIC_KEYS = ("image", "mask", "head")  # keys moved by the geometric transform; masks stay 0/1


@dataclass(frozen=True)
class BatchAugmentation:
    """Random flips, rotations, scaling, shifts, noise and contrast, drawn independently per slice.

    Args:
        flip_prob: Left-right flip (heads are near symmetric).
        affine_prob: Rotation, scaling and shift, drawn together.
        rotate: Largest rotation, radians (uniform in ``[-rotate, rotate]``).
        scale: Largest relative zoom (uniform in ``[1 - scale, 1 + scale]``).
        translate: Largest shift, as a fraction of the side (each axis uniform in ``[-translate, translate]``).
        noise_prob: Gaussian noise on the pixels a window shows; its standard deviation uniform in
            ``[0, noise_std]`` per slice. A pixel the window clips (air below it, bone above it) stays clipped,
            as noise in HU looks once windowed, so air patches stay air for the model's air mask.
        noise_std: Largest noise standard deviation, in windowed units (a window's width is 1).
        contrast_prob: Gamma on the slice's intensity range, ``min + range * ((x - min) / range) ** gamma``.
        gamma: Range of the gamma, drawn log-uniformly so that darker and brighter are equally likely.
    """

    flip_prob: float = 0.5
    affine_prob: float = 0.8
    rotate: float = math.pi / 12
    scale: float = 0.1
    translate: float = 0.06
    noise_prob: float = 0.3
    noise_std: float = 0.02
    contrast_prob: float = 0.3
    gamma: tuple[float, float] = (0.8, 1.25)

    def __call__(self, batch: dict, generator: torch.Generator, pixels: torch.Generator | None = None) -> dict:
        """The batch with ``image``, ``mask`` and ``head`` augmented (other keys as they are; a new dict).

        Each slice's parameters (a dozen numbers) are drawn on the CPU and the slices that get noise or contrast are
        chosen there, so that a batch on a GPU is augmented without the host ever waiting for the device.

        Args:
            batch: A :class:`~vit_ct.data.loading.datamodule.CTBatch` on any device; ``image`` ``(B, C, S, S)``
                in [0, 1].
            generator: Random source of the parameters, on the CPU.
            pixels: Random source of the noise, on the batch's device; ``generator`` when the batch is on the CPU.
        """
        image = batch["image"]
        n, device = image.shape[0], image.device
        pixels = generator if pixels is None else pixels
        for name, source, where in (("generator", generator, "cpu"), ("pixels", pixels, device.type)):
            if source.device.type != where:
                raise ValueError(f"BatchAugmentation: {name} is on {source.device}, expected a {where} generator")

        def uniform(low: float, high: float) -> torch.Tensor:
            return low + (high - low) * torch.rand(n, generator=generator)

        def chance(p: float) -> torch.Tensor:
            return torch.rand(n, generator=generator) < p

        flip, moved = chance(self.flip_prob), chance(self.affine_prob)
        theta = self.affine(
            flip=flip,
            moved=moved,
            angle=uniform(-self.rotate, self.rotate),
            zoom=uniform(1 - self.scale, 1 + self.scale),
            shift=torch.stack([uniform(-self.translate, self.translate) for _ in range(2)], dim=1),
        )
        std = self.noise_std * uniform(0, 1)
        noisy = chance(self.noise_prob)
        gamma = uniform(math.log(self.gamma[0]), math.log(self.gamma[1])).exp()
        contrasted = chance(self.contrast_prob)

        out = dict(batch)
        geometric = {key: batch[key] for key in GEOMETRIC_KEYS}
        out.update(warp(geometric, theta.to(device, non_blocking=True)))  # fresh tensors: changed in place below
        image = out["image"]
        # noise and contrast only on the slices that drew them, chosen from numbers on the host (no tensor operation
        # whose size depends on values: on a GPU that would make the host wait)
        chosen = [i for i, drawn in enumerate(noisy.tolist()) if drawn]
        if chosen:
            index = torch.tensor(chosen)
            noise = torch.randn((len(chosen), *image.shape[1:]), device=device, generator=pixels, dtype=image.dtype)
            scale = std[index].view(-1, 1, 1, 1).to(device, image.dtype, non_blocking=True)
            index = index.to(device, non_blocking=True)
            image[index] = windowed_noise(image[index], noise * scale)
        chosen = [i for i, drawn in enumerate(contrasted.tolist()) if drawn]
        if chosen:
            index = torch.tensor(chosen)
            exponent = gamma[index].to(device, non_blocking=True)
            index = index.to(device, non_blocking=True)
            image[index] = adjust_contrast(image[index], exponent)
        return out

    @staticmethod
    def affine(
        *, flip: torch.Tensor, moved: torch.Tensor, angle: torch.Tensor, zoom: torch.Tensor, shift: torch.Tensor
    ) -> torch.Tensor:
        """``(B, 2, 3)`` maps from output to input coordinates (``affine_grid``'s convention, x then y in [-1, 1]):
        a left-right flip where ``flip``, then, where ``moved``, a rotation by ``angle`` and a zoom by ``zoom`` about
        the centre and a shift by ``shift`` (fractions of the side). Identity elsewhere."""
        angle = torch.where(moved, angle, torch.zeros_like(angle))
        zoom = torch.where(moved, zoom, torch.ones_like(zoom))
        shift = torch.where(moved[:, None], shift, torch.zeros_like(shift))
        cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
        mirror = torch.where(flip, -1.0, 1.0).to(cos)
        theta = torch.stack(
            [
                torch.stack([cos * mirror, -sin, -2 * shift[:, 0]], dim=1),
                torch.stack([sin * mirror, cos, -2 * shift[:, 1]], dim=1),
            ],
            dim=1,
        )
        return theta


def warp(tensors: dict[str, torch.Tensor], theta: torch.Tensor) -> dict[str, torch.Tensor]:
    """Resample every ``(B, C_k, S, S)`` tensor on the same ``(B, 2, 3)`` affine grid: ``image`` bilinear, the masks
    (any other key) nearest-neighbour, so they stay 0/1; zeros (air, no lesion, outside the head) where the input is
    left behind."""
    image = tensors["image"]
    grid = affine_grid(theta.to(image.dtype), image.shape[-1])
    out = {"image": F.grid_sample(image, grid, mode="bilinear", padding_mode="zeros", align_corners=False)}
    masks = [key for key in tensors if key != "image"]
    if masks:
        stacked = torch.cat([tensors[key].to(image.dtype) for key in masks], dim=1)
        moved = F.grid_sample(stacked, grid, mode="nearest", padding_mode="zeros", align_corners=False)
        for key, part in zip(masks, moved.split([tensors[key].shape[1] for key in masks], dim=1), strict=True):
            out[key] = part.to(tensors[key].dtype)
    return out


def affine_grid(theta: torch.Tensor, size: int) -> torch.Tensor:
    """``F.affine_grid(theta, (B, C, size, size), align_corners=False)``, built from the pixel centres by broadcasting:
    the same grid (to float rounding) for a fraction of the time on a CPU, where ``affine_grid``'s batched matrix
    product dominated the augmentation. Each coordinate is ``(a * x + b * y) + c``, written straight into the grid
    in two passes."""
    centres = (2 * torch.arange(size, device=theta.device, dtype=theta.dtype) + 1) / size - 1
    grid = theta.new_empty((theta.shape[0], size, size, 2))
    for i in range(2):
        a, b, c = (theta[:, i, j, None, None] for j in range(3))  # (B, 1, 1) each
        torch.add(a * centres.view(1, 1, -1), b * centres.view(1, -1, 1), out=grid[..., i])
        grid[..., i] += c
    return grid


def windowed_noise(image: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``image + noise`` on the pixels a window shows (strictly inside (0, 1)), clamped to [0, 1]; clipped pixels
    (0: below the window, 1: above it) stay as they are."""
    shown = (image > 0) & (image < 1)
    return torch.where(shown, (image + noise).clamp(0, 1), image)


def adjust_contrast(image: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """Gamma per slice over its own intensity range (MONAI's ``AdjustContrast``): ``(B, C, H, W)``, ``gamma``
    ``(B,)``."""
    flat = image.flatten(1)
    low, high = flat.min(dim=1).values, flat.max(dim=1).values
    low, span = low.view(-1, 1, 1, 1), (high - low).view(-1, 1, 1, 1)
    scaled = ((image - low) / (span + 1e-7)).clamp_min(0)
    return scaled ** gamma.view(-1, 1, 1, 1).to(image.dtype) * span + low
