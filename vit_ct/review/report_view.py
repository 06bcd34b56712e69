"""The ``vit-ct report`` of a predict output as the review notebook shows it: the headline figures with their 95%
intervals, and the report's figures as PNG, read from its own files (``report.json``, ``figures/``): the review sits
below the report and never computes one."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from vit_ct.inspection.loading import project_path
from vit_ct.metrics.schema import PREDICTIONS, RUN_JSON

# vit_ct.report.report_files' names, which the review may not import (tests/test_notebook.py holds them equal)
REPORT_JSON, REPORT_HTML, FIGURES = "report.json", "report.html", "figures"
DEFAULT_FOLDER = "report"  # `vit-ct report OUT` writes OUT/report unless --output_dir says otherwise
# (section, figure) of report.json in the order a reader looks for them; a map's section is maps/<map>
HEADLINE = (
    *(("slice", f) for f in ("auroc", "average_precision", "sensitivity", "specificity", "sensitivity_at_spec90")),
    *(("scan", f) for f in ("auroc", "average_precision", "sensitivity", "specificity")),
    ("calibration", "ece"),
    ("calibration", "brier"),
    *(("maps/rollout", f) for f in ("pointing", "energy_ratio", "pixel_auroc", "dice")),
)


@dataclass
class EvidenceReport:
    """One report folder.

    Attributes:
        folder: The report's folder.
        record: ``report.json``.
        figures: The PNG bytes of ``figures/*.png`` by name (``roc``, ``pr``, ``reliability``...), sorted.
    """

    folder: Path
    record: dict
    figures: dict[str, bytes]

    @property
    def page(self) -> Path:
        """``report.html``: the whole report, one self-contained page."""
        return self.folder / REPORT_HTML

    @property
    def headline(self) -> pd.DataFrame:
        """The :data:`HEADLINE` figures the report has, by (section, figure): the first model's ``value``, ``ci95_low``,
        ``ci95_high`` and ``n`` (the cases it is computed on), then each compared model's value under its name."""
        models = {self.record["model"]: self.record, **self.record.get("compare", {})}
        rows = {}
        for section, figure in HEADLINE:
            entries = {name: _figure(sections, section, figure) for name, sections in models.items()}
            first = entries[self.record["model"]]
            if first is None:
                continue
            low, high = first.get("ci95") or (None, None)
            others = {name: (e or {}).get("value") for name, e in entries.items() if name != self.record["model"]}
            rows[section, figure] = {"value": first["value"], "ci95_low": low, "ci95_high": high, "n": first["n"],
                                     **others}  # fmt: skip
        table = pd.DataFrame.from_dict(rows, orient="index")
        table.index.names = ["section", "figure"]
        return table

    @property
    def described(self) -> str:
        """What the figures are computed on: split, slices, scans, patients, bootstrap."""
        rows, bootstrap = self.record.get("rows", {}), self.record.get("settings", {}).get("bootstrap", {})
        return (f"{self.record['model']} on the {rows.get('split')} split: {rows.get('slices')} slices"
                f" ({rows.get('positive_slices')} with a lesion), {rows.get('scans')} scans,"
                f" {rows.get('patients')} patients; 95% intervals over {bootstrap.get('resamples')} bootstrap"
                " replicates by patient")  # fmt: skip


def _figure(sections: dict, section: str, figure: str) -> dict | None:
    """``{"value", "ci95", "n"}`` of ``section`` (``maps/rollout``: ``maps`` -> ``rollout``), None where absent or
    undefined."""
    entry = sections
    for key in (*section.split("/"), figure):
        entry = entry.get(key) if isinstance(entry, dict) else None
    return entry if isinstance(entry, dict) and entry.get("value") is not None else None


def open_report(
    predict_output: str | os.PathLike | None = None, report_dir: str | os.PathLike | None = None
) -> EvidenceReport | None:
    """The report in ``report_dir``, else in ``predict_output/report`` (``vit-ct report``'s default); None when that
    folder holds no ``report.json`` (:func:`missing_report` says how to make one).

    Raises:
        ValueError: ``report_dir`` was named but holds no report, or its ``report.json`` is not one.
    """
    if report_dir is not None:
        folder = project_path(report_dir)
        if not (folder / REPORT_JSON).is_file():
            raise ValueError(f"report_dir {report_dir}: no {REPORT_JSON} there; expected the --output_dir of"
                             " `vit-ct report`")  # fmt: skip
    elif predict_output is not None:
        folder = project_path(predict_output) / DEFAULT_FOLDER
        if not (folder / REPORT_JSON).is_file():
            return None
    else:
        return None
    try:
        record = json.loads((folder / REPORT_JSON).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{folder / REPORT_JSON} is not JSON ({err}): write the report again") from None
    if not isinstance(record, dict) or "model" not in record:
        raise ValueError(f"{folder / REPORT_JSON} is not a vit-ct report (no 'model'): write the report again")
    figures = {png.stem: png.read_bytes() for png in sorted((folder / FIGURES).glob("*.png"))}
    return EvidenceReport(folder=folder, record=record, figures=figures)


def missing_report(predict_output: str | os.PathLike | None) -> str:
    """One line: the command that writes the report of ``predict_output`` (with its manifest, from ``run.json``)."""
    out = project_path(predict_output) if predict_output is not None else None
    if out is None or not (out / PREDICTIONS.file).is_file():
        return ("no evidence report: `vit-ct report OUT --manifest M` writes OUT/report; set predict_output to OUT"
                " (or report_dir to a report's folder)")  # fmt: skip
    info = json.loads((out / RUN_JSON).read_text()) if (out / RUN_JSON).is_file() else {}
    manifest = info.get("manifest") or "LABELLED.csv"
    return f"no evidence report in {out / DEFAULT_FOLDER}: `vit-ct report {out} --manifest {manifest}` writes it"
