"""Do the rollout maps sit on the lesion on every training, or only on a lucky one? The demo recipe trained with several
seeds for each way of removing the attention sink, each scored on the demo test set: classification, localisation,
the sink itself, and deletion / insertion faithfulness beside the other explanations (``benchmarks/faithfulness.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from benchmarks.faithfulness import score_methods
from benchmarks.recording import RECORDS, write_record
from vit_ct.data.transforms.windows import parse_windows
from vit_ct.run.hardware import describe_machine
from vit_ct.task import ViTClassifier
from vit_ct.task.settings import group_of

# Every variant names all four levers, so that changing a default in the code does not change what a row measures.
LEVERS = ("mask_air", "reg_tokens", "attention_loss_weight", "attention_target")
VARIANTS: dict[str, tuple] = {
    "baseline (every patch a key)": (False, 0, 0.0, "rollout"),
    "air masked": (True, 0, 0.0, "rollout"),
    "air masked + 4 registers": (True, 4, 0.0, "rollout"),
    "air masked + class-token attention loss": (True, 0, 1.0, "class_token"),
    "air masked + rollout attention loss (default)": (True, 0, 1.0, "rollout"),
}


def variant_args(variant: str) -> list[str]:
    pairs = zip(LEVERS, VARIANTS[variant], strict=True)
    return [arg for lever, value in pairs for arg in (f"--model.{group_of(lever)}.{lever}", str(value).lower())]


# (column, where the value comes from, higher is better)
TEST_COLUMNS = [
    ("AUROC", "test/auroc", True),
    ("pointing", "test/rollout_pointing", True),
    ("energy ratio", "test/rollout_energy_ratio", True),
    ("pixel AUROC", "test/rollout_pixel_auroc", True),
    ("rollout_air", "test/rollout_air", False),
    ("outside head", "test/rollout_outside_head", False),
]
DELETION_METHODS = ("rollout", "last-block attention", "gradient rollout", "Grad-CAM", "random", "floor: image")

USAGE = """example (the README's table; about 7 min per training on 2 CPU cores without native bf16):
  .venv/bin/python -m benchmarks.maps --out maps.md --first-seed-only "air masked" "air masked + 4 registers" \\
      "air masked + class-token attention loss"

Each (variant, seed) trains `vit-ct fit --config configs/demo.yaml --seed_everything SEED` with the variant's levers
into --root/<variant>/seed<SEED> (skipped when its maps.json exists: rerun to add variants or seeds), tests the best
checkpoint on the demo test set (every test slice; localisation on the lesion slices) and scores deletion / insertion
on --n-slices lesion slices of the test split. The table gives the mean over seeds and, in brackets, the worst seed.
"""


def slug(variant: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", variant).strip("_")


def train(variant: str, seed: int, folder: Path, config: Path) -> dict:
    """Trains one (variant, seed) through the real command and returns its summary (test metrics included)."""
    summary = folder / "summary.json"
    if not summary.exists():
        command = [
            *(sys.executable, "-m", "vit_ct", "fit", "--config", str(config)),
            *("--seed_everything", str(seed), "--trainer.logger", "false", "--trainer.default_root_dir", str(folder)),
            *variant_args(variant),
        ]
        print(f"[{variant} / seed {seed}] {shlex.join(command)}", flush=True)
        subprocess.run(command, check=True)
    return json.loads(summary.read_text())


def score(variant: str, seed: int, folder: Path, config: Path, manifest: Path, n_slices: int) -> dict:
    """One run's numbers (cached in ``maps.json``): test metrics, then deletion / insertion by method."""
    cached = folder / "maps.json"
    if cached.exists():
        return json.loads(cached.read_text())
    start, trained_here = time.perf_counter(), not (folder / "summary.json").exists()
    summary = train(variant, seed, folder, config)
    fit_seconds = time.perf_counter() - start if trained_here else None  # None: a run trained before (reused)
    model = ViTClassifier.load_from_checkpoint(summary["best_checkpoint"], map_location="cpu").eval()
    windows = parse_windows(yaml.safe_load((folder / "config.yaml").read_text())["data"]["init_args"]["windows"])
    rows, _ = score_methods(model, manifest, windows, split="test", n_slices=n_slices, seed=seed)
    result = {
        "variant": variant,
        "seed": seed,
        "fit_seconds": fit_seconds,
        "metrics": summary["metrics"],
        "faithfulness": {row["method"]: row for row in rows},
    }
    cached.write_text(json.dumps(result, indent=2))
    return result


def mean_and_worst(values: list[float], higher_is_better: bool) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    worst = min(values) if higher_is_better else max(values)
    return f"{sum(values) / len(values):.3f} ({worst:.3f})"


def table(results: dict[str, list[dict]]) -> str:
    header = ["variant", "seeds", *(c for c, _, _ in TEST_COLUMNS), "outside-head floor"]
    header += [f"deletion: {m}" for m in DELETION_METHODS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for variant, runs in results.items():
        cells = [variant, str(len(runs))]
        for _, key, higher in TEST_COLUMNS:
            cells.append(mean_and_worst([r["metrics"].get(key, math.nan) for r in runs], higher))
        floor = [r["metrics"].get("test/rollout_outside_head_floor", math.nan) for r in runs]
        cells.append(f"{sum(floor) / len(floor):.3f}")
        for method in DELETION_METHODS:
            cells.append(mean_and_worst([r["faithfulness"][method]["deletion"] for r in runs], False))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, records: Path | None = None) -> str:
    """Train and score every (variant, seed) and print the table; with ``records`` (a folder) also write the record
    ``maps.json`` there."""
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--first-seed-only", nargs="*", default=[], choices=list(VARIANTS), help="variants trained with the first seed"
    )
    parser.add_argument("--config", type=Path, default=Path("configs/demo.yaml"), help="the recipe every run trains")
    parser.add_argument("--manifest", type=Path, default=Path("data/synthetic/manifest.csv"), help="the demo set")
    parser.add_argument("--root", type=Path, default=Path("runs/maps"), help="one folder per (variant, seed)")
    parser.add_argument("--n-slices", type=int, default=64, help="lesion slices of the deletion / insertion curves")
    parser.add_argument("--out", type=Path, help="also write the table to this .md file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(torch.get_num_threads())  # the fits run as child processes; scoring runs here
    results: dict[str, list[dict]] = {}
    for variant in args.variants:
        for seed in args.seeds[:1] if variant in args.first_seed_only else args.seeds:
            folder = args.root / slug(variant) / f"seed{seed}"
            results.setdefault(variant, []).append(
                score(variant, seed, folder, args.config, args.manifest, args.n_slices)
            )
    fits = [r["fit_seconds"] for runs in results.values() for r in runs if r["fit_seconds"] is not None]
    command = shlex.join(["python", "benchmarks/maps.py", *(sys.argv[1:] if argv is None else argv)])
    report = "\n".join(
        [
            table(results),
            "",
            f"Demo test set ({args.config}); mean over the seeds (of {args.seeds}), worst seed in brackets."
            " Deletion: area under P(lesion) as patches are replaced by normal brain in the map's order"
            f" ({args.n_slices} lesion slices; lower is better). Outside head: the share of the upsampled rollout"
            " outside the head's pixels, beside the floor of a perfect patch-level map.",
            f"`{command}` on {describe_machine()}; {time.perf_counter() - start:.0f} s here, fits"
            f" {sum(fits) / max(len(fits), 1):.0f} s each when run.",
        ]
    )
    print(report)
    if args.out:
        args.out.write_text(report + "\n")
    if records is not None:
        lines = table(results).splitlines()
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
        columns = [c.strip() for c in lines[0].strip("|").split("|")]
        figures = {f"{slug(variant)}_{key.split('/')[-1]}": [r["metrics"].get(key) for r in runs]
                   for variant, runs in results.items() for _, key, _ in TEST_COLUMNS}  # fmt: skip
        notes = {"seeds": args.seeds, "config": str(args.config), "n_slices": args.n_slices,
                 "fit_seconds": sum(fits) / max(len(fits), 1)}  # fmt: skip
        write_record("maps", figures, command=command, tables={"maps": {"columns": columns, "formats": [None] *
                     len(columns), "rows": rows}}, seconds=time.perf_counter() - start, notes=notes,
                     folder=records)  # fmt: skip
    return report


if __name__ == "__main__":
    main(records=RECORDS)
