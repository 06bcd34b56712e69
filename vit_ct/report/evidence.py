"""``vit-ct report``'s figures for one model: detection per slice and per scan, calibration (and temperature scaling
where validation slices were predicted), the maps against the lesion masks, subgroups and the worst cases, each figure
with its 95% interval from a bootstrap over patients (:mod:`vit_ct.report.bootstrap`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from vit_ct.metrics.schema import PREDICTIONS
from vit_ct.report.bootstrap import estimate, patient_bootstrap, percentile_interval
from vit_ct.report.calibration import BINS, calibration_scores, fit_temperature, reliability, scale
from vit_ct.report.decision import decision_curve
from vit_ct.report.detection import detection_counts, detection_scores
from vit_ct.report.inputs import (
    MASK_PATH,
    OVERLAY_PATH,
    P_LESION,
    PATIENT,
    POSITIVE,
    SCAN_POSITIVE,
    SPLIT,
    ModelPredictions,
    join,
    scan_table,
)
from vit_ct.report.map_quality import floor_scores, lesion_areas, map_scores, pointing_by_size
from vit_ct.report.subgroups import dicom_fields, subgroups

WORST = 5  # most confident false positives and false negatives shown


@dataclass
class ModelEvidence:
    """One model's report: ``sections`` as report.json holds them (``slice``, ``scan``, ``maps``, ``calibration``,
    ``decision_curve``, ``subgroups``, ``worst_cases``, ``rows``), and what the figures draw (curves with bands,
    reliability bins)."""

    name: str
    sections: dict
    curves: dict = field(default_factory=dict)  # level -> {"roc": (tpr, lo, hi), "pr": (precision, lo, hi)}


def split_rows(slices: pd.DataFrame, split: str | None) -> tuple[pd.DataFrame, str]:
    """The predicted slices of ``split`` (``all``: every one); None: the test split where the manifest marks test
    slices among the predictions, else every one. Also the split's name.

    Raises:
        ValueError: no slice of the split has a label, a slice label or a scan label (naming both files).
    """
    known = slices[POSITIVE].notna() | slices[SCAN_POSITIVE].notna()
    if not known.any():
        raise ValueError(f"none of the {len(slices)} predicted slices of {slices.attrs['predictions']} has a label in"
                         f" manifest {slices.attrs['manifest']}; the report needs labels")  # fmt: skip
    if split is None:
        split = "test" if slices.loc[known, SPLIT].eq("test").any() else "all"
    chosen = slices if split == "all" else slices[slices[SPLIT] == split]
    if not known[chosen.index].any():
        found = sorted(set(slices.loc[known, SPLIT].dropna()))
        raise ValueError(f"no labelled predicted slice is in the {split} split of manifest {slices.attrs['manifest']}"
                         f" (splits of the labelled predictions: {found})")  # fmt: skip
    return chosen, split


def labelled(slices: pd.DataFrame) -> pd.DataFrame:
    """The slices with a slice label, ``positive`` as bool."""
    chosen = slices[slices[POSITIVE].notna()]
    return chosen.assign(**{POSITIVE: chosen[POSITIVE].astype(bool)})


def case_statistic(prob: np.ndarray, label: np.ndarray, *, calibration: bool):
    """Detection (and calibration) figures of a replicate's cases."""

    def statistic(rows: np.ndarray) -> dict:
        out = detection_scores(prob[rows], label[rows])
        return out | calibration_scores(prob[rows], label[rows]) if calibration else out

    return statistic


def level_figures(cases: pd.DataFrame, *, calibration: bool, resamples: int, seed: int) -> tuple[dict, dict]:
    """Figures of slices or scans with intervals, and their ROC and PR curves with pointwise 95% bands."""
    prob, label = cases[P_LESION].to_numpy(float), cases[POSITIVE].to_numpy(bool)
    counts = detection_counts(label) | ({"ece": len(cases), "brier": len(cases)} if calibration else {})
    bootstrap = patient_bootstrap(cases[PATIENT], resamples=resamples, seed=seed)
    metrics, reps = estimate(case_statistic(prob, label, calibration=calibration), bootstrap, counts)
    full = detection_scores(prob, label)
    curves = {kind: (full[key], *percentile_interval(reps[key])) for kind, key in (("roc", "roc_tpr"),
                                                                                   ("pr", "pr_precision"))}  # fmt: skip
    return metrics, curves


