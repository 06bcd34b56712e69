"""Is P(lesion) calibrated (does 0.8 mean 80%)? Expected calibration error over 15 equal-width bins, Brier score, the
reliability diagram's bins, and temperature scaling (Guo et al. 2017, arXiv:1706.04599): one T fitted on validation
cases, P(lesion) = sigmoid(logit(P) / T).
"""

from __future__ import annotations

import numpy as np

from vit_ct.metrics.temperature import logit, scale, sigmoid

__all__ = ["BINS", "calibration_scores", "fit_temperature", "reliability", "scale"]

BINS = 15  # equal-width bins of P(lesion) over [0, 1], as torchmetrics' BinaryCalibrationError(n_bins=15)
MIN_TEMPERATURE = 0.01  # validation slices P(lesion) separates perfectly fit T -> 0: it stops here


def bin_index(prob: np.ndarray, bins: int = BINS) -> np.ndarray:
    """Each case's bin, as torchmetrics bins it: ``[k/bins, (k+1)/bins)``, and P(lesion) = 1 in a bin of its own."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    return np.searchsorted(edges, prob, side="right") - 1


def calibration_scores(prob: np.ndarray, label: np.ndarray, bins: int = BINS) -> dict[str, float]:
    """``ece``: sum over bins of (share of cases) x |mean P(lesion) - share of positives|, equal to torchmetrics'
    ``BinaryCalibrationError(n_bins=bins, norm="l1")`` (tested; in numpy because torchmetrics' cost per call adds up
    over the bootstrap's replicates); ``brier``: mean (P(lesion) - label)^2."""
    if not len(prob):
        return {"ece": np.nan, "brier": np.nan}
    label = label.astype(float)
    gaps = np.bincount(bin_index(prob, bins), weights=label - prob, minlength=bins + 1)  # per bin: sum of y - p
    return {"ece": float(np.abs(gaps).sum() / len(prob)), "brier": float(np.mean((prob - label) ** 2))}


def reliability(prob: np.ndarray, label: np.ndarray, bins: int = BINS) -> list[dict]:
    """The reliability diagram's non-empty bins: ``lower``, ``upper`` edges, ``mean_prob``, ``fraction_positive``,
    ``n``."""
    index = np.minimum(bin_index(prob, bins), bins - 1)  # P = 1 drawn in the last bin
    rows = []
    for k in range(bins):
        chosen = index == k
        if chosen.any():
            rows.append({"lower": k / bins, "upper": (k + 1) / bins, "mean_prob": float(prob[chosen].mean()),
                         "fraction_positive": float(label[chosen].mean()), "n": int(chosen.sum())})  # fmt: skip
    return rows


def fit_temperature(prob: np.ndarray, label: np.ndarray, *, steps: int = 50) -> float:
    """The T > 0 that minimises the negative log-likelihood of ``sigmoid(logit(prob) / T)`` on these cases.

    The likelihood is convex in 1/T (a logistic regression on the logit, one weight, no intercept): Newton's method
    from T = 1, each step halved until the likelihood falls; T no lower than 0.01 (where P(lesion) separates the
    cases perfectly, the likelihood keeps rising as T falls).
    """
    z, y = logit(prob), label.astype(float)

    def nll(beta: float) -> float:
        return float(np.mean(np.logaddexp(0.0, beta * z) - y * beta * z))  # -log-likelihood of a Bernoulli, stable

    beta = 1.0
    for _ in range(steps):
        q = sigmoid(beta * z)
        gradient, curvature = np.mean((q - y) * z), np.mean(q * (1 - q) * z**2)
        if curvature <= 0 or abs(gradient) < 1e-12:
            break
        step = gradient / curvature
        while nll(beta - step) > nll(beta) and abs(step) > 1e-12:
            step /= 2
        beta = min(beta - step, 1 / MIN_TEMPERATURE)
    if beta <= 0:
        raise ValueError("temperature scaling: P(lesion) ranks the validation cases backwards (no T > 0 fits)")
    return float(1.0 / beta)
