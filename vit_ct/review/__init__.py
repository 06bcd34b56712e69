"""Reviewing a run, behind ``notebooks/attention_review.ipynb``: where the model and slices come from
(:mod:`~vit_ct.inspection.loading`), the review table (:mod:`~vit_ct.review.table`) and what it says as a whole
(:mod:`~vit_ct.review.summaries`), one case in depth and the export (:mod:`~vit_ct.review.cases`), figures and the case
browser (:mod:`~vit_ct.review.figures`), a predict output's evidence report as read from its files
(:mod:`~vit_ct.review.report_view`), the headless notebook runner (:mod:`~vit_ct.review.notebook`,
``python -m vit_ct.review``), and the maps' model-randomisation check of a checkpoint
(:mod:`~vit_ct.review.sanity_command`)."""

from vit_ct.inspection.loading import (
    load_review,
    project_path,
    project_root,
    resolve_checkpoint,
    review_datamodule,
    review_reading,
    run_config,
)
from vit_ct.review.cases import METHODS, CaseMaps, case_maps, export_flagged, review_csv
from vit_ct.review.predict_run import PredictRun, open_predict_run
from vit_ct.review.report_view import EvidenceReport, missing_report, open_report
from vit_ct.review.scan_view import plot_scan, scan_browser, verdicts_so_far
from vit_ct.review.summaries import (
    GROUPS,
    calibration_bins,
    confusion,
    expected_calibration_error,
    gallery,
    localisation_summary,
    pick_case,
    review_order,
    roc_points,
    scan_results,
    sink_summary,
    summary_metrics,
)
from vit_ct.review.table import SCORES, case_images, outcome, run_review, source_map
from vit_ct.review.verdicts import Verdicts, compare_reviewers, verdict_summary, verdicts_path

__all__ = [
    "CaseMaps",
    "EvidenceReport",
    "GROUPS",
    "METHODS",
    "PredictRun",
    "SCORES",
    "Verdicts",
    "calibration_bins",
    "case_images",
    "case_maps",
    "compare_reviewers",
    "confusion",
    "expected_calibration_error",
    "export_flagged",
    "gallery",
    "load_review",
    "review_reading",
    "localisation_summary",
    "missing_report",
    "open_predict_run",
    "open_report",
    "outcome",
    "pick_case",
    "plot_scan",
    "project_path",
    "project_root",
    "resolve_checkpoint",
    "review_csv",
    "review_datamodule",
    "review_order",
    "roc_points",
    "run_config",
    "run_review",
    "scan_browser",
    "scan_results",
    "sink_summary",
    "source_map",
    "summary_metrics",
    "verdict_summary",
    "verdicts_path",
    "verdicts_so_far",
]
