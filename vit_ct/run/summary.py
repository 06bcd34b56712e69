"""What the last ``vit-ct fit`` left behind, for scripts and ``make demo``: ``python -m vit_ct.run.summary KEY`` prints
one value of ``runs/latest/summary.json``; ``python -m vit_ct.run.summary report OUT`` prints where everything is.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from vit_ct.metrics.schema import PREDICTIONS, SCANS
from vit_ct.run.console import counted

LATEST_SUMMARY = Path("runs/latest/summary.json")  # from the project folder, where `make demo` runs
# metrics.localisation's, without torch
MAP_SOURCES = ("rollout", "floor_image", "floor_head", "perfect_patch", "perfect_grid")
LOCALISATION = ("pointing", "energy", "mask_fraction", "energy_ratio", "pixel_auroc", "dice", "hd95_mm")
# The figures of a stage, in the order a reader looks for them: the decision first, then the maps' scores (and
# `slices`, the number of lesion slices they were scored on); every other figure follows on as few lines as it takes.
HEADLINE = ("auroc", "accuracy", "sensitivity", "specificity", "f1", "scan_auroc", "loss")
MAP_SCORES = (*LOCALISATION[:6], "iou", "hd95_mm", "hd95_px", "slices")
LINE_WIDTH = 118
UNDEFINED_WHY = (
    "the scored slices hold no slice label, or one class only (a split without a bleed; scan labels label only the"
    " slices of scans without a lesion)"
)


def kept_checkpoint(checkpoint) -> str:
    """What the checkpoint a fit keeps is: ``final weights`` (``checkpoint.monitor: null``, the demo's and the
    fine-tune's rule: the last epoch's) or ``best <monitor> (<mode>)``, the epoch of the best monitored figure."""
    monitor = getattr(checkpoint, "monitor", None)
    return "final weights" if monitor is None else f"best {monitor} ({getattr(checkpoint, 'mode', 'max')})"


def checkpoint_label(summary: dict) -> str:
    """``final weights`` or ``best checkpoint``, from ``summary.json``'s ``kept_checkpoint`` (runs written before it
    was recorded: ``best checkpoint``)."""
    return "final weights" if summary.get("kept_checkpoint") == "final weights" else "best checkpoint"


def metric_lines(metrics: dict[str, float], stage: str) -> list[str]:
    """Every ``<stage>/...`` figure of ``metrics`` once, compactly: the headline scores on one line, the maps' scores
    as a table (map x score), the rest packed into lines of at most :data:`LINE_WIDTH` characters."""
    figures = {k.removeprefix(f"{stage}/"): v for k, v in metrics.items() if k.startswith(f"{stage}/")}
    if not figures:
        return []
    undefined = [name for name in HEADLINE if name in figures and math.isnan(figures[name])]
    head = [name for name in HEADLINE if name in figures and name not in undefined]
    lines = [f"{stage:<5} " + "  ".join(f"{name} {figures[name]:.4f}" for name in head)]
    if undefined:  # said, not printed as a measured 0 or a bare nan
        lines.append(f"  undefined here (logged as NaN): {', '.join(undefined)}: {UNDEFINED_WHY}")
    shown = set(head) | set(undefined)
    sources = [s for s in MAP_SOURCES if any(f"{s}_{score}" in figures for score in MAP_SCORES)]
    scores = [score for score in MAP_SCORES if any(f"{s}_{score}" in figures for s in sources)]
    if sources:
        widths = [max(len(score), 8) + 2 for score in scores]  # values: 8 characters at most (`100.8016`)
        lines.append(f"  {'map':<14}" + "".join(f"{score:>{w}}" for score, w in zip(scores, widths, strict=True)))
        for source in sources:
            cells = [_cell(score, figures.get(f"{source}_{score}")) for score in scores]
            lines.append(f"  {source:<14}" + "".join(f"{cell:>{w}}" for cell, w in zip(cells, widths, strict=True)))
            shown |= {f"{source}_{score}" for score in scores}
    line = ""
    for name in sorted(set(figures) - shown):
        item = f"  {name} {_number(name, figures[name])}"
        if line and len(line) + len(item) > LINE_WIDTH:
            lines.append(line)
            line = ""
        line += item
    return lines + ([line] if line else [])


def _cell(score: str, value: float | None) -> str:
    return "-" if value is None else _number(score, value)


def _number(name: str, value: float) -> str:
    return f"{value:.0f}" if name.endswith("slices") else f"{value:.4f}"  # `slices`: counts


def read_summary(path: str | Path = LATEST_SUMMARY) -> dict:
    """The run summary written after ``fit`` (checkpoint paths, run and W&B folders, final metrics)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} does not exist: run `vit-ct fit` (or `make demo`) first")
    return json.loads(path.read_text())


