"""What differs between scanners, as training augmentation in HU, before the windows: the reconstruction kernel
(smoother or sharper), the dose (noise), and the HU calibration (offset and gain about water). On whole batches
where they land, one draw per slice, the kernel through MONAI's Gaussian filter.

Windowing clips, so these belong before it: noise of 10 HU is a tenth of the brain window and nothing in the bone
window; a 5 HU calibration offset moves grey matter in the brain window and leaves air at air. The smoothing kernels
come from ``monai.networks.layers.GaussianFilter`` (MONAI's own ``GaussianSmooth`` transform, batched: the same
values, ``benchmarks/augmentation.py``); sharpening is the unsharp mask on the same filter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from monai.networks.layers import GaussianFilter

KERNEL_SIGMAS = (0.5, 0.8, 1.1)  # px: the smoothing / unsharp widths drawn from (one MONAI filter each)


@dataclass(frozen=True)
class ScannerAugmentation:
    """Kernel, dose and calibration of another scanner, drawn independently per slice.

    Args:
        kernel_prob: Another reconstruction kernel: half the drawn slices smoother (Gaussian of a width in
            :data:`KERNEL_SIGMAS`), half sharper (unsharp mask with that width, amount uniform in ``[0, sharpen]``).
        sharpen: Largest unsharp-mask amount.
        noise_prob: Gaussian noise in HU, its standard deviation uniform in ``[0, noise_hu]`` per slice.
        noise_hu: Largest noise standard deviation, HU.
        calibration_prob: ``hu * gain + offset``: offset uniform in ``[-offset_hu, offset_hu]``, gain in
            ``[1 - gain, 1 + gain]`` (water stays near 0 HU, air near -1000).
        offset_hu: Largest calibration offset, HU.
        gain: Largest relative calibration gain error.
    """

    kernel_prob: float = 0.3
    sharpen: float = 1.0
    noise_prob: float = 0.3
    noise_hu: float = 12.0
    calibration_prob: float = 0.3
    offset_hu: float = 6.0
    gain: float = 0.03

    def __call__(self, hu: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """``(B, 1, S, S)`` HU, augmented (a new tensor)."""
        n, device = hu.shape[0], hu.device
        hu = hu.float()

        def uniform(low: float, high: float) -> torch.Tensor:
            return (low + (high - low) * torch.rand(n, device=device, generator=generator)).view(n, 1, 1, 1)

        def chance(p: float) -> torch.Tensor:
            return torch.rand(n, device=device, generator=generator) < p

        kernel, sharper = chance(self.kernel_prob), chance(0.5)
        width = torch.randint(len(KERNEL_SIGMAS), (n,), device=device, generator=generator)
        amount = uniform(0.0, self.sharpen)
        noisy, std = chance(self.noise_prob), uniform(0.0, self.noise_hu)
        calibrated = chance(self.calibration_prob)
        offset, gain = uniform(-self.offset_hu, self.offset_hu), uniform(1 - self.gain, 1 + self.gain)
        noise = torch.randn(hu.shape, device=device, generator=generator)

        out = hu.clone()
        for k, sigma in enumerate(KERNEL_SIGMAS):
            chosen = (kernel & (width == k)).nonzero().squeeze(1)
            if len(chosen):
                blurred = GaussianFilter(2, sigma=sigma).to(device)(hu[chosen])
                unsharp = hu[chosen] + amount[chosen] * (hu[chosen] - blurred)
                out[chosen] = torch.where(sharper[chosen].view(-1, 1, 1, 1), unsharp, blurred)
        out = torch.where(noisy.view(n, 1, 1, 1), out + noise * std, out)
        return torch.where(calibrated.view(n, 1, 1, 1), out * gain + offset, out)
