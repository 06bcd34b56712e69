"""Relevance through the convolutional stem: can the pixels inside a patch be told apart by the model itself?

The rollout gives one value per patch (per 8-pixel cell read over 2 x 2 shifted grids). Below the patch, what the
model reads of each pixel is its gradient: the gradient x input of the lesion log-odds through the whole network, the
conv stem included, against the air the padding holds (``(g * (x - air)).sum(channels)``), averaged over the same 2 x 2
shifted passes the rollout reads. Measured here, beside the rollout, as maps of their own:

- ``stem gradient x input``: the positive relevance alone, smoothed over 2 pixels (about the stem's first 3 x 3
  stride-2 convolution);
- ``rollout x stem share``: each 8-pixel cell keeps the rollout's mean, spread over its pixels in proportion to their
  smoothed positive stem relevance (what "modulated by the rollout of the patch" means);
- ``rollout x stem share^1/2``: the same by the share's square root, a softer spread: ``--map_pixels``, the
  package's reading (:mod:`vit_ct.explain.pixels`).

Also the cost, alternating: the recorded passes at 2 x 2 with and without ``map_pixels`` (one backward pass each), and
``vit-ct predict`` of the test split with and without it, each a fresh process.

Each map is scored as ``vit-ct test`` scores maps (pointing, in-head pixel AUROC, Dice at half max, HD95, energy in the
mask), and, on the checkpoint's own test split, by deletion / insertion of pixels against a brain baseline
(benchmarks/faithfulness.py's curves, every map ordered pixel by pixel) and the model-randomisation check
(:func:`vit_ct.explain.sanity.model_randomisation`) of the rollout and of ``map_pixels``. Held-out families: the
shipped weights as they are (benchmarks/small_data.py's families). Run as a script it writes
``benchmarks/records/stem_relevance.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks import small_data  # the families, their test split and how maps are scored
from benchmarks.faithfulness import map_areas, patch_counts
from benchmarks.finer_maps import MANIFEST_CONFIG, default_checkpoint, heldout_manifest, timed_predict
from benchmarks.recording import RECORDS, command_line, git_state, table, write_record
from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.explain.map_reading import MapReading
from vit_ct.explain.maps import upsample
from vit_ct.explain.occlusion import brain_baseline
from vit_ct.explain.pixels import POWER, SMOOTH_PX, smooth, spread_over_pixels
from vit_ct.explain.sanity import model_randomisation, rollout_map
from vit_ct.explain.shifted import READ_SHIFTS
from vit_ct.task import ViTClassifier

METHODS = ("rollout, one pass", "rollout, 2 x 2", "stem gradient x input", "rollout x stem share",
           "rollout x stem share^1/2 (map_pixels)")  # fmt: skip
SCORES = ("pointing", "pixel_auroc", "dice", "hd95_mm", "energy_ratio")
USAGE = """example (after `make demo`; ~6 min on 2 CPU cores):
  .venv/bin/python -m benchmarks.stem_relevance --heldout near far
