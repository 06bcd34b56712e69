"""Between a slice's own pixel grid and the model's square input grid: pad to square, resize, and back.

The only geometric step of evaluation; ``to_source_grid`` undoes ``to_model_grid`` so that maps computed on
the model input lie on the source slice's rows x columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def square_padding(rows: int, cols: int) -> tuple[int, int, int, int]:
    """(left, right, top, bottom) padding that centres a rows x cols slice in a square of side max(rows, cols)."""
    side = max(rows, cols)
    top, left = (side - rows) // 2, (side - cols) // 2
    return left, side - cols - left, top, side - rows - top


def to_model_grid(image: torch.Tensor, img_size: int, *, fill: float = 0.0, mode: str = "bilinear") -> torch.Tensor:
    """Pad ``(C, rows, cols)`` to a centred square with ``fill``, then resize to ``(C, img_size, img_size)``.

    ``mode="area"`` suits masks (the result is the covered fraction per output pixel).
    """
    rows, cols = image.shape[-2:]
    square = F.pad(image, square_padding(rows, cols), value=fill)
    if square.shape[-1] == img_size:
        return square
    kwargs = {"antialias": True, "align_corners": False} if mode == "bilinear" else {}
    return F.interpolate(square[None], size=(img_size, img_size), mode=mode, **kwargs)[0]


def to_source_grid(maps: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Bring maps ``(..., h, w)`` on the model grid back to the source slice's ``(..., rows, cols)``.

    Bilinear upsampling to the padded square, then the padding is cropped off.
    """
    lead = maps.shape[:-2]
    side = max(rows, cols)
    flat = maps.reshape(-1, 1, *maps.shape[-2:]).float()
    square = F.interpolate(flat, size=(side, side), mode="bilinear", align_corners=False)
    left, _, top, _ = square_padding(rows, cols)
    return square[..., top : top + rows, left : left + cols].reshape(*lead, rows, cols)
