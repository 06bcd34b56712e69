"""What ``vit-ct report`` writes into its folder: ``report.json``, ``report.html``, the figures as PNG under
``figures/`` and, where temperature scaling was fitted, ``calibration.json``."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

from vit_ct.files import check_replaceable, record_output, remove_leftovers, replace_folder, staging_folder
from vit_ct.report.bootstrap import RESAMPLES, SEED
from vit_ct.report.evidence import ModelEvidence, model_evidence
from vit_ct.report.inputs import has_in_scan, read_labels, read_predictions
from vit_ct.report.map_sanity import (
    SANITY_SLICES,
    checked_map_note,
    load_checkpoint,
    sanity_checks,
    sanity_figures,
    sanity_section,
)
from vit_ct.report.page import report_page
from vit_ct.report.plots import report_figures
from vit_ct.task.settings import Maps

REPORT_JSON, REPORT_HTML, CALIBRATION_JSON, FIGURES = "report.json", "report.html", "calibration.json", "figures"
SECTIONS = ("slice", "scan", "maps", "calibration", "decision_curve", "subgroups", "worst_cases", "rows")
SANITY = "sanity"  # report.json's model-randomisation check (--ckpt_path); null without a checkpoint


REPORT = "report"  # the command, as the report folder's output record names it


def check_report_dir(output_dir: Path, *, overwrite: bool, inputs: list[str | os.PathLike]) -> None:
    """Refuse a file, a folder holding a file that is not part of an earlier report (a predict output, the folder
    above one), or an earlier report unless ``overwrite`` (:func:`vit_ct.files.check_replaceable`); and an
    ``output_dir`` that is one of the report's ``inputs`` or holds one."""
    for path in map(Path, inputs):
        if path.resolve() == output_dir.resolve() or path.resolve().is_relative_to(output_dir.resolve()):
            raise ValueError(f"--output_dir {output_dir} holds {path}, which the report reads; choose another"
                             " --output_dir (the default is OUT/report)")  # fmt: skip
    check_replaceable(output_dir, REPORT, overwrite=overwrite)


def _plain(value):
    """NaN as null: report.json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def report_json(models: list[ModelEvidence], settings: dict, sanity: dict | None = None) -> dict:
    """The first model's sections at the top (and its map ``sanity`` check), the others under ``compare`` by name."""
    first, *others = models
    record = {"model": first.name, **{k: first.sections[k] for k in SECTIONS}, SANITY: sanity, "settings": settings}
    record["compare"] = {m.name: {k: m.sections[k] for k in SECTIONS} for m in others}
    return _plain(record)


