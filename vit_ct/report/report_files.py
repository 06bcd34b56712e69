"""What ``vit-ct report`` writes into its folder: ``report.json``, ``report.html``, the figures as PNG under
``figures/`` and, where temperature scaling was fitted, ``calibration.json``."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

from vit_ct.files import atomic_write
from vit_ct.report.bootstrap import RESAMPLES, SEED
from vit_ct.report.evidence import ModelEvidence, model_evidence
from vit_ct.report.inputs import read_labels, read_predictions
from vit_ct.report.page import report_page
from vit_ct.report.plots import report_figures

REPORT_JSON, REPORT_HTML, CALIBRATION_JSON, FIGURES = "report.json", "report.html", "calibration.json", "figures"
SECTIONS = ("slice", "scan", "maps", "calibration", "subgroups", "worst_cases", "rows")


def check_report_dir(output_dir: Path, *, overwrite: bool) -> None:
    """Refuse a file, or a folder holding anything but an earlier report (``report.json``) unless ``overwrite``."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"--output_dir {output_dir} is a file; expected a folder (absent, empty or an earlier report)")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not (output_dir / REPORT_JSON).is_file() and not overwrite:
        raise ValueError(f"--output_dir {output_dir} holds files that are not a report; choose another folder, or pass"
                         " --overwrite to replace them")  # fmt: skip


def _plain(value):
    """NaN as null: report.json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def report_json(models: list[ModelEvidence], settings: dict) -> dict:
    """The first model's sections at the top, the others under ``compare`` by name."""
    first, *others = models
    record = {"model": first.name, **{k: first.sections[k] for k in SECTIONS}, "settings": settings}
    record["compare"] = {m.name: {k: m.sections[k] for k in SECTIONS} for m in others}
    return _plain(record)


def write_report(
    predictions: str | os.PathLike,
    manifest: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    compare: dict[str, str | os.PathLike] | None = None,
    name: str = "vit-ct",
    split: str | None = None,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    overwrite: bool = False,
) -> Path:
    """Write the report of ``predictions`` (a ``vit-ct predict`` output folder) beside those of ``compare`` (name ->
    a predict folder or any model's predictions CSV) on the labelled ``manifest`` into ``output_dir``.

    Args:
        predictions: The predict output (``predictions.csv``, ``run.json``, ``maps/``, ``overlays/``).
        manifest: The manifest with labels (masks, patient ids, splits, subgroup columns) the slices are listed in.
        output_dir: The report's folder: absent, empty or an earlier report (replaced), else ``overwrite``.
        compare: Other models' predictions, by the name the report gives them.
        name: The name of the first model.
        split: The split reported (``test``, ``val``, ``train``, ``all``); None: the test split where the manifest
            marks one among the predictions, else every labelled slice.
        resamples: Bootstrap replicates.
        seed: The bootstrap's seed.
        overwrite: Replace an ``output_dir`` holding other files.

    Returns:
        ``report.html``'s path.
    """
    output_dir = Path(output_dir)
    check_report_dir(output_dir, overwrite=overwrite)
    if resamples < 1:
        raise ValueError(f"--bootstrap {resamples}: expected a number of replicates >= 1 (1,000 is the default)")
    sources = {name: predictions, **(compare or {})}
    read = {n: read_predictions(path, n) for n, path in sources.items()}
    labels = read_labels(manifest, read[name].info)
    models = [model_evidence(p, labels, split=split, resamples=resamples, seed=seed) for p in read.values()]
    figures = report_figures(models)
    settings = {"bootstrap": {"resamples": resamples, "seed": seed, "unit": "patient", "interval": "percentile 95%"},
                "manifest": str(Path(manifest).resolve()), "predictions": {n: str(Path(p).resolve()) for n, p in
                                                                          sources.items()}}  # fmt: skip
    if output_dir.exists():
        shutil.rmtree(output_dir)
    (output_dir / FIGURES).mkdir(parents=True)
    for file, png in figures.items():
        (output_dir / FIGURES / file).write_bytes(png)
    with atomic_write(output_dir / REPORT_JSON) as tmp:
        tmp.write_text(json.dumps(report_json(models, settings), indent=1) + "\n")
    temperature = models[0].sections["calibration"].get("temperature")
    if temperature:
        with atomic_write(output_dir / CALIBRATION_JSON) as tmp:
            tmp.write_text(json.dumps({"temperature": temperature}) + "\n")
    title = "vit-ct report: " + " beside ".join(m.name for m in models)
    described = (f"{resamples} bootstrap replicates over patients, seed {seed}; manifest {Path(manifest).name};"
                 f" predictions {', '.join(f'{n}: {p}' for n, p in sources.items())}")  # fmt: skip
    with atomic_write(output_dir / REPORT_HTML) as tmp:
        tmp.write_text(report_page(models, figures, title=title, settings=described), encoding="utf-8")
    return output_dir / REPORT_HTML
