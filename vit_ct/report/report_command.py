"""``vit-ct report OUT --manifest LABELLED.csv``: the evidence a paper or a hospital asks for, from a ``vit-ct
predict`` output and the manifest's labels, without the model: detection per slice and scan, calibration, the maps
against the lesion masks, subgroups and the worst cases, each figure with a 95% interval over patients; other models'
predictions in the same columns beside it (``--compare NAME=PATH``).

Standard library only until the arguments are checked: ``vit-ct report --help`` answers without torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

RESAMPLES, SEED = 1000, 0  # vit_ct.report.bootstrap's, restated for --help (tests/test_report.py checks them equal)
SANITY_SLICES = 16  # vit_ct.report.map_sanity's, restated for --help (tests/test_report_sanity.py checks them equal)
SPLITS = ("test", "val", "train", "all")


def report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vit-ct report",
        description="Write REPORT/report.html (self-contained, opens offline), REPORT/report.json and the figures as"
        " PNG from a vit-ct predict output and the labelled manifest it was made from: AUROC, average precision,"
        " sensitivity and specificity (at 0.5 and at 90%% and 95%% specificity) per slice and per scan, calibration"
        " (ECE, Brier, reliability; temperature scaling fitted on predicted validation slices), the maps' scores"
        " against lesion masks, subgroups and the worst cases, each with a 95%% bootstrap interval over patients.",
    )
    parser.add_argument("predictions", metavar="OUT", help="the folder `vit-ct predict --output_dir` wrote")
    parser.add_argument("--manifest", required=True, help="the manifest CSV with labels (and masks, patient_id, split,"
                        " subgroup columns) the predicted slices are listed in")  # fmt: skip
    parser.add_argument("--output_dir", help="the report's folder (default OUT/report): new or empty, or an earlier"
                        " report to replace with --overwrite")  # fmt: skip
    parser.add_argument("--compare", action="append", default=[], metavar="NAME=PATH", help="another model's"
                        " predictions beside vit-ct's: a predict output folder, or a CSV with columns image and prob"
                        " (P(lesion)), optionally slice, overlay and map score columns; repeat for more")  # fmt: skip
    parser.add_argument("--name", default="vit-ct", help="the name OUT's model has in the report (default vit-ct)")
    parser.add_argument("--split", choices=SPLITS, help="the split reported (default: test where the manifest marks"
                        " test slices among the predictions, else all labelled slices)")  # fmt: skip
    parser.add_argument("--bootstrap", type=int, default=RESAMPLES, metavar="N", help="bootstrap replicates over"
                        f" patients (default {RESAMPLES})")  # fmt: skip
    parser.add_argument("--seed", type=int, default=SEED, help=f"the bootstrap's seed (default {SEED})")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier report in --output_dir, once the"
                        " new one is complete (a folder holding any other file is never replaced)")  # fmt: skip
    parser.add_argument("--wandb", metavar="RUN", help="also log the figures, the figures table and the headline values"
                        " into the W&B run of the `vit-ct fit` run folder RUN (e.g. runs/latest), resumed by its id;"
                        " offline unless W&B is configured")  # fmt: skip
    parser.add_argument("--ckpt_path", metavar="CKPT", help="the checkpoint OUT was predicted with: adds the maps'"
                        " model-randomisation sanity check (Adebayo et al. 2018): the attention rollout against the"
                        " image as a map, each through the model's parts re-initialised top down")  # fmt: skip
    parser.add_argument("--sanity_slices", type=int, default=SANITY_SLICES, metavar="N", help="slices the"
                        " sanity check runs on, the reported split's first in manifest order (default"
                        f" {SANITY_SLICES})")  # fmt: skip
    return parser


def parse_compare(parser: argparse.ArgumentParser, values: list[str], name: str) -> dict[str, str]:
    """``NAME=PATH`` pairs, names unique and not the first model's."""
    out: dict[str, str] = {}
    for value in values:
        label, sep, path = value.partition("=")
        if not sep or not label or not path:
            parser.exit(2, f"vit-ct report: --compare {value!r}: expected NAME=PATH, e.g. --compare cnn=cnn_out\n")
        if label in out or label == name:
            parser.exit(2, f"vit-ct report: --compare {label!r} names a model twice; give each its own NAME\n")
        out[label] = path
    return out


def main(argv: list[str] | None = None) -> None:
    parser = report_parser()
    args = parser.parse_args(argv)
    compare = parse_compare(parser, args.compare, args.name)
    output_dir = Path(args.output_dir) if args.output_dir else Path(args.predictions) / "report"
    from vit_ct.report.report_files import write_report  # here: --help answers without torch
    from vit_ct.report.wandb_log import fit_run, log_report

    try:
        wandb_run = fit_run(args.wandb) if args.wandb else None  # a bad RUN stops before the report is computed
        page = write_report(
            args.predictions,
            args.manifest,
            output_dir,
            compare=compare,
            name=args.name,
            split=args.split,
            resamples=args.bootstrap,
            seed=args.seed,
            overwrite=args.overwrite,
            ckpt_path=args.ckpt_path,
            sanity_slices=args.sanity_slices,
        )
        logged = log_report(page.parent, wandb_run) if wandb_run else None
    except (ValueError, OSError) as err:  # a missing column, a folder that is no predict output: the message names it
        parser.exit(2, f"vit-ct report: {err}\n")
    print(f"report written: {page} (and report.json, figures/ beside it)")
    if logged:
        print(f"logged into W&B run {wandb_run.run_id} of {args.wandb}: {logged}")
