"""How well P(lesion) separates cases with a lesion from cases without: AUROC, average precision, sensitivity and
specificity at 0.5 and at the operating points of 90% and 95% specificity, and the ROC and precision-recall curves on
fixed grids (for their bands). The curves are torchmetrics' (``binary_roc``, ``binary_precision_recall_curve``), the
figures read off them as torchmetrics' ``BinaryAUROC``, ``BinaryAveragePrecision`` and
``BinarySensitivityAtSpecificity`` do, one curve per replicate instead of one call per figure.
"""

from __future__ import annotations

import numpy as np
import torch
from torchmetrics.functional.classification import binary_precision_recall_curve, binary_roc

THRESHOLD = 0.5  # a case is called positive when P(lesion) > 0.5, as torchmetrics' stat scores call it
SPECIFICITIES = (0.90, 0.95)  # the operating points: the highest sensitivity at a specificity of at least this
GRID = np.linspace(0.0, 1.0, 101)  # false-positive rate (ROC) and recall (PR) at which the curves' bands are drawn


def operating_point(specificity: float) -> str:
    """The name suffix of an operating point: ``spec90``, ``spec95``."""
    return f"spec{round(specificity * 100)}"


def detection_counts(label: np.ndarray) -> dict[str, int]:
    """The cases each figure of :func:`detection_scores` is computed on: the rows, the positives (sensitivity), the
    negatives (specificity)."""
    label = label.astype(bool)
    n, positives, negatives = len(label), int(label.sum()), int((~label).sum())
    counts = {"auroc": n, "average_precision": n, "sensitivity": positives, "specificity": negatives}
    for target in SPECIFICITIES:
        point = operating_point(target)
        counts |= {
            f"sensitivity_at_{point}": positives,
            f"specificity_at_{point}": negatives,
            f"threshold_at_{point}": n,
        }
    return counts


def detection_scores(prob: np.ndarray, label: np.ndarray) -> dict[str, float | np.ndarray]:
    """The detection figures of cases with P(lesion) ``prob`` and 0/1 ``label``; NaN where undefined (AUROC without
    both classes, sensitivity without positives, ...). ``roc_tpr`` and ``pr_precision``: the curves on :data:`GRID`.

    The operating point at specificity ``s`` is the ROC curve's point of highest sensitivity among those with a
    specificity of at least ``s`` (the highest threshold reaching it): cases with P(lesion) >= its threshold are called
    positive.
    """
    label = label.astype(bool)
    positives, negatives = int(label.sum()), int((~label).sum())
    called = prob > THRESHOLD
    scores: dict[str, float | np.ndarray] = {
        "sensitivity": float(called[label].mean()) if positives else np.nan,
        "specificity": float((~called[~label]).mean()) if negatives else np.nan,
    }
    names = ["auroc", "average_precision"] + [
        f"{kind}_at_{operating_point(s)}" for s in SPECIFICITIES for kind in ("sensitivity", "specificity", "threshold")
    ]
    if not (positives and negatives):
        return scores | dict.fromkeys(names, np.nan) | {"roc_tpr": np.full(len(GRID), np.nan),
                                                        "pr_precision": np.full(len(GRID), np.nan)}  # fmt: skip
    p, y = torch.from_numpy(np.array(prob, dtype=np.float64)), torch.from_numpy(label.astype(np.int64))
    fpr, tpr, thresholds = binary_roc(p, y, validate_args=False)  # thresholds descending, from "nothing positive"
    precision, recall, _ = binary_precision_recall_curve(p, y, validate_args=False)  # recall descending
    scores["auroc"] = float(torch.trapezoid(tpr, fpr))
    scores["average_precision"] = float(-torch.sum((recall[1:] - recall[:-1]) * precision[:-1]))
    for target in SPECIFICITIES:
        allowed = (1 - fpr) >= target - 1e-12  # the first point (nothing called positive) always is
        best = int(torch.argmax(torch.where(allowed, tpr, -1.0)))  # the first (highest threshold) of the highest
        point = operating_point(target)
        scores[f"sensitivity_at_{point}"] = float(tpr[best])
        scores[f"specificity_at_{point}"] = float(1 - fpr[best])
        scores[f"threshold_at_{point}"] = float(min(thresholds[best], 1.0))
    scores["roc_tpr"] = np.interp(GRID, fpr.numpy(), tpr.numpy())
    scores["pr_precision"] = np.interp(GRID, recall.numpy()[::-1], precision.numpy()[::-1])
    return scores
