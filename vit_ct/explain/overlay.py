"""Overlays for a person: a windowed CT slice, a heat map over it, and the lesion contour, as an RGB image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib import colormaps
from PIL import Image, ImageDraw, ImageFont
from skimage.segmentation import find_boundaries

from vit_ct.data.transforms.windows import DISPLAY_WINDOW, window_hu
from vit_ct.files import atomic_write

CONTOUR_RGB = (0, 255, 0)
MIN_TEXT_PX = 9  # a caption line longer than its picture is drawn smaller, never below this


def normalise_map(heat: np.ndarray) -> np.ndarray:
    """Scale a non-negative map to [0, 1] by its maximum (all zeros stays zeros)."""
    heat = np.clip(np.nan_to_num(heat.astype(np.float32)), 0, None)
    top = heat.max()
    return heat / top if top > 0 else heat


def render_overlay(
    hu: np.ndarray,
    heat: np.ndarray | None = None,
    mask: np.ndarray | None = None,
    *,
    window: tuple[float, float] = DISPLAY_WINDOW,
    alpha: float = 0.5,
    cmap: str = "turbo",
) -> np.ndarray:
    """``(rows, cols, 3)`` uint8: the slice in ``window`` (centre, width HU), ``heat`` blended in, mask outlined.

    Heat is scaled to its maximum and blended in proportion to its value, so unattended tissue stays grey.
    """
    gray = np.asarray(window_hu(hu.astype(np.float32), *window))[..., None].repeat(3, axis=-1)  # (rows, cols, 3)
    rgb = gray
    if heat is not None:
        if heat.shape != hu.shape:
            raise ValueError(f"heat map {heat.shape} and slice {hu.shape} differ in size")
        h = normalise_map(heat)[..., None]
        color = colormaps[cmap](h[..., 0])[..., :3]
        rgb = (1 - alpha * h) * gray + alpha * h * color
    rgb = (np.clip(rgb, 0, 1) * 255).round().astype(np.uint8)
    if mask is not None and mask.any():
        rgb[find_boundaries(mask.astype(bool), mode="outer")] = CONTOUR_RGB
    return rgb


def add_caption(rgb: np.ndarray, lines: list[str], *, min_width: int = 384) -> np.ndarray:
    """``rgb`` with ``lines`` of white text burned in on a black band below it: a picture for a viewer that shows
    only pictures (a DICOM Secondary Capture). A slice narrower than ``min_width`` pixels is first enlarged by a
    whole factor (nearest neighbour, so no pixel is invented) until the text fits beside it."""
    scale = -(-min_width // rgb.shape[1])  # ceil
    image = Image.fromarray(rgb).resize((rgb.shape[1] * scale, rgb.shape[0] * scale), Image.Resampling.NEAREST)
    size = max(12, image.width // 28)  # px: about 40 characters a line
    font = ImageFont.load_default(size=size)
    while size > MIN_TEXT_PX and max(font.getlength(line) for line in lines) > image.width - size:  # a long line
        size -= 1
        font = ImageFont.load_default(size=size)
    band = (size + size // 2) * len(lines) + size // 2
    canvas = Image.new("RGB", (image.width, image.height + band))
    canvas.paste(image)
    draw = ImageDraw.Draw(canvas)
    for i, line in enumerate(lines):
        draw.text((size // 2, image.height + size // 2 + i * (size + size // 2)), line, fill=(255, 255, 255), font=font)
    return np.asarray(canvas)


def save_png(rgb: np.ndarray, path: str | Path) -> None:
    """Write an RGB image atomically (a crash never leaves a truncated PNG behind)."""
    with atomic_write(path) as tmp:
        Image.fromarray(rgb).save(tmp, format="PNG")
