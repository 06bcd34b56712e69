"""Maps finer than the patch grid (``--map_shifts``, :mod:`vit_ct.explain.shifted`): for each setting, the map
scores ``vit-ct test`` reports (the rollout, both ceilings, the floors), P(lesion) AUROC of ``prob`` and ``prob_tta``
from ``vit-ct predict``, predict's time against map_shifts 1, deletion / insertion on the finest grid's cells and the
model-randomisation check of each map; optionally the shipped weights as they are on a held-out family. Run as a
script it writes ``benchmarks/records/finer_maps.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import pandas as pd
import torch
from torchmetrics.functional.classification import binary_auroc

from benchmarks.faithfulness import lesion_slices, map_areas, patch_counts
from benchmarks.recording import RECORDS, command_line, git_state, table, timed_vit_ct, write_record
from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.explain.map_reading import MapReading
from vit_ct.explain.occlusion import brain_baseline
from vit_ct.explain.sanity import model_randomisation, rollout_map
from vit_ct.task import ViTClassifier

ROOT = Path(__file__).resolve().parents[1]
MANIFEST_CONFIG = ROOT / "configs" / "manifest.yaml"  # the user's slices, the checkpoint's input
SHIPPED_CONFIG = ROOT / "configs" / "finetune.yaml"  # the shipped weights as `vit-ct test` reads them
SOURCES = ("rollout", "perfect_patch", "perfect_grid", "floor_image", "floor_head")
SCORES = ("pointing", "energy_ratio", "pixel_auroc", "dice", "hd95_mm")
USAGE = """example (after `make demo`; ~6 min on 2 CPU cores):
  .venv/bin/python -m benchmarks.finer_maps                         # runs/latest's checkpoint, the demo's manifest
  .venv/bin/python -m benchmarks.finer_maps --ckpt K.ckpt --manifest M.csv --shifts 1 2 4 --heldout near