def calibration_section(rows: pd.DataFrame, val: pd.DataFrame, slice_metrics: dict, *, resamples: int, seed: int):
    """ECE and Brier score (from the slice figures), the reliability bins, and temperature scaling fitted on ``val``
    (predicted validation slices) with the figures after it, where there are validation slices of both kinds."""
    prob, label = rows[P_LESION].to_numpy(float), rows[POSITIVE].to_numpy(bool)
    section = {"bins": BINS, "binning": "equal width over [0, 1]", "ece": slice_metrics.pop("ece"),
               "brier": slice_metrics.pop("brier"), "reliability": reliability(prob, label)}  # fmt: skip
    if val.empty or val[POSITIVE].nunique() < 2:
        section["temperature"] = None
        section["temperature_note"] = "no predicted validation slices of both kinds: temperature scaling not fitted"
        return section
    try:
        temperature = fit_temperature(val[P_LESION].to_numpy(float), val[POSITIVE].to_numpy(bool))
    except ValueError as err:  # a model no temperature helps: said in the report, which goes on
        return section | {"temperature": None, "temperature_note": str(err)}
    scaled = scale(prob, temperature)
    bootstrap = patient_bootstrap(rows[PATIENT], resamples=resamples, seed=seed)
    counts = {"ece": len(rows), "brier": len(rows)}
    after, _ = estimate(lambda chosen: calibration_scores(scaled[chosen], label[chosen]), bootstrap, counts)
    section |= {
        "temperature": temperature,
        "fitted_on": len(val),
        "ece_after": after["ece"],
        "brier_after": after["brier"],
        "reliability_after": reliability(scaled, label),
    }
    return section


def worst_cases(rows: pd.DataFrame, n: int = WORST) -> dict[str, list[dict]]:
    """The most confident false positives (no lesion, highest P(lesion) above 0.5) and false negatives (a lesion,
    lowest P(lesion) at most 0.5), with their overlays where the predictions have them."""

    def listed(chosen: pd.DataFrame) -> list[dict]:
        return [{"image": r.image, "p_lesion": float(r.p_lesion), "patient": r.patient,
                 "overlay": getattr(r, OVERLAY_PATH)} for r in chosen.itertuples()]  # fmt: skip

    fp = rows[~rows[POSITIVE] & (rows[P_LESION] > 0.5)].sort_values(P_LESION, ascending=False, kind="stable")
    fn = rows[rows[POSITIVE] & (rows[P_LESION] <= 0.5)].sort_values(P_LESION, kind="stable")
    return {"false_positives": listed(fp.head(n)), "false_negatives": listed(fn.head(n))}


def unscored_maps_note(masked: int) -> str:
    """Why a report whose manifest has lesion masks shows no map scores: they are computed when predicting."""
    return (
        f"{masked} reported slices have a lesion mask in this manifest, but the predictions hold no map scores: the"
        " maps are scored when predicting, against the masks of the manifest predict read. Predict again with this"
        " manifest (vit-ct predict --data.manifest ...) to score them"
    )


def model_evidence(
    predictions: ModelPredictions,
    manifest: pd.DataFrame,
    *,
    split: str | None,
    resamples: int,
    seed: int,
    tolerance_mm: float,
) -> ModelEvidence:
    """Every section of one model's report (see :class:`ModelEvidence`); ``tolerance_mm``: the pointing game's, for
    the floors the report scores itself (:func:`~vit_ct.report.map_quality.floor_scores`)."""
    slices = join(predictions, manifest)
    in_split, split = split_rows(slices, split)
    rows = labelled(lesion_areas(dicom_fields(in_split)))
    curves, slice_metrics, calibration, maps, groups, worst, decision = {}, {}, {}, {}, {}, {}, {}
    if len(rows):  # slice labels (a manifest of scan labels alone has them only for lesion-free scans)
        slice_metrics, curves["slice"] = level_figures(rows, calibration=True, resamples=resamples, seed=seed)
        val = labelled(slices[slices[SPLIT] == "val"]) if split != "val" else rows.iloc[:0]
        calibration = calibration_section(rows, val, slice_metrics, resamples=resamples, seed=seed)
        floors = floor_scores(rows, manifest, predictions.info.get("input"), tolerance_mm=tolerance_mm)
        maps = map_scores(floors, resamples=resamples, seed=seed)
        if maps:
            maps["pointing_by_lesion_size"] = pointing_by_size(rows, resamples=resamples, seed=seed)
        elif PREDICTIONS.rollout in predictions.table and MASK_PATH in rows and rows[MASK_PATH].notna().any():
            maps = {"note": unscored_maps_note(int(rows[MASK_PATH].notna().sum()))}
        groups, worst = subgroups(rows, slice_metrics, resamples=resamples, seed=seed), worst_cases(rows)
        decision["slice"] = decision_curve(rows, resamples=resamples, seed=seed)
    scans, scan_metrics = scan_table(in_split), {}
    if scans is not None:
        scans = labelled(scans)
        scan_metrics, curves["scan"] = level_figures(scans, calibration=False, resamples=resamples, seed=seed)
        decision["scan"] = decision_curve(scans, resamples=resamples, seed=seed)
    sections = {
        "slice": slice_metrics,
        "scan": scan_metrics,
        "maps": maps,
        "calibration": calibration,
        "decision_curve": decision,
        "subgroups": groups,
        "worst_cases": worst,
        "rows": {
            "predictions": slices.attrs["predictions"],
            "split": split,
            "slices": len(rows),
            "positive_slices": int(rows[POSITIVE].sum()),
            "scans": 0 if scans is None else len(scans),
            "patients": int(in_split[PATIENT].nunique()),
        },  # fmt: skip
    }
    return ModelEvidence(predictions.name, sections, curves)
