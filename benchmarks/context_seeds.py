"""How much of a row of :mod:`benchmarks.context` is the training seed's? The same scan set, the same commands
(``vit-ct fit --config configs/finetune.yaml``, then ``vit-ct predict`` on the test patients), each row fitted once per
training seed (``--seed_everything``: the fine-tuning's initialisation of new parts, the order of its batches, its
augmentation draws); the set, its split and the test patients stay the same. Seed 0 is the recipe's own
(``seed_everything: 0``), so its row repeats the one :mod:`benchmarks.context` recorded: a check that a run
reproduces.

    python -m benchmarks.context_seeds --patients 200 --split 0.35 0.075 0.575    # the record context_weights_seeds
    python -m benchmarks.context_seeds --rows alone transformer --seeds 0 1    # other rows and seeds

Scored as there: slice AUROC with its 95% interval from resampling patients, scan AUROC, pointing and Dice of the
maps; per row the mean and the standard deviation over the seeds (``ddof=1``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.context import FAMILY_SEEDS, ROWS, run_row, scan_labels_only, scan_set
from benchmarks.recording import command_line, git_state, table, write_record

SCORES = ("auroc", "scan_auroc", "pointing", "dice")


def spread(results: list[dict]) -> dict[str, float]:
    """Each score's mean (``auroc``...) and standard deviation (``auroc_sd``..., from two seeds on) over ``results``,
    one row's seeds."""
    out = {}
    for key in SCORES:
        values = np.array([r[key] for r in results], dtype=float)
        out[key] = float(values.mean())
        if len(values) > 1:
            out[f"{key}_sd"] = float(values.std(ddof=1))
    return out


def main(argv: list[str] | None = None, records: Path | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.context_seeds", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--patients", type=int, default=100, help="patients of the scan set (default 100)")
    parser.add_argument("--slices", type=int, default=12, help="slices per scan (default 12)")
    parser.add_argument("--spacing_mm", type=float, default=5.0, help="distance between slices (default 5)")
    parser.add_argument(
        "--split",
        type=float,
        nargs=3,
        default=(0.7, 0.15, 0.15),
        metavar=("TRAIN", "VAL", "TEST"),
        help="shares of the patients in train, validation and test (default 0.7 0.15 0.15)",
    )
    parser.add_argument(
        "--labels",
        choices=("slice", "scan"),
        default="slice",
        help="what the fits learn from: a label per slice (default) or one per scan",
    )
    parser.add_argument(
        "--family",
        choices=list(FAMILY_SEEDS),
        default="cohort",
        help="the scans' scanner: the cohort's ranges (default) or a held-out family's (near, far)",
    )
    parser.add_argument("--epochs", type=int, default=20, help="fine-tuning epochs (default 20, the recipe's)")
    parser.add_argument("--folder", type=Path, help="where the runs go (default /tmp/vit-ct-context[-FAMILY])")
    parser.add_argument("--num_workers", type=int, default=2, help="processes writing the scan set")
    parser.add_argument(
        "--rows",
        nargs="+",
        choices=list(ROWS),
        default=["scan_weights"],
        help="the rows of benchmarks.context to repeat (default scan_weights)",
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (default 0 1 2; 0 is the recipe's)"
    )
    parser.add_argument("--record", help="the record's name (default context[_FAMILY][_scans]_weights_seeds, or"
                        " context[...]_seeds when --rows is not scan_weights alone)")  # fmt: skip
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds: each seed once (got {args.seeds})")
    family = "" if args.family == "cohort" else f"_{args.family}"
    folder = args.folder or Path("/tmp/vit-ct-context" + family.replace("_", "-"))
    git, start = git_state(), time.perf_counter()
    manifest = scan_set(folder, args.patients, args.slices, args.spacing_mm, args.num_workers, tuple(args.split),
                        args.family)  # fmt: skip
    scans = args.labels == "scan"
    fit_manifest, labels = (scan_labels_only(manifest), "_scans") if scans else (None, "")
    results = {
        name: [run_row(name, [*ROWS[name][1], "--seed_everything", str(seed)], manifest, folder, args.epochs,
                       fit_manifest, f"{labels}_seed{seed}") | {"seed": seed} for seed in args.seeds]
        for name in args.rows
    }  # fmt: skip
    rows, figures = [], {}
    for name, runs in results.items():
        rows += [[r["row"], r["seed"], r["auroc"], f"{r['low']:.3f}-{r['high']:.3f}", r["scan_auroc"], r["pointing"],
                  r["dice"]] for r in runs]  # fmt: skip
        summary = spread(runs)
        sd = f"sd {summary['auroc_sd']:.3f}" if "auroc_sd" in summary else None
        rows.append([runs[0]["row"], f"mean of {len(runs)}", summary["auroc"], sd, summary["scan_auroc"],
                     summary["pointing"], summary["dice"]])  # fmt: skip
        figures |= {f"{key}_{name}": value for key, value in summary.items()}
        figures |= {f"{key}_{name}_seed{r['seed']}": r[key] for r in runs for key in SCORES}
    columns = ["input", "seed", "slice AUROC", "95% CI (patients)", "scan AUROC", "pointing", "Dice at half max"]
    notes = {
        "set": f"{args.patients} simulated scans x {args.slices} slices {args.spacing_mm:g} mm apart (seed"
        f" {FAMILY_SEEDS[args.family]}{'' if args.family == 'cohort' else ', the held-out family ' + args.family}),"
        f" split by patient {'/'.join(f'{100 * share:g}' for share in args.split)} (train/validation/test); train"
        " and validation rows without masks" + ("; trained from one label per scan" if scans else ""),
        "seeds": "--seed_everything of each fit; the set, its split and the test patients the same for every seed",
        "results": results,
    }
    rows_name = "_weights" if args.rows == ["scan_weights"] else ""
    name = args.record or f"context{family}{labels}{rows_name}_seeds"
    path = write_record(name, figures, command=command_line("benchmarks.context_seeds", argv),
                        tables={"seeds": table(columns, rows, [None, None, ".3f", None, ".3f", ".2f", ".2f"])},
                        seconds=time.perf_counter() - start, notes=notes, git=git,
                        **({"folder": records} if records else {}))  # fmt: skip
    print(json.dumps(figures, indent=1))
    return path


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
