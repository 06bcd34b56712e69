"""95% intervals from a bootstrap over patients (Efron & Tibshirani 1993, the percentile interval): each replicate
draws as many patients as there are, with replacement, and keeps every row of each patient drawn, so slices of one
patient (which are not independent) move together. The draws are seeded and exposed: a replicate can be recomputed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

RESAMPLES = 1000
SEED = 0
# Below this many patients a percentile interval over patients is not given: P patients have only C(2P-1, P) distinct
# resamples (1 for one patient, 10 for three), too few to read a 2.5th and a 97.5th percentile from; "[0.333, 0.333]"
# on one patient reads as certainty.
MIN_PATIENTS = 5
# {"value": float | None, "ci95": [lo, hi] | None, "n": int}: how report.json holds each figure; with fewer than
# MIN_PATIENTS patients also "ci95_undefined": why there is no interval
Metric = dict


@dataclass
class PatientBootstrap:
    """The resamples of a table's rows by patient.

    Attributes:
        patients: ``(N,)`` each row's patient, as an index into the distinct patients.
        draws: ``(resamples, P)`` the patients each replicate draws (with replacement, P of them).
    """

    patients: np.ndarray
    draws: np.ndarray
    _order: np.ndarray = field(init=False, repr=False)
    _counts: np.ndarray = field(init=False, repr=False)
    _starts: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._order = np.argsort(self.patients, kind="stable")  # rows grouped by patient, table order within each
        self._counts = np.bincount(self.patients, minlength=self.draws.shape[1])
        self._starts = np.cumsum(self._counts) - self._counts

    @property
    def resamples(self) -> int:
        return len(self.draws)

    def rows(self, replicate: int) -> np.ndarray:
        """The table rows of one replicate: every row of each patient drawn, a patient drawn twice twice."""
        drawn = self.draws[replicate]
        lengths = self._counts[drawn]
        # position of each output row within its patient's block, added to the block's start
        offsets = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        return self._order[np.repeat(self._starts[drawn], lengths) + offsets]


def patient_bootstrap(patients: Sequence, *, resamples: int = RESAMPLES, seed: int = SEED) -> PatientBootstrap:
    """The seeded resamples of rows whose patients are ``patients`` (one name per row)."""
    _, index = np.unique(np.asarray(patients, dtype=str), return_inverse=True)
    n = int(index.max()) + 1 if len(index) else 0
    draws = np.random.default_rng(seed).integers(0, n, size=(resamples, n)) if n else np.zeros((resamples, 0), int)
    return PatientBootstrap(patients=index.astype(np.int64), draws=draws)


def replicate(statistic: Callable[[np.ndarray], dict], bootstrap: PatientBootstrap) -> dict[str, np.ndarray]:
    """``statistic(rows)`` (a dict of numbers or arrays) on every replicate, stacked: name -> ``(resamples, ...)``."""
    values = [statistic(bootstrap.rows(r)) for r in range(bootstrap.resamples)]
    return {name: np.stack([np.asarray(v[name], dtype=float) for v in values]) for name in values[0]} if values else {}


def percentile_interval(replicates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 2.5th and 97.5th percentiles over the replicates (axis 0), leaving out those where the figure is undefined
    (NaN: e.g. a replicate that drew no positive case has no AUROC)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "All-NaN slice": no replicate defines it, the bound is NaN
        lo, hi = np.nanpercentile(replicates, [2.5, 97.5], axis=0)
    return lo, hi


def metric(value: float, replicates: np.ndarray | None, n: int) -> Metric:
    """One figure as report.json holds it; NaN (undefined) as None."""
    value = float(value)
    if np.isnan(value):
        return {"value": None, "ci95": None, "n": int(n)}
    ci = None
    if replicates is not None and np.isfinite(replicates).any():
        lo, hi = percentile_interval(replicates)
        ci = [float(lo), float(hi)]
    return {"value": value, "ci95": ci, "n": int(n)}


def estimate(
    statistic: Callable[[np.ndarray], dict], bootstrap: PatientBootstrap, counts: dict[str, int]
) -> tuple[dict[str, Metric], dict[str, np.ndarray]]:
    """Each scalar of ``statistic`` on all rows with its interval over the replicates (``counts``: per name, the cases
    it is computed on, its ``n``), and the replicates themselves (the curves' bands are read from them)."""
    values = statistic(np.arange(len(bootstrap.patients)))
    reps = replicate(statistic, bootstrap)
    metrics = {name: metric(v, reps[name], counts[name]) for name, v in values.items() if np.ndim(v) == 0}
    patients = bootstrap.draws.shape[1]
    if patients < MIN_PATIENTS:  # the interval is undefined, and said so beside the figure
        for figure in metrics.values():
            if figure["value"] is not None:
                figure["ci95"] = None
                figure["ci95_undefined"] = f"{patients} patient{'s' * (patients != 1)}, at least {MIN_PATIENTS} needed"
    return metrics, reps
