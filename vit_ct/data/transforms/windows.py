"""CT display windows: map Hounsfield units to [0, 1] and stack several windows as channels.

A window (centre C, width W) maps [C - W/2, C + W/2] linearly to [0, 1] and clips outside (head-CT presets below).
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Real
from typing import Any

import numpy as np
import torch

# (centre, width) in HU; head-CT presets. RSNA-style models stack brain, subdural and bone as 3 channels.
WINDOW_PRESETS: dict[str, tuple[float, float]] = {
    "brain": (40, 80),
    "subdural": (80, 200),
    "bone": (600, 2800),
    "stroke": (32, 8),
}
# How figures, overlays, DICOM headers and the review show a slice to a reader: the brain window.
DISPLAY_PRESET = "brain"
DISPLAY_WINDOW: tuple[float, float] = tuple(map(float, WINDOW_PRESETS[DISPLAY_PRESET]))
AIR_HU = -1000.0  # air; also what DICOM pixel padding (outside the scan circle) and padding to square become


def window_hu(hu: np.ndarray | torch.Tensor, center: float, width: float) -> np.ndarray | torch.Tensor:
    """Map Hounsfield units through one window to [0, 1].

    Args:
        hu: image in HU, any shape; a numpy array or a torch tensor.
        center: window centre in HU.
        width: window width in HU, > 0.

    Returns:
        Same type and shape as `hu`: 0 at or below `center - width / 2`, 1 at or above `center + width / 2`,
        linear in between. Floating input keeps its dtype (float16 stays float16); other input becomes float32.
    """
    if not width > 0:
        raise ValueError(f"window width must be > 0 HU, got {width!r}")
    low = center - width / 2
    if isinstance(hu, torch.Tensor):
        x = hu if hu.is_floating_point() else hu.float()
        return ((x - low) / width).clamp(0.0, 1.0)
    x = np.asarray(hu)
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float32)
    return np.clip((x - x.dtype.type(low)) / x.dtype.type(width), 0.0, 1.0).astype(x.dtype, copy=False)


def _is_pair(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) == 2
        and all(isinstance(v, Real) and not isinstance(v, bool) for v in value)
    )


def _parse_one(value: Any, original: Any) -> tuple[float, float]:
    if isinstance(value, str):
        key = value.strip().lower()
        if key not in WINDOW_PRESETS:
            raise ValueError(
                f"unknown window preset {value!r} in windows={original!r}; "
                f"expected one of {sorted(WINDOW_PRESETS)} or a (centre, width) pair in HU"
            )
        center, width = WINDOW_PRESETS[key]
    elif _is_pair(value):
        center, width = value
    else:
        raise ValueError(
            f"bad window {value!r} in windows={original!r}; expected a preset name "
            f"({', '.join(sorted(WINDOW_PRESETS))}) or a (centre, width) pair in HU"
        )
    center, width = float(center), float(width)
    if not (np.isfinite(center) and np.isfinite(width)) or width <= 0:
        raise ValueError(f"bad window {value!r} in windows={original!r}: centre must be finite and width > 0 HU")
    return center, width


def parse_windows(windows: str | Sequence[Any]) -> list[tuple[float, float]]:
    """Normalise a window specification to a list of (centre, width) pairs in HU.

    Args:
        windows: a preset name (`"brain"`), a (centre, width) pair (`(40, 80)`), or a list mixing preset names
            and pairs (`["brain", "subdural", [600, 2800]]`). Preset names are case-insensitive.

    Returns:
        One (centre, width) tuple of floats per output channel.

    Raises:
        ValueError: naming the offending value, for an unknown name, a malformed pair, an empty list or width <= 0.
    """
    if isinstance(windows, str) or _is_pair(windows):
        return [_parse_one(windows, windows)]
    if not isinstance(windows, Sequence) or len(windows) == 0:
        raise ValueError(
            f"bad windows={windows!r}; expected a preset name, a (centre, width) pair, or a non-empty list of them"
        )
    return [_parse_one(w, windows) for w in windows]


def stack_windows(hu: np.ndarray | torch.Tensor, windows: str | Sequence[Any]) -> np.ndarray | torch.Tensor:
    """Window one slice several times and stack the results as channels.

    Args:
        hu: (H, W) slice in HU, numpy array or torch tensor.
        windows: anything `parse_windows` accepts.

    Returns:
        (C, H, W) float32 in [0, 1], one channel per window, of the same kind (numpy/torch) as `hu`.
    """
    if hu.ndim != 2:
        raise ValueError(f"stack_windows expects a 2-D (H, W) slice in HU, got shape {tuple(hu.shape)}")
    pairs = parse_windows(windows)
    if isinstance(hu, torch.Tensor):
        x = hu.float()
        return torch.stack([window_hu(x, c, w) for c, w in pairs])
    x = np.asarray(hu, dtype=np.float32)
    return np.stack([window_hu(x, c, w) for c, w in pairs]).astype(np.float32, copy=False)