def default_tolerance_mm() -> float:
    """:class:`vit_ct.ViTClassifier`'s default pointing tolerance (its `Maps`), the floors' without a checkpoint."""
    return float(Maps().localisation_tolerance_mm)


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
    ckpt_path: str | os.PathLike | None = None,
    sanity_slices: int = SANITY_SLICES,
) -> Path:
    """Write the report of ``predictions`` (a ``vit-ct predict`` output folder) beside those of ``compare`` (name ->
    a predict folder or any model's predictions CSV) on the labelled ``manifest`` into ``output_dir``.

    Args:
        predictions: The predict output (``predictions.csv``, ``run.json``, ``maps/``, ``overlays/``).
        manifest: The manifest with labels (masks, patient ids, splits, subgroup columns) the slices are listed in.
        output_dir: The report's folder: absent, empty, or an earlier report replaced with ``overwrite``; a folder
            holding any other file is refused, as is one holding an input of the report.
        compare: Other models' predictions, by the name the report gives them.
        name: The name of the first model.
        split: The split reported (``test``, ``val``, ``train``, ``all``); None: the test split where the manifest
            marks one among the predictions, else every labelled slice.
        resamples: Bootstrap replicates.
        seed: The bootstrap's seed.
        overwrite: Replace an earlier report in ``output_dir`` (once the new one is complete).
        ckpt_path: The checkpoint ``predictions`` were made with: adds the maps' model-randomisation check
            (:mod:`vit_ct.report.map_sanity`) and gives the floors' pointing tolerance; None: neither (the
            tolerance is ViTClassifier's default).
        sanity_slices: Slices the check runs on, the reported split's first.

    Returns:
        ``report.html``'s path.
    """
    output_dir = Path(output_dir)
    sources = {name: predictions, **(compare or {})}
    inputs = [*sources.values(), manifest, *([ckpt_path] if ckpt_path is not None else [])]
    check_report_dir(output_dir, overwrite=overwrite, inputs=inputs)
    if resamples < 1:
        raise ValueError(f"--bootstrap {resamples}: expected a number of replicates >= 1 (1,000 is the default)")
    if sanity_slices < 2:
        raise ValueError(f"--sanity_slices {sanity_slices}: expected at least 2 (a rank correlation per slice)")
    read = {n: read_predictions(path, n) for n, path in sources.items()}
    in_scan = f"{name} in scan"  # a sequence head: the slices read in their scans, reported as a model of its own
    if has_in_scan(read[name]) and in_scan not in read:
        read = {name: read[name], in_scan: read_predictions(predictions, in_scan, in_scan=True), **read}
        sources = {name: predictions, in_scan: predictions, **sources}
    labels = read_labels(manifest, read[name].info)
    model, checkpoint = load_checkpoint(ckpt_path) if ckpt_path is not None else (None, None)  # before the long part
    tolerance = default_tolerance_mm() if model is None else float(model.hparams.localisation_tolerance_mm)
    models = [model_evidence(p, labels, split=split, resamples=resamples, seed=seed, tolerance_mm=tolerance)
              for p in read.values()]  # fmt: skip
    figures = report_figures(models)
    sanity, checks = None, {}
    if model is not None:
        reported = models[0].sections["rows"]["split"]
        checks = sanity_checks(model, checkpoint, manifest, split=reported, slices=sanity_slices, seed=seed)
        checked = checked_map_note(read[name].table.columns)
        sanity = sanity_section(checks, {"ckpt_path": str(checkpoint), "split": reported, "slices": sanity_slices,
                                         "seed": seed, "checked": checked})  # fmt: skip
        figures |= sanity_figures(checks)
    settings = {"bootstrap": {"resamples": resamples, "seed": seed, "unit": "patient", "interval": "percentile 95%"},
                "manifest": str(Path(manifest).resolve()), "predictions": {n: str(Path(p).resolve()) for n, p in
                                                                          sources.items()},
                "floor_tolerance_mm": tolerance}  # fmt: skip
    title = "vit-ct report: " + " beside ".join(m.name for m in models)
    described = (f"{resamples} bootstrap replicates over patients, seed {seed}; manifest {Path(manifest).name};"
                 f" predictions {', '.join(f'{n}: {p}' for n, p in sources.items())}")  # fmt: skip
    page = report_page(models, figures, title=title, settings=described, sanity=sanity)
    # written beside the folder and swapped in whole: an earlier report stays as it was until the new one is complete
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(output_dir.parent)
    staged = staging_folder(output_dir)
    try:
        (staged / FIGURES).mkdir(parents=True)
        for file, png in figures.items():
            (staged / FIGURES / file).write_bytes(png)
        (staged / REPORT_JSON).write_text(json.dumps(report_json(models, settings, sanity), indent=1) + "\n")
        temperature = models[0].sections["calibration"].get("temperature")
        if temperature:
            (staged / CALIBRATION_JSON).write_text(json.dumps({"temperature": temperature}) + "\n")
        (staged / REPORT_HTML).write_text(page, encoding="utf-8")
        record_output(staged, REPORT)
        check_report_dir(output_dir, overwrite=overwrite, inputs=inputs)  # again: it may have changed meanwhile
        replace_folder(staged, output_dir)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return output_dir / REPORT_HTML
