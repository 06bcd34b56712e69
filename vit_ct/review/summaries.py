"""What the review table says as a whole: outcome groups, confusion, slice- and scan-level metrics, ROC and
calibration, the attention sink and localisation beside their floors, and the cases to look at first."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from torchmetrics.functional.classification import binary_auroc, binary_confusion_matrix, binary_roc

from vit_ct.metrics.lesion_probability import scan_auroc, scan_summary
from vit_ct.metrics.localisation import MAP_SOURCES
from vit_ct.metrics.schema import PREDICTIONS, REVIEW, SCANS
from vit_ct.review.table import SCORES, outcome

GROUPS = {"TP": "true positive", "FP": "false positive", "FN": "false negative", "TN": "true negative"}


def _labelled(table: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    known = table[REVIEW.label].notna().to_numpy()
    prob, label = table[REVIEW.prob].to_numpy(dtype=np.float64), table[REVIEW.label].to_numpy()
    return prob[known], label[known].astype(np.int64)


def confusion(table: pd.DataFrame, threshold: float = 0.5) -> pd.DataFrame:
    """2 x 2 counts over the labelled slices: rows true label 0/1, columns predicted 0/1 (sklearn's layout), from
    torchmetrics (P > ``threshold`` is positive), as the training metrics count them."""
    prob, label = _labelled(table)
    counts = binary_confusion_matrix(torch.from_numpy(prob), torch.from_numpy(label), threshold=threshold).numpy()
    return pd.DataFrame(counts, index=pd.Index([0, 1], name="true"), columns=pd.Index([0, 1], name="predicted"))


def scan_results(table: pd.DataFrame) -> pd.DataFrame | None:
    """One row per scan of the review table, as ``scans.csv`` of ``vit-ct predict``: ``prob`` the maximum over the
    scan's slices, ``label`` 1 when any slice has a lesion; None when the slices name no scan."""
    if REVIEW.scan not in table.columns or table[REVIEW.scan].isna().any():
        return None
    slices = table.reset_index().rename(columns={PREDICTIONS.index: SCANS.order, REVIEW.prob: SCANS.p_lesion})
    label = slices[REVIEW.label]
    slices[SCANS.positive] = (label > 0).astype("boolean").where(label.notna())
    return scan_summary(slices, REVIEW.scan)


def summary_metrics(table: pd.DataFrame, threshold: float = 0.5) -> pd.Series:
    """Slices, positives, AUROC (NaN with one class only), accuracy, sensitivity, specificity at ``threshold``; and
    where the slices name their scans, the scans, the positive scans and the scan-level AUROC (:func:`scan_results`)."""
    prob, label = _labelled(table)
    (tn, fp), (fn, tp) = confusion(table, threshold).to_numpy()
    both = 0 < label.sum() < len(label)
    auroc = float(binary_auroc(torch.from_numpy(prob), torch.from_numpy(label))) if both else float("nan")

    def ratio(a: int, b: int) -> float:
        return a / b if b else float("nan")

    metrics = {
        "slices": len(label),
        "positives": int(label.sum()),
        "auroc": auroc,
        "accuracy": ratio(tp + tn, len(label)),
        "sensitivity": ratio(tp, tp + fn),
        "specificity": ratio(tn, tn + fp),
    }
    scans = scan_results(table)
    if scans is not None:
        known = scans[scans["label"].notna()]
        metrics.update(scans=len(known), positive_scans=int(known["label"].sum()), scan_auroc=scan_auroc(scans))
    return pd.Series(metrics)


def roc_points(table: pd.DataFrame) -> pd.DataFrame:
    """ROC curve over the labelled slices (torchmetrics): ``fpr``, ``tpr``, ``threshold`` (highest first)."""
    prob, label = _labelled(table)
    fpr, tpr, thresholds = binary_roc(torch.from_numpy(prob), torch.from_numpy(label))
    return pd.DataFrame({"fpr": fpr.numpy(), "tpr": tpr.numpy(), "threshold": thresholds.numpy()})


def calibration_bins(table: pd.DataFrame, n_bins: int = 10) -> pd.DataFrame:
    """Reliability diagram data: ``n_bins`` equal-width bins of P(lesion), right edge inclusive (as sklearn's
    ``calibration_curve``): ``lower``, ``upper``, ``count``, ``mean_prob``, ``fraction_positive`` (NaN when empty)."""
    prob, label = _labelled(table)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    bins = np.searchsorted(edges[1:-1], prob)  # bin i holds (edges[i], edges[i + 1]]; bin 0 also 0
    count = np.bincount(bins, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_prob = np.bincount(bins, weights=prob, minlength=n_bins) / count
        fraction = np.bincount(bins, weights=label, minlength=n_bins) / count
    return pd.DataFrame(
        {"lower": edges[:-1], "upper": edges[1:], "count": count, "mean_prob": mean_prob, "fraction_positive": fraction}
    )


def expected_calibration_error(bins: pd.DataFrame) -> float:
    """Count-weighted mean of |fraction positive - mean probability| over the bins."""
    full = bins[bins["count"] > 0]
    gap = (full["fraction_positive"] - full["mean_prob"]).abs()
    return float((gap * full["count"]).sum() / full["count"].sum()) if len(full) else float("nan")


def sink_summary(table: pd.DataFrame) -> pd.DataFrame:
    """The attention sink over the reviewed slices, per block: the class token's mean attention on prefix tokens
    (class token, registers) and on air patches; the table's ``attrs`` carry the mean ``rollout_air`` (share of
    the rollout on patches without a head pixel) and ``rollout_outside_head`` (on the slice grid)."""
    blocks = pd.DataFrame(
        {name: np.stack(table[name].to_numpy()).mean(axis=0) for name in (REVIEW.cls_prefix, REVIEW.cls_air)}
    ).rename_axis("block")
    shares = (PREDICTIONS.rollout_air, PREDICTIONS.rollout_outside_head)
    blocks.attrs = {name: float(table[name].mean()) for name in shares}
    return blocks


def localisation_summary(table: pd.DataFrame) -> pd.DataFrame | None:
    """Mean localisation scores per map source over the scored slices, as the model's ``test/{source}_{score}``
    (``energy_ratio`` = mean energy / mean mask fraction); None when no slice has a lesion mask. A score no source has
    (``hd95_px`` where every scored slice has a pixel spacing, ``hd95_mm`` where none has) is left out."""
    scored = table[PREDICTIONS.score("rollout", "pointing")].notna()
    if not scored.any():
        return None
    rows = {}
    for source in MAP_SOURCES:
        pointing = PREDICTIONS.score(source, "pointing")
        if pointing not in table or table.loc[scored, pointing].isna().all():
            continue  # perfect_grid of a rollout on the patch grid
        means = {name: table.loc[scored, PREDICTIONS.score(source, name)].mean() for name in SCORES}
        means["energy_ratio"] = means["energy"] / means["mask_fraction"]
        rows[source] = {**means, "slices": int(scored.sum())}
    return pd.DataFrame.from_dict(rows, orient="index").dropna(axis="columns", how="all")


def gallery(table: pd.DataFrame, group: str, n: int | None = 4, *, threshold: float = 0.5) -> pd.DataFrame:
    """Up to ``n`` slices of one group (``TP``, ``FP``, ``FN``, ``TN``, ``unlabelled``), most confident first:
    highest P(lesion) first for predicted positives (and unlabelled slices), lowest first for predicted negatives;
    ties in table order."""
    if group not in (*GROUPS, "unlabelled"):
        raise ValueError(f"group must be one of {[*GROUPS, 'unlabelled']}, got {group!r}")
    rows = table[outcome(table, threshold) == group]
    rows = rows.sort_values(REVIEW.prob, ascending=group in ("FN", "TN"), kind="stable")
    return rows if n is None else rows.head(n)


def review_order(table: pd.DataFrame, *, threshold: float = 0.5) -> pd.DataFrame:
    """Every slice, group by group (TP, FP, FN, TN, then unlabelled), most confident first: the browser's order."""
    return pd.concat([gallery(table, group, None, threshold=threshold) for group in (*GROUPS, "unlabelled")])


def pick_case(table: pd.DataFrame, image: str | None = None, *, threshold: float = 0.5) -> pd.Series:
    """The row of ``image`` (as in the manifest); None: the most confident true positive, else the first slice."""
    if image is not None:
        rows = table[table[REVIEW.image] == image]
        if rows.empty:
            raise ValueError(f"case {image!r} is not among the {len(table)} reviewed slices")
        return rows.iloc[0]
    return review_order(table, threshold=threshold).iloc[0]
