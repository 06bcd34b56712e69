"""Decision curve analysis (Vickers & Elkin 2006): at the threshold probability at which a reader would act on a case
(call it, recall it, read it first), is acting on the model's P(lesion) worth more than acting on every case, or on
none? A threshold ``t`` says how many false alarms one found lesion is worth: ``(1 - t) / t``. The net benefit of
acting on the cases with P(lesion) >= t is ``TP / n - FP / n x t / (1 - t)``, found lesions per case less the false
alarms weighed by ``t``; acting on every case gives ``prevalence - (1 - prevalence) x t / (1 - t)``, on none 0.
Intervals: the report's bootstrap over patients, pointwise per threshold.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from vit_ct.report.bootstrap import MIN_PATIENTS, patient_bootstrap, percentile_interval, replicate
from vit_ct.report.inputs import P_LESION, PATIENT, POSITIVE

THRESHOLDS = np.round(np.arange(1, 100) / 100, 2)  # 0.01 ... 0.99: the curve
TABLE_THRESHOLDS = (0.05, 0.1, 0.2, 0.3, 0.5)  # the page's table: where triage and recall decisions are taken


def net_benefit(prob: np.ndarray, label: np.ndarray, thresholds: np.ndarray = THRESHOLDS) -> np.ndarray:
    """``(T,)`` net benefit of acting on the cases with ``prob >= t``, per threshold ``t`` (NaN without cases)."""
    n = len(prob)
    if not n:
        return np.full(len(thresholds), np.nan)
    order = np.argsort(-prob, kind="stable")  # most suspicious first: the first k are those called at some t
    found = np.concatenate([[0], np.cumsum(label[order])])
    called = n - np.searchsorted(np.sort(prob), thresholds, side="left")  # cases with prob >= t
    true_pos, false_pos = found[called], called - found[called]
    return true_pos / n - false_pos / n * thresholds / (1 - thresholds)


def treat_all(label: np.ndarray, thresholds: np.ndarray = THRESHOLDS) -> np.ndarray:
    """``(T,)`` net benefit of acting on every case."""
    if not len(label):
        return np.full(len(thresholds), np.nan)
    prevalence = float(np.mean(label))
    return prevalence - (1 - prevalence) * thresholds / (1 - thresholds)


def decision_curve(cases: pd.DataFrame, *, resamples: int, seed: int) -> dict:
    """The decision curve of labelled cases (slices or scans, with their patients): per threshold of
    :data:`THRESHOLDS`, the model's net benefit with its 95% interval (none under 5 patients) and acting on every
    case's; ``model_better``: the ranges of thresholds ``[from, to]`` where the model's is above both acting on every
    case and on none; ``table``: the figures at :data:`TABLE_THRESHOLDS`."""
    prob, label = cases[P_LESION].to_numpy(float), cases[POSITIVE].to_numpy(bool)
    model, every = net_benefit(prob, label), treat_all(label)
    bootstrap = patient_bootstrap(cases[PATIENT], resamples=resamples, seed=seed)
    reps = replicate(lambda rows: {"model": net_benefit(prob[rows], label[rows])}, bootstrap)
    patients = bootstrap.draws.shape[1]
    lo, hi = percentile_interval(reps["model"]) if patients >= MIN_PATIENTS else (model * np.nan, model * np.nan)
    better = np.flatnonzero(model > np.maximum(every, 0.0))
    runs = np.split(better, np.flatnonzero(np.diff(better) > 1) + 1) if len(better) else []
    table = []
    for t in TABLE_THRESHOLDS:
        k = int(np.flatnonzero(np.isclose(THRESHOLDS, t))[0])
        ci = None if np.isnan(lo[k]) else [float(lo[k]), float(hi[k])]
        table.append({"threshold": t, "model": {"value": float(model[k]), "ci95": ci, "n": len(cases)},
                      "treat_all": float(every[k]), "treat_none": 0.0})  # fmt: skip
    return {
        "n": len(cases),
        "prevalence": float(np.mean(label)) if len(label) else None,
        "thresholds": THRESHOLDS.tolist(),
        "model": model.tolist(),
        "model_ci95": [lo.tolist(), hi.tolist()],
        "treat_all": every.tolist(),
        "treat_none": 0.0,
        "model_better": [[float(THRESHOLDS[run[0]]), float(THRESHOLDS[run[-1]])] for run in runs],
        "table": table,
    }
