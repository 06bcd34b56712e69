"""A slice as the model's input, in two steps: once, its HU and lesion mask on the model grid (what the disk cache
stores); then, where the batch lands (on the GPU when there is one), the HU windows as channels and the head mask.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from vit_ct.data.transforms.grid import to_model_grid
from vit_ct.data.transforms.windows import AIR_HU

HEAD_HU = -300.0  # above it: tissue, not air (fat is -100)


def grid_hu(hu: np.ndarray, img_size: int) -> torch.Tensor:
    """``(1, S, S)`` float32 HU of a ``(rows, cols)`` slice: padded to a square with air (so that the padding is air
    in every window), then resized to ``img_size``."""
    return to_model_grid(torch.from_numpy(hu)[None], img_size, fill=AIR_HU)


def grid_mask(mask: np.ndarray, img_size: int) -> torch.Tensor:
    """``(1, S, S)`` bool lesion mask: model pixels at least half covered by the ``(rows, cols)`` mask."""
    return to_model_grid(torch.from_numpy(mask.astype(np.float32))[None], img_size, mode="area") >= 0.5


def model_grid_spacing(spacing_mm: tuple[float, float] | None, shape: tuple[int, int], img_size: int) -> float:
    """mm per pixel of the model grid: the slice is padded to a square of its longer side, then resized to
    ``img_size``. The mean of row and column spacing (they differ little in CT); NaN when the spacing is unknown."""
    if spacing_mm is None:
        return math.nan
    return (spacing_mm[0] + spacing_mm[1]) / 2 * max(shape) / img_size


def apply_windows(item: dict, windows: Sequence[tuple[float, float]]) -> dict:
    """An item or batch holding ``hu`` ``(..., K, S, S)`` on the model grid (``K`` slices: the slice, then with
    context its neighbours below and above) as the model reads it: ``image`` ``(..., K * C, S, S)`` in [0, 1], one
    channel per window of each slice (the slice's own ``C`` first), ``head`` ``(..., 1, S, S)`` 0/1 (the slice not
    air) and ``mask`` as float 0/1 (zeros when the item has none); the other keys as they are. Runs on whatever
    device ``hu`` is on."""
    hu = item["hu"].float()  # the disk cache holds float16
    out = {key: value for key, value in item.items() if key != "hu"}
    slices, count = hu.shape[-3], len(windows)
    image = hu.new_empty((*hu.shape[:-3], slices * count, *hu.shape[-2:]))
    # `window_hu`'s steps (the same values), in place in the output: on CPU each temporary is a fresh 16-48 MB block
    # whose page faults cost more than the arithmetic
    for k in range(slices):
        for channel, (center, width) in enumerate(windows):
            at = k * count + channel
            torch.sub(hu[..., k : k + 1, :, :], center - width / 2, out=image[..., at : at + 1, :, :])
    widths = torch.tensor([width for _, width in windows] * slices, device=image.device)[:, None, None]
    image.div_(widths).clamp_(0.0, 1.0)
    centre = hu[..., :1, :, :]
    out["image"] = image
    out["mask"] = item["mask"].float() if "mask" in item else torch.zeros_like(centre)  # no mask anywhere in the cache
    out["head"] = (centre > HEAD_HU).float()  # padding is air, so it is outside the head too
    return out
