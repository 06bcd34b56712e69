"""The model-randomisation sanity check (Adebayo et al. 2018, :mod:`vit_ct.explain.sanity`) of the shipped weights'
maps on simulated head CT: attention rollout and gradient rollout (Chefer et al. 2021) against two maps that read no
weight (the image's first window, the head mask), each compared inside the head, top down through the cascade. Run as
a script it writes its record (``benchmarks/records/map_sanity.json``) and the paper's figure of the rollout.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.recording import RECORDS, command_line, table, write_record
from vit_ct.data.transforms.model_input import apply_windows, grid_hu
from vit_ct.explain.maps import explain_gradient_rollout
from vit_ct.explain.sanity import RandomisationCheck, image_map, model_randomisation, rollout_map
from vit_ct.model import shipped
from vit_ct.run.hardware import describe_machine
from vit_ct.sim.cohort import simulate_cohort_patient
from vit_ct.task import ViTClassifier

USAGE = """example (~2 min on 2 CPU cores):
  .venv/bin/python -m benchmarks.map_sanity --patients 6 --figure docs/map_sanity.png

The slices are the card test set's first patients (vit_ct.sim.pretraining with the card's seed and slices per
patient), simulated in memory and read as the weights read them.
"""
METHODS = {
    "rollout": rollout_map,
    "gradient rollout": lambda network, images: explain_gradient_rollout(network, images, target=1),
    "floor: image": image_map,
}


def card_slices(tag: str, model: ViTClassifier, patients: int) -> dict[str, torch.Tensor]:
    """The first ``patients`` of the card test set of ``tag`` as ``model`` reads them: ``image``, ``head``, label."""
    spec = shipped.card(tag)["card_test"]
    slices = [s for i in range(patients) for s in simulate_cohort_patient(spec["seed"], i, spec["slices_per_patient"])]
    contract = model.input_contract
    hu = torch.stack([grid_hu(s.hu, contract.img_size) for s in slices])
    batch = apply_windows({"hu": hu}, contract.windows)
    return {"image": batch["image"], "head": batch["head"], "label": torch.tensor([s.label for s in slices])}


def measure(tag: str, patients: int, *, seed: int = 0) -> dict[str, RandomisationCheck]:
    """The check of each of ``METHODS`` on the shipped weights ``tag``, and of the head mask as a map."""
    model = ViTClassifier.from_hparams(pretrained=tag).eval()
    batch = card_slices(tag, model, patients)
    examples = (batch["label"] > 0).nonzero()[:2, 0].tolist() or [0, 1]
    methods = {**METHODS, "floor: head": lambda network, images: batch["head"][:, 0]}
    return {
        # one pass over all the slices: the head floor's map is the batch's own head mask
        name: model_randomisation(
            model,
            batch["image"],
            map_fn,
            region=batch["head"],
            seed=seed,
            examples=examples,
            batch_size=len(batch["image"]),
            method=name,
        )  # fmt: skip
        for name, map_fn in methods.items()
    }


def record_table(checks: dict[str, RandomisationCheck]) -> dict:
    """One row per step, per method the mean rank correlation with the trained maps and the share of maxima moved."""
    summaries = {name: check.to_dict() for name, check in checks.items()}
    columns = ["step"] + [f"{name} {what}" for name in summaries for what in ("ρ", "moved")]
    rows = [
        [step["step"]]
        + [v for s in summaries.values() for v in (s["steps"][k]["spearman_mean"], s["steps"][k]["moved"])]
        for k, step in enumerate(next(iter(summaries.values()))["steps"])
    ]
    rows.append(["verdict"] + [v for s in summaries.values() for v in (s["verdict"], None)])
    return table(columns, rows, [None] + [".2f", ".0%"] * len(summaries))


def main(argv: list[str] | None = None, *, records: Path | None = None) -> dict[str, RandomisationCheck]:
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tag", default="vit-ct/headct-tiny-256", help="shipped weights")
    parser.add_argument("--patients", type=int, default=6, help="card test patients (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the re-initialisation (default 0)")
    parser.add_argument("--figure", type=Path, help="PNG of the rollout's cascade, the paper's figure")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    checks = measure(args.tag, args.patients, seed=args.seed)
    seconds = time.perf_counter() - start
    for name, check in checks.items():
        summary = check.to_dict()
        print(f"{name}: {summary['verdict']} (changed from step {summary['first_changed']})")
    if args.figure is not None:
        checks["rollout"].figure().savefig(args.figure, dpi=110)
    if records is not None:
        figures = {}
        for name, check in checks.items():
            key = name.replace("floor: ", "floor_").replace(" ", "_")
            last = check.to_dict()["steps"][-1]
            figures[f"{key}_spearman_random"] = last["spearman_mean"]
            figures[f"{key}_moved_random"] = last["moved"]
            figures[f"{key}_passed"] = int(check.passed)
        rollout_steps = checks["rollout"].to_dict()["steps"]
        figures.update(
            slices=checks["rollout"].to_dict()["slices"],
            rollout_spearman_blocks_random=next(s for s in rollout_steps if s["step"] == "block 0")["spearman_mean"],
        )
        notes = {"tag": args.tag, "patients": args.patients, "seed": args.seed, "machine": describe_machine(),
                 "criteria": checks["rollout"].to_dict()["criteria"]}  # fmt: skip
        tables = {"map_sanity": record_table(checks)}
        command = command_line("benchmarks.map_sanity", argv)
        write_record(
            "map_sanity", figures, command=command, tables=tables, seconds=seconds, notes=notes, folder=records
        )
    return checks


if __name__ == "__main__":
    main(records=RECORDS)
