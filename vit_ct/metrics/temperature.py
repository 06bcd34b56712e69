"""Temperature scaling of P(lesion) (Guo et al. 2017, arXiv:1706.04599): ``sigmoid(logit(P) / T)``, one T fitted by
``vit-ct report`` on validation slices and written to ``calibration.json``, applied by ``vit-ct predict
--calibration``. The order of the slices, and so every AUROC, is unchanged."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

_CLIP = 1e-7  # P(lesion) of exactly 0 or 1 has an infinite logit: read 1e-7 from the edge


def logit(prob: np.ndarray) -> np.ndarray:
    """log(p / (1 - p)), P(lesion) read 1e-7 from the edges (0 and 1 have infinite logits)."""
    prob = np.clip(prob, _CLIP, 1 - _CLIP)
    return np.log(prob) - np.log1p(-prob)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)), without overflow for large |x|."""
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def scale(prob: np.ndarray, temperature: float) -> np.ndarray:
    """P(lesion) after temperature scaling: ``sigmoid(logit(prob) / T)``; the order of cases (AUROC) is unchanged."""
    return sigmoid(logit(np.asarray(prob, dtype=np.float64)) / temperature)


def read_temperature(path: str | os.PathLike) -> float:
    """The temperature of a ``calibration.json`` (``{"temperature": T}``, as ``vit-ct report`` writes it).

    Raises:
        ValueError: naming the file: missing, not JSON, or without a finite ``temperature`` > 0.
    """
    path = Path(path)
    expected = 'expected a calibration.json written by vit-ct report ({"temperature": T}, T > 0)'
    if not path.is_file():
        raise ValueError(f"--calibration {path} does not exist; {expected}")
    try:
        temperature = json.loads(path.read_text()).get("temperature")
    except (ValueError, AttributeError, UnicodeDecodeError) as err:
        raise ValueError(f"--calibration {path} is not a JSON object ({err}); {expected}") from err
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not math.isfinite(temperature):
        raise ValueError(f"--calibration {path} holds no number `temperature` (it has {temperature!r}); {expected}")
    if temperature <= 0:
        raise ValueError(f"--calibration {path}: temperature {temperature} is not positive; {expected}")
    return float(temperature)