def report(output_dir: str | Path, summary: dict) -> str:
    """Plain-text report of a demo: where the files are and the test figures, localisation beside its floors."""
    import pandas as pd  # here: `python -m vit_ct.run.summary KEY` (make demo's) answers without it

    metrics = summary.get("metrics", {})
    output_dir = Path(output_dir)
    lines = [
        "",
        "vit-ct demo: done",
        f"  {checkpoint_label(summary):<17} {summary.get('best_checkpoint')}",
        f"  run folder        {summary.get('run_dir')}  (config.yaml, summary.json)",
        f"  W&B run (offline) {summary.get('wandb_dir')}",
        f"  trained on        {summary.get('machine')}, precision {summary.get('precision')}",
        f"  predictions       {output_dir / PREDICTIONS.file}  (maps/*.npy, overlays/*.png)",
    ]
    if (output_dir / PREDICTIONS.file).is_file():
        lines[-1] += f": {counted(len(pd.read_csv(output_dir / PREDICTIONS.file)), 'slice')}"
    if (output_dir / SCANS.file).is_file():
        n_scans = len(pd.read_csv(output_dir / SCANS.file))
        nifti = "(scans/*_ct.nii.gz, *_rollout.nii.gz)"
        lines.append(f"  scans             {output_dir / SCANS.file}  {nifti}: {counted(n_scans, 'scan')}")
    names = ("auroc", "accuracy", "sensitivity", "specificity", "scan_auroc")
    lines.append("  test  " + "  ".join(f"{n} {metrics[f'test/{n}']:.3f}" for n in names if f"test/{n}" in metrics))
    if "test/rollout_pointing" in metrics:
        tolerance = summary.get("localisation_tolerance_mm")
        tolerance = f"{tolerance:g} mm" if tolerance is not None else "see config.yaml"
        lines.append(f"  localisation on test slices with a lesion (pointing tolerance {tolerance}):")
        lines.append(f"    {'map':<14}" + "".join(f"{n:>15}" for n in LOCALISATION))
        for source in (s for s in MAP_SOURCES if f"test/{s}_pointing" in metrics):  # perfect_grid: shifted maps
            values = [metrics.get(f"test/{source}_{n}", float("nan")) for n in LOCALISATION]
            lines.append(f"    {source:<14}" + "".join(f"{v:>15.3f}" for v in values))
    if "test/rollout_air" in metrics:
        sink = f"  attention sink: rollout on air patches {metrics['test/rollout_air']:.1%}"
        if "test/rollout_outside_head" in metrics:
            sink += (
                f"; outside the head {metrics['test/rollout_outside_head']:.1%}"
                f" (a perfect patch-level map: {metrics.get('test/rollout_outside_head_floor', float('nan')):.1%})"
            )
        lines.append(sink)
    lines += [
        "  review the maps   .venv/bin/jupyter lab notebooks/attention_review.ipynb",
        "                    (headless: .venv/bin/python -m vit_ct.review -> outputs/review/)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "report":
        print(report(args[1], read_summary()))
    elif len(args) == 1:
        value = read_summary().get(args[0])
        if value is None:
            raise SystemExit(f"{LATEST_SUMMARY} has no {args[0]!r}")
        print(value)
    else:
        raise SystemExit("usage: python -m vit_ct.run.summary KEY | report OUTPUT_DIR")


if __name__ == "__main__":
    main()