Map scores: `vit-ct test --config configs/manifest.yaml --data.manifest M --ckpt_path K --map_shifts S`, run
in this process through vit_ct.cli.main, on the manifest's test split. P(lesion) AUROC and predict's time: `vit-ct
predict ... --data.init_args.predict_split test`, each run a fresh process as a user starts it (imports, every map,
overlay and CSV written), the settings alternating. Model time: the recorded passes alone (ViTClassifier.explained)
over the lesion slices, in this process, alternating. Deletion / insertion (benchmarks/faithfulness.py's curves, the
model's single-pass P(lesion)): cells of the finest grid measured, a coarser map's cells taking their patch's value
(ties broken at random). Randomisation: vit_ct.explain.sanity.model_randomisation of each setting's rollout, inside
the head. --heldout FAMILY: benchmarks/small_data.py's family and test split, the shipped weights as they are.
"""


def default_checkpoint() -> str:
    """What ``make demo`` kept: ``runs/latest/summary.json``'s ``best_checkpoint``."""
    from vit_ct.run.summary import read_summary

    return read_summary()["best_checkpoint"]


def test_metrics(model_args: list[str], manifest: Path, shifts: int) -> dict[str, float]:
    """The ``test/...`` figures ``vit-ct test`` logs with ``--map_shifts shifts``, keys without ``test/``."""
    from vit_ct.cli import main as vit_ct

    args = ["test", *model_args, "--data.manifest", str(manifest), "--map_shifts", str(shifts),
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]  # fmt: skip
    metrics = vit_ct(args).trainer.callback_metrics
    return {k.removeprefix("test/"): float(v) for k, v in metrics.items() if k.startswith("test/")}


def timed_predict(model_args: list[str], manifest: Path, shifts: int, out: Path) -> float:
    """Wall seconds of one ``vit-ct predict`` of the test split in a fresh process (this checkout's code)."""
    return timed_vit_ct("predict", *model_args, "--data.manifest", str(manifest), "--data.init_args.predict_split",
                        "test", "--output_dir", str(out), "--overwrite", "true", "--map_shifts", str(shifts),
                        "--trainer.enable_progress_bar", "false")  # fmt: skip


def prediction_aurocs(out: Path) -> dict[str, float]:
    """P(lesion) AUROC of ``prob`` and (where written) ``prob_tta`` of a predict output's labelled slices."""
    rows = pd.read_csv(out / "predictions.csv")
    rows = rows[rows["label"].isin([0, 1])]
    target = torch.tensor(rows["label"].to_numpy())
    return {column: float(binary_auroc(torch.tensor(rows[column].to_numpy()), target))
            for column in ("prob", "prob_tta") if column in rows}  # fmt: skip


def predictions(
    model_args: list[str], manifest: Path, settings: list[int], repeats: int, warm_up: int = 0
) -> dict[int, dict]:
    """Per setting: predict's seconds (``repeats`` fresh processes, settings alternating, after ``warm_up`` runs of
    the first setting that are not counted: the first run reads the slices from a cold disk) and the AUROCs."""
    found = {s: {"predict_s": []} for s in settings}
    with tempfile.TemporaryDirectory(prefix="vit-ct-finer-") as folder:
        for _ in range(warm_up):
            timed_predict(model_args, manifest, settings[0], Path(folder) / "warm-up")
        for _ in range(repeats):
            for s in settings:
                out = Path(folder) / f"shifts{s}"
                found[s]["predict_s"].append(timed_predict(model_args, manifest, s, out))
                found[s].update(prediction_aurocs(out))
    return found


def cell_maps(model: ViTClassifier, images: torch.Tensor, settings: list[int], batch: int) -> dict[int, torch.Tensor]:
    """Each setting's rollout brought to the finest setting's grid, each cell its own (coarser: its patch's) value."""
    finest, maps = max(settings), {}
    for s in settings:
        reading = MapReading(shifts=s)
        rollout = torch.cat([model.explained(part, reading=reading).rollout for part in images.split(batch)])
        maps[s] = rollout.repeat_interleave(finest // s, -2).repeat_interleave(finest // s, -1)
    return maps


def model_seconds(model: ViTClassifier, images: torch.Tensor, settings: list[int], repeats: int, batch: int) -> dict:
    """Seconds of the recorded passes over ``images`` per setting, ``repeats`` times, the settings alternating."""
    seconds = {s: [] for s in settings}
    for _ in range(repeats):
        for s in settings:
            reading = MapReading(shifts=s)
            start = time.perf_counter()
            for part in images.split(batch):
                model.explained(part, reading=reading)
            seconds[s].append(time.perf_counter() - start)
    return seconds


def faithfulness(model: ViTClassifier, slices: dict, settings: list[int], *, steps: int, seed: int, batch: int):
    """Deletion and insertion areas per slice ``{name: (B, 2)}`` per setting and for a random map, on the cells of the
    finest setting's grid; the same slices, baseline and curve points for every map."""
    generator = torch.Generator().manual_seed(seed)
    windows = model.input_contract.windows
    images, heads = slices["image"], slices["head"]
    baseline = brain_baseline(images, heads, windows)
    with torch.inference_mode():
        ends = torch.stack([model.probabilities(model(images)), model.probabilities(model(baseline))], dim=1)
    maps = cell_maps(model, images, settings, batch)
    grid = tuple(next(iter(maps.values())).shape[-2:])
    maps["random"] = torch.rand(len(images), *grid, generator=generator)
    counts = patch_counts(grid[0] * grid[1], steps)
    areas = map_areas(model, images, baseline, maps, counts=counts, ends=ends, generator=generator, batch=batch)
    return areas, grid


def randomisation(model: ViTClassifier, slices: dict, settings: list[int], *, seed: int, batch: int) -> dict:
    """The model-randomisation check (:func:`model_randomisation`) of each setting's rollout, inside the head."""
    checks = {}
    for s in settings:
        read = partial(rollout_map, reading=MapReading(shifts=s))  # each copy of the cascade read the same way
        check = model_randomisation(model, slices["image"], read, region=slices["head"], seed=seed,
                                    batch_size=batch, examples=[0], method=f"rollout, map_shifts {s}")  # fmt: skip
        checks[s] = check.to_dict()
    return checks


def paired_difference(differences: torch.Tensor) -> list[tuple[float, float]]:
    """``(B, k)`` per-slice differences -> per column (mean, standard error of the mean)."""
    n = differences.shape[0]
    se = differences.std(dim=0) / n**0.5 if n > 1 else torch.full((differences.shape[1],), float("nan"))
    return [(float(m), float(e)) for m, e in zip(differences.mean(dim=0), se, strict=True)]


def heldout_manifest(family: str, root: Path | None = None) -> Path:
    """benchmarks/small_data.py's held-out family, as it builds it (its default patients, slices, splits), under
    ``root`` (default ``data/heldout``, ``data/heldout-far``)."""
    from benchmarks import small_data

    root = root or small_data.family_root(family)
    phantom, seed = small_data.HELDOUT_FAMILIES[family]
    from vit_ct.sim.synthetic import build_synthetic_dataset

    return build_synthetic_dataset(root, n_patients=120, slices_per_patient=6, seed=seed, config=phantom,
                                   split_fractions=(0.6, 0.1, 0.3))  # fmt: skip


def map_rows(tests: dict[int, dict], extra: dict[int, dict] | None = None) -> list[list]:
    """One row per map: each setting's rollout, then the ceilings and floors (perfect_grid per finer setting)."""
    settings, rows = sorted(tests), []
    first = tests[settings[0]]

    def row(name: str, scores: dict, source: str, more: list) -> list:
        return [name, *(scores.get(f"{source}_{k}") for k in SCORES), *more]

    for s in settings:
        rows.append(row(f"rollout, map_shifts {s}", tests[s], "rollout", (extra or {}).get(s, [])))
    width = len(rows[0]) - 1 - len(SCORES)
    rows.append(row("perfect patch map", first, "perfect_patch", [None] * width))
    rows += [row(f"perfect grid map, map_shifts {s}", tests[s], "perfect_grid", [None] * width)
             for s in settings if s > 1]  # fmt: skip
    rows += [row(f"floor: {what}", first, f"floor_{what}", [None] * width) for what in ("image", "head")]
    return rows


MAP_COLUMNS = ["map", "pointing", "energy ratio", "in-head pixel AUROC", "Dice at half max", "HD95 mm"]
MAP_FORMATS = [None, ".3f", ".1f", ".3f", ".3f", ".1f"]
FAITH_FORMATS = [".3f", None, ".3f", None, ".2f", ".0%", None]  # the differences: strings with their standard error


def main(argv: list[str] | None = None, records: Path | None = None) -> dict:
    """Measure and print; with ``records`` (a folder) also write the record ``finer_maps.json`` there."""
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ckpt", help="vit-ct checkpoint (default: runs/latest's, as `make demo` leaves it)")
    parser.add_argument("--manifest", type=Path, default=Path("data/synthetic/manifest.csv"), help="its test split")
    parser.add_argument("--shifts", type=int, nargs="+", default=[1, 2], help="map_shifts settings (1 first)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per setting, alternating (default 3)")
    parser.add_argument("--warm-up", type=int, default=1, help="predict runs before the timed ones (default 1)")
    parser.add_argument("--n-slices", type=int, default=32, help="lesion slices of deletion / insertion")
    parser.add_argument("--sanity-slices", type=int, default=16, help="lesion slices of the randomisation check")
    parser.add_argument("--steps", type=int, default=16, help="points of each deletion / insertion curve")
    parser.add_argument("--batch", type=int, default=8, help="slices per forward batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout", choices=("near", "far"), help="also the shipped weights on this family")
    parser.add_argument("--heldout-root", type=Path, help="where the family is built (default data/heldout[-far])")
    args = parser.parse_args(argv)
    settings = sorted(set(args.shifts))
    if settings[0] != 1:
        parser.error(f"--shifts must include 1, the patch rollout every ratio is against (got {args.shifts})")
    ckpt = args.ckpt or default_checkpoint()
    git, start = git_state(), time.perf_counter()
    model_args = ["--config", str(MANIFEST_CONFIG), "--ckpt_path", str(ckpt)]

    tests = {s: test_metrics(model_args, args.manifest, s) for s in settings}
    predicted = predictions(model_args, args.manifest, settings, args.repeats, args.warm_up)
    model = ViTClassifier.load_from_checkpoint(ckpt, map_location="cpu").eval()
    data = CTSliceDataModule.from_contract(model.input_contract, manifest=str(args.manifest), num_workers=0)
    slices = lesion_slices(data, "test")
    chosen = torch.randperm(len(slices["image"]), generator=torch.Generator().manual_seed(args.seed))
    faithful = {key: value[chosen[: args.n_slices].sort().values] for key, value in slices.items()}
    sanity = {key: value[: args.sanity_slices] for key, value in faithful.items()}
    model_s = model_seconds(model, slices["image"], settings, args.repeats, args.batch)
    per_slice, grid = faithfulness(model, faithful, settings, steps=args.steps, seed=args.seed, batch=args.batch)
    checks = randomisation(model, sanity, settings, seed=args.seed, batch=args.batch)
    areas = {name: [float(v) for v in a.mean(dim=0)] for name, a in per_slice.items()}
    paired = {s: paired_difference(per_slice[s] - per_slice[1]) for s in settings}  # (deletion, insertion), ± se

    figures, extra, cost_rows = {}, {}, []
    base_predict, base_model = statistics.median(predicted[1]["predict_s"]), statistics.median(model_s[1])
    for s in settings:
        key = f"shifts{s}"
        figures |= {f"{key}_{src}_{k}": tests[s][f"{src}_{k}"] for src in SOURCES for k in SCORES
                    if f"{src}_{k}" in tests[s]}  # fmt: skip
        last = checks[s]["steps"][-1]
        figures |= {
            f"{key}_test_auroc": tests[s]["auroc"],
            f"{key}_auroc_prob": predicted[s]["prob"],
            f"{key}_auroc_prob_tta": predicted[s].get("prob_tta"),
            f"{key}_predict_s": statistics.median(predicted[s]["predict_s"]),
            f"{key}_predict_ratio": statistics.median(predicted[s]["predict_s"]) / base_predict,
            f"{key}_model_s": statistics.median(model_s[s]),
            f"{key}_model_ratio": statistics.median(model_s[s]) / base_model,
            f"{key}_deletion": areas[s][0],
            f"{key}_insertion": areas[s][1],
            f"{key}_deletion_vs_1": paired[s][0][0],
            f"{key}_deletion_vs_1_se": paired[s][0][1],
            f"{key}_insertion_vs_1": paired[s][1][0],
            f"{key}_insertion_vs_1_se": paired[s][1][1],
            f"{key}_randomised_spearman": last["spearman_mean"],
            f"{key}_randomised_moved": last["moved"],
            f"{key}_randomisation_passed": int(checks[s]["verdict"] == "PASS"),
        }
        versus = [f"{m:+.4f} ± {se:.4f}" if s > 1 else None for m, se in paired[s]]
        extra[s] = [areas[s][0], versus[0], areas[s][1], versus[1], last["spearman_mean"], last["moved"],
                    checks[s]["verdict"]]  # fmt: skip
        times = [figures[f"{key}_{what}"] for what in ("predict_s", "predict_ratio", "model_s", "model_ratio")]
        cost_rows.append([s, s * s, tests[s]["auroc"], predicted[s].get("prob_tta"), *times])
    figures |= {"random_deletion": areas["random"][0], "random_insertion": areas["random"][1]}
    faith_columns = ["deletion AUC ↓", "vs map_shifts 1", "insertion AUC ↑", "vs map_shifts 1", "randomised ρ",
                     "moved", "randomisation"]  # fmt: skip
    random_row = ["random map", *[None] * len(SCORES), areas["random"][0], None, areas["random"][1], *[None] * 4]
    rows = map_rows(tests, extra) + [random_row]
    tables = {
        "finer_maps": table(MAP_COLUMNS + faith_columns, rows, MAP_FORMATS + FAITH_FORMATS),
        "finer_maps_cost": table(
            ["map_shifts", "passes", "P(lesion) AUROC", "AUROC of prob_tta", "predict s", "vs map_shifts 1",
             "model s", "model vs map_shifts 1"], cost_rows, ["d", "d", ".3f", ".3f", ".1f", "{:.2f}x", ".2f",
             "{:.2f}x"]),
    }  # fmt: skip
    notes = {
        "checkpoint": str(ckpt), "manifest": str(args.manifest), "split": "test", "shifts": settings,
        "repeats": args.repeats, "lesion_slices": len(slices["image"]), "faithfulness_slices": len(faithful["image"]),
        "sanity_slices": len(sanity["image"]), "cells": list(grid), "steps": args.steps, "seed": args.seed,
        "threads": torch.get_num_threads(), "predict_s": {s: predicted[s]["predict_s"] for s in settings},
        "model_s": model_s, "predict": "fresh process per run, as a user starts it; settings alternating",
        "model": "ViTClassifier.explained over every lesion slice, in this process, fp32, settings alternating",
        "warm_up": args.warm_up,
    }  # fmt: skip
    if args.heldout:
        manifest = heldout_manifest(args.heldout, args.heldout_root)
        shipped_args = ["--config", str(SHIPPED_CONFIG)]
        held = {s: test_metrics(shipped_args, manifest, s) for s in settings}
        held_predicted = predictions(shipped_args, manifest, settings, 1)
        held_extra = {s: [held_predicted[s]["prob"], held_predicted[s].get("prob_tta")] for s in settings}
        tables["finer_maps_shipped"] = table(MAP_COLUMNS + ["P(lesion) AUROC", "AUROC of prob_tta"],
                                             map_rows(held, held_extra), MAP_FORMATS + [".3f", ".3f"])  # fmt: skip
        figures |= {f"shipped_shifts{s}_{src}_{k}": held[s][f"{src}_{k}"] for s in settings for src in SOURCES
                    for k in SCORES if f"{src}_{k}" in held[s]}  # fmt: skip
        figures |= {f"shipped_shifts{s}_auroc_prob_tta": held_predicted[s].get("prob_tta") for s in settings}
        notes |= {"heldout": args.heldout, "heldout_manifest": str(manifest), "shipped": "vit-ct/headct-tiny-256"}
    seconds = time.perf_counter() - start
    for name, t in tables.items():
        print(f"\n{name}\n" + "\n".join(" | ".join(str(c) for c in row) for row in [t["columns"], *t["rows"]]))
    if records is not None:
        write_record("finer_maps", figures, command=command_line("benchmarks.finer_maps", argv), tables=tables,
                     seconds=seconds, notes=notes, folder=records, git=git)  # fmt: skip
    return {"figures": figures, "tables": tables, "notes": notes}


if __name__ == "__main__":
    main(records=RECORDS)
