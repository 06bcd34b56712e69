"""``python -m vit_ct.review.sanity_command CKPT --manifest M.csv --output_dir DIR``: the model-randomisation sanity
check (Adebayo et al. 2018, :mod:`vit_ct.explain.sanity`) of a checkpoint's attention rollout on some slices of a
manifest, written as ``sanity.json`` (the numbers per step and the verdict) and ``sanity.png`` (the paper's figure)."""

from __future__ import annotations

import argparse
import json
import os
from functools import partial
from pathlib import Path

from vit_ct.explain.sanity import RandomisationCheck, rollout_map
from vit_ct.files import atomic_write
from vit_ct.inspection.loading import REVIEW_READING, load_review
from vit_ct.inspection.map_check import check_map, sanity_slices


def write_check(check: RandomisationCheck, output_dir: str | os.PathLike, info: dict) -> tuple[Path, Path]:
    """``output_dir/sanity.json`` (``info`` and the check's numbers) and ``output_dir/sanity.png``."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_write(folder / "sanity.json") as tmp:
        tmp.write_text(json.dumps({**info, **check.to_dict()}, indent=2) + "\n")
    with atomic_write(folder / "sanity.png") as tmp:
        check.figure().savefig(tmp, dpi=120, format="png")
    return folder / "sanity.json", folder / "sanity.png"


def main(argv: list[str] | None = None) -> RandomisationCheck:
    """Run the model-randomisation check of a checkpoint's rollout and print the verdict."""
    parser = argparse.ArgumentParser(prog="python -m vit_ct.review.sanity_command", description=__doc__)
    parser.add_argument("ckpt_path", help="vit-ct checkpoint")
    parser.add_argument("--manifest", required=True, help="manifest CSV (see the README)")
    parser.add_argument("--output_dir", required=True, help="folder for sanity.json and sanity.png")
    parser.add_argument("--split", default="test", help="train, val, test, or all (default: test)")
    parser.add_argument("--slices", type=int, default=16, help="slices checked, the split's first (default: 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the re-initialisation (default: 0)")
    args = parser.parse_args(argv)
    if args.slices < 2:
        parser.error(f"--slices must be at least 2, got {args.slices}")
    split = None if args.split == "all" else args.split
    try:
        model, datamodule = load_review(args.ckpt_path, args.manifest, split=split)
    except ValueError as err:  # a missing or unreadable checkpoint or manifest: the message names it
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    slices = sanity_slices(model, datamodule, args.slices)
    check = check_map(
        model, slices, partial(rollout_map, reading=REVIEW_READING), seed=args.seed
    )  # as the review reads
    info = {"ckpt_path": str(args.ckpt_path), "manifest": str(args.manifest), "split": args.split, "seed": args.seed}
    json_path, png_path = write_check(check, args.output_dir, info)
    summary = check.to_dict()
    last = summary["steps"][-1]
    print(f"{summary['method']}: {summary['verdict']} on {summary['slices']} slices (fully randomised: mean rank "
          f"correlation {last['spearman_mean']:.2f}, maxima moved {last['moved']:.0%}; changed from step "
          f"{summary['first_changed']}); written {json_path} and {png_path}")  # fmt: skip
    return check


if __name__ == "__main__":
    main()
