"""What the last ``vit-ct fit`` left behind, for scripts and ``make demo``: ``python -m vit_ct.run.summary KEY`` prints
one value of ``runs/latest/summary.json``; ``python -m vit_ct.run.summary report OUT`` prints where everything is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from vit_ct.run.runs import LATEST_SUMMARY

LOCALISATION = ("pointing", "energy", "mask_fraction", "energy_ratio", "pixel_auroc", "dice", "hd95_mm")


def read_summary(path: str | Path = LATEST_SUMMARY) -> dict:
    """The run summary written after ``fit`` (checkpoint paths, run and W&B folders, final metrics)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} does not exist: run `vit-ct fit` (or `make demo`) first")
    return json.loads(path.read_text())


def report(output_dir: str | Path, summary: dict) -> str:
    """Plain-text report of a demo: where the files are and the test figures, localisation beside its floors."""
    metrics = summary.get("metrics", {})
    output_dir = Path(output_dir)
    lines = [
        "",
        "vit-ct demo: done",
        f"  best checkpoint   {summary.get('best_checkpoint')}",
        f"  run folder        {summary.get('run_dir')}  (config.yaml, summary.json)",
        f"  W&B run (offline) {summary.get('wandb_dir')}",
        f"  trained on        {summary.get('machine')}, precision {summary.get('precision')}",
        f"  predictions       {output_dir / 'predictions.csv'}  (maps/*.npy, overlays/*.png)",
    ]
    if (output_dir / "predictions.csv").is_file():
        lines[-1] += f": {len(pd.read_csv(output_dir / 'predictions.csv'))} slices"
    if (output_dir / "scans.csv").is_file():
        n_scans = len(pd.read_csv(output_dir / "scans.csv"))
        nifti = "(scans/*_ct.nii.gz, *_rollout.nii.gz)"
        lines.append(f"  scans             {output_dir / 'scans.csv'}  {nifti}: {n_scans} scans")
    names = ("auroc", "accuracy", "sensitivity", "specificity", "scan_auroc")
    lines.append("  test  " + "  ".join(f"{n} {metrics[f'test/{n}']:.3f}" for n in names if f"test/{n}" in metrics))
    if "test/rollout_pointing" in metrics:
        tolerance = summary.get("localisation_tolerance_mm")
        tolerance = f"{tolerance:g} mm" if tolerance is not None else "see config.yaml"
        lines.append(f"  localisation on test slices with a lesion (pointing tolerance {tolerance}):")
        lines.append(f"    {'map':<14}" + "".join(f"{n:>15}" for n in LOCALISATION))
        for source in ("rollout", "floor_image", "floor_head", "perfect_patch"):
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