"""


def method_maps(model: ViTClassifier, images: torch.Tensor, batch: int) -> dict[str, torch.Tensor]:
    """Every method's ``(B, S, S)`` map of ``images`` (see the module's text)."""
    S = images.shape[-1]
    parts: dict[str, list[torch.Tensor]] = {m: [] for m in METHODS}
    model.eval()
    for image in images.split(batch):
        one = model.explained(image).rollout
        cells = model.explained(image, reading=MapReading(shifts=READ_SHIFTS)).rollout  # (B, S / cell, S / cell)
        # the package's reading: cells spread by the relevance's square-root share
        pixels = model.explained(image, reading=MapReading(shifts=READ_SHIFTS, pixels=True))
        alone = smooth(pixels.relevance.clamp_min(0))
        found = (upsample(one, (S, S)), upsample(cells, (S, S)), alone,
                 spread_over_pixels(cells, pixels.relevance, power=1.0), pixels.rollout)  # fmt: skip
        for name, m in zip(METHODS, found, strict=True):
            parts[name].append(m)
    return {name: torch.cat(p) for name, p in parts.items()}


def model_seconds(model: ViTClassifier, images: torch.Tensor, batch: int, repeats: int) -> dict[str, list[float]]:
    """Seconds of the recorded passes over ``images`` at 2 x 2, without and with ``map_pixels``, alternating."""
    seconds: dict[str, list[float]] = {"rollout": [], "pixels": []}
    for _ in range(repeats):
        for name in seconds:
            reading = MapReading(shifts=READ_SHIFTS, pixels=name == "pixels")
            start = time.perf_counter()
            with torch.inference_mode():  # as predict runs
                for part in images.split(batch):
                    model.explained(part, reading=reading)
            seconds[name].append(time.perf_counter() - start)
    return seconds


def pixel_faithfulness(model: ViTClassifier, slices: dict, maps: dict, *, steps: int, seed: int, batch: int) -> dict:
    """Deletion and insertion areas (mean over slices) of every map, pixels ordered by the map against a brain
    baseline, the same curve points and slices for every map; and a random order."""
    generator = torch.Generator().manual_seed(seed)
    images = slices["image"]
    baseline = brain_baseline(images, slices["head"], model.input_contract.windows)
    with torch.inference_mode():
        ends = torch.stack([model.probabilities(model(images)), model.probabilities(model(baseline))], dim=1)
    grid = tuple(images.shape[-2:])
    counts = patch_counts(grid[0] * grid[1], steps)
    maps = {**maps, "random order": torch.rand(len(images), *grid, generator=generator)}
    areas = map_areas(model, images, baseline, maps, counts=counts, ends=ends, generator=generator, batch=batch)
    return {name: [float(v) for v in a.mean(dim=0)] for name, a in areas.items()}
    return areas


def predict_seconds(ckpt: Path, manifest: Path, repeats: int) -> dict[str, list[float]]:
    """Wall seconds of ``vit-ct predict`` of the test split at 2 x 2, without and with ``--map_pixels true``,
    each run a fresh process as a user starts it, alternating, after one untimed run (a cold disk)."""
    model_args = ["--config", str(MANIFEST_CONFIG), "--ckpt_path", str(ckpt)]
    readings = {"rollout": model_args, "pixels": [*model_args, "--map_pixels", "true"]}
    seconds: dict[str, list[float]] = {name: [] for name in readings}
    with tempfile.TemporaryDirectory(prefix="vit-ct-pixels-") as folder:
        timed_predict(model_args, manifest, READ_SHIFTS, Path(folder) / "warm-up")
        for _ in range(repeats):
            for name, arguments in readings.items():
                seconds[name].append(timed_predict(arguments, manifest, READ_SHIFTS, Path(folder) / name))
    return seconds


def randomisation(model: ViTClassifier, slices: dict, *, seed: int, batch: int) -> dict[str, dict]:
    """The model-randomisation check (:func:`model_randomisation`) of the 2 x 2 rollout and of ``map_pixels``, inside
    the head (the cascade's copies keep the reading)."""
    checks = {}
    for name, pixels in (("rollout, 2 x 2", False), (METHODS[-1], True)):
        read = partial(rollout_map, reading=MapReading(shifts=READ_SHIFTS, pixels=pixels))
        check = model_randomisation(model, slices["image"], read, region=slices["head"], seed=seed,
                                    batch_size=batch, examples=[0], method=name)  # fmt: skip
        checks[name] = check.to_dict()
    return checks


def scored(model: ViTClassifier, manifest: Path, batch: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """Every method's map scores on the manifest's test lesion slices, and those slices (``image``, ``head``, in
    manifest order: what :func:`faithfulness.lesion_slices` selects), read once for the faithfulness run."""
    data = CTSliceDataModule.from_contract(model.input_contract, manifest=str(manifest), num_workers=0)
    data.check("test")
    test = small_data.split_tensors(data, "test")
    lesion = (test["label"] == 1) & test["has_mask"] & ((test["mask"] > 0.5) & (test["head"] > 0.5)).flatten(1).any(1)
    maps = method_maps(model, test["image"][lesion], batch)
    size = test["image"].shape[-1]
    slices = {key: test[key][lesion] for key in ("image", "head")}
    return {name: small_data.score_maps(m, test, lesion, size) for name, m in maps.items()}, slices


def shipped_model() -> ViTClassifier:
    """The shipped weights as ``vit-ct test --config configs/finetune.yaml`` builds them (no training here)."""
    recipe = {**small_data.finetune_recipe(), "anchor_loss_weight": 0.0}
    return ViTClassifier.from_hparams(arch="vit_tiny_patch16_224", stem="conv", depth=6, img_size=256,
                         in_chans=len(small_data.WINDOWS), pretrained="vit-ct/headct-tiny-256", **recipe)  # fmt: skip


def sanity_cells(check: dict | None) -> list:
    """A randomisation check's last step (every weight random) as table cells: mean ρ, share moved, verdict."""
    if check is None:
        return [None, None, None]
    last = check["steps"][-1]
    return [last["spearman_mean"], last["moved"], check["verdict"]]


def main(argv: list[str] | None = None, records: Path | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--ckpt", type=Path, help="checkpoint (default: runs/latest's, what `make demo` kept)")
    parser.add_argument("--manifest", type=Path, default=Path("data/synthetic/manifest.csv"))
    parser.add_argument(
        "--heldout",
        nargs="*",
        choices=("near", "far"),
        default=[],
        help="also the shipped weights on these families (built under data/heldout[-far])",
    )
    parser.add_argument("--steps", type=int, default=16, help="points per deletion / insertion curve")
    parser.add_argument("--n-slices", type=int, default=32, help="lesion slices in the deletion / insertion run")
    parser.add_argument("--sanity-slices", type=int, default=16, help="lesion slices in the randomisation check")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each reading, alternating")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    git, start = git_state(), time.perf_counter()
    torch.manual_seed(args.seed)
    ckpt = args.ckpt or Path(default_checkpoint())
    model = ViTClassifier.load_from_checkpoint(ckpt, map_location="cpu").eval()
    demo, slices = scored(model, args.manifest, args.batch)
    runs, images = {"demo": demo}, slices["image"]
    seconds = model_seconds(model, images, args.batch, args.repeats)
    predicted = predict_seconds(ckpt, args.manifest, args.repeats)
    chosen = torch.randperm(len(slices["image"]), generator=torch.Generator().manual_seed(args.seed))
    slices = {key: value[chosen[: args.n_slices].sort().values] for key, value in slices.items()}
    faithful = pixel_faithfulness(model, slices, method_maps(model, slices["image"], args.batch), steps=args.steps,
                                  seed=args.seed, batch=args.batch)  # fmt: skip
    checks = randomisation(model, {k: v[: args.sanity_slices] for k, v in slices.items()}, seed=args.seed,
                           batch=args.batch)  # fmt: skip
    shipped = shipped_model().eval() if args.heldout else None
    for family in args.heldout:
        runs[family] = scored(shipped, heldout_manifest(family), args.batch)[0]

    figures, tables = {}, {}
    keys = dict(zip(METHODS, ("rollout1", "rollout2", "stem", "share", "pixels"), strict=True))
    for run, found in runs.items():
        rows = [[name, *(found[name][k] for k in SCORES)] for name in METHODS]
        if run == "demo":
            rows = [[*row, *faithful[row[0]], *sanity_cells(checks.get(row[0]))] for row in rows]
            rows.append(["random order", *[None] * len(SCORES), *faithful["random order"], None, None, None])
        figures |= {f"{run}_{keys[name]}_{k}": found[name][k] for name in METHODS for k in SCORES}
        columns = ["map", "pointing", "in-head pixel AUROC", "Dice at half max", "HD95 mm", "energy ratio"]
        formats = [None, ".3f", ".3f", ".3f", ".1f", ".2f"]
        if run == "demo":
            columns += ["deletion AUC ↓", "insertion AUC ↑", "randomised ρ", "moved", "randomisation"]
            formats += [".4f", ".4f", ".2f", ".0%", None]
        tables[f"stem_relevance_{run}"] = table(columns, rows, formats)
    for name, check in checks.items():
        last = check["steps"][-1]
        figures |= {f"demo_{keys[name]}_randomised_spearman": last["spearman_mean"],
                    f"demo_{keys[name]}_randomised_moved": last["moved"],
                    f"demo_{keys[name]}_randomisation_passed": int(check["verdict"] == "PASS")}  # fmt: skip
    figures |= {f"demo_{keys.get(name, 'random')}_{what}": faithful[name][i] for name in faithful
                for i, what in enumerate(("deletion", "insertion"))}  # fmt: skip
    rollout_s, pixels_s = statistics.median(seconds["rollout"]), statistics.median(seconds["pixels"])
    figures |= {"demo_model_s_rollout": rollout_s, "demo_model_s_pixels": pixels_s,
                "demo_pixels_vs_rollout": pixels_s / rollout_s}  # fmt: skip
    predict_rollout, predict_pixels = (statistics.median(predicted[name]) for name in ("rollout", "pixels"))
    figures |= {"demo_predict_s_rollout": predict_rollout, "demo_predict_s_pixels": predict_pixels,
                "demo_predict_pixels_vs_rollout": predict_pixels / predict_rollout}  # fmt: skip
    notes = {"checkpoint": str(ckpt), "manifest": str(args.manifest), "heldout": args.heldout, "steps": args.steps,
             "faithfulness_slices": len(slices["image"]), "smooth_px": SMOOTH_PX, "power": POWER,
             "shifts": READ_SHIFTS, "seed": args.seed, "threads": torch.get_num_threads(), "model_s": seconds,
             "predict_s": predicted, "timed_slices": len(images),
             "timed": "ViTClassifier.explained, 2 x 2, inference_mode, fp32; predict: fresh processes"}  # fmt: skip
    for name, t in tables.items():
        print(f"\n{name}\n" + "\n".join(" | ".join(str(c) for c in row) for row in [t["columns"], *t["rows"]]))
    if records is not None:
        command = command_line("benchmarks.stem_relevance", argv)
        write_record("stem_relevance", figures, command=command, tables=tables, seconds=time.perf_counter() - start,
                     notes=notes, folder=records, git=git)  # fmt: skip
    return {"figures": figures, "tables": tables, "notes": notes}


if __name__ == "__main__":
    main(records=RECORDS)
