"""Are the explanations faithful to the model, and do they point at the lesion? Patch deletion and insertion curves
(Petsiuk et al. 2018, RISE, arXiv:1806.07421) beside the localisation scores, for attention rollout (arXiv:2005.00928),
gradient rollout (Chefer et al. 2021, arXiv:2103.15679), last-block attention, Grad-CAM (arXiv:1610.02391, from
pytorch-grad-cam), occlusion sensitivity (arXiv:1311.2901, from MONAI: it needs only the model's output), a random map
and the two localisation floors, all on the same model and slices, with each method's cost.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from pytorch_grad_cam import GradCAM
from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.recording import RECORDS, table, write_record
from vit_ct.data.loading.datamodule import CTSliceDataModule, CTSliceDataset
from vit_ct.data.transforms.windows import parse_windows
from vit_ct.explain.attention import patch_grid, record_attention
from vit_ct.explain.maps import explain_gradient_rollout, localisation_maps
from vit_ct.explain.occlusion import BASELINE_HU, brain_baseline, occlusion_sensitivity
from vit_ct.explain.rollout import last_block_attention
from vit_ct.metrics.localisation import LocalisationMetrics, model_grid_spacing_mm
from vit_ct.run.hardware import describe_machine
from vit_ct.task import ViTClassifier

# Deletion fills with normal brain (vit_ct.explain.occlusion.brain_baseline): grey/white matter average ~30 HU, below
# fresh blood (50-90 HU), so a deleted patch loses exactly the hyperdensity that marks a bleed and gains no new
# structure. Only head pixels are filled (air stays air, the head keeps its outline); a blurred copy was rejected
# because blurring smears the bright skull inward, a bright rim where extra-axial bleeds lie.
METHODS = ("rollout", "gradient rollout", "last-block attention", "Grad-CAM", "occlusion", "random", "floor: image",
           "floor: head")  # fmt: skip

USAGE = """example:
  .venv/bin/python -m benchmarks.faithfulness --ckpt runs/latest/checkpoints/last.ckpt \\
      --manifest data/synthetic/manifest.csv --out faithfulness.md     # 64 slices at 128 x 128: 1-3 min on 2 CPUs

Slices: lesion slices (label 1, a known lesion mask inside the head) of --split, --n-slices drawn with --seed
(--predicted-positive: only those the model calls positive, P(lesion) >= 0.5). Score: P(lesion) = softmax[:, 1].
Curves: patches in the map's order (ties broken at random, seeded), --steps + 1 points from 0 to all patches; the
area is over the fraction of patches, in [0, 1]. Deletion: lower is better; insertion: higher is better.
Baseline: every head pixel (HU > -300) at 30 HU (normal brain), windowed like the input; air stays air.
Localisation: vit_ct.metrics.localisation.LocalisationMetrics on the model grid, each map bilinearly upsampled like
rollout.
"""


def patch_order(maps: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``(B, N)`` patch indices, most attended first, ties in random order, from ``(B, gh, gw)`` maps."""
    flat = maps.flatten(1).float()
    shuffle = torch.rand(flat.shape, generator=generator).argsort(dim=1)  # (B, N) random order
    ranked = flat.gather(1, shuffle).argsort(dim=1, descending=True, stable=True)  # stable: ties keep the random order
    return shuffle.gather(1, ranked)


def patch_counts(n_patches: int, steps: int) -> torch.Tensor:
    """``(steps + 1,)`` patches replaced at each point of a curve, 0 to ``n_patches``."""
    return torch.round(torch.linspace(0, n_patches, steps + 1)).long()


def perturbed(
    image: torch.Tensor, baseline: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, grid: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deletion and insertion inputs, each ``(B, K, C, S, S)``, for ``K = len(counts)`` points per slice.

    Point ``k`` of deletion has the first ``counts[k]`` patches of ``order`` at the baseline; insertion has them from
    the image and the rest at the baseline.
    """
    B, N = order.shape
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(N).expand(B, N))  # (B, N) position of each patch
    replaced = (rank[:, None, :] < counts[None, :, None]).view(B, len(counts), 1, *grid)  # (B, K, 1, gh, gw)
    patch_h, patch_w = image.shape[-2] // grid[0], image.shape[-1] // grid[1]
    replaced = replaced.repeat_interleave(patch_h, -2).repeat_interleave(patch_w, -1)  # (B, K, 1, S, S)
    image, baseline = image[:, None], baseline[:, None]
    return torch.where(replaced, baseline, image), torch.where(replaced, image, baseline)


def curves(
    model: ViTClassifier,
    image: torch.Tensor,
    baseline: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    grid: tuple[int, int],
    ends: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """P(lesion) along the deletion and the insertion curve, each ``(B, K)`` float64.

    ``ends`` ``(B, 2)``: P(lesion) of the intact slice and of the baseline, the two ends of both curves (the same for
    every map), so only the inner points are run, all of them for every slice in one forward batch.
    """
    deletion, insertion = perturbed(image, baseline, order, counts, grid)
    inner = torch.stack([deletion[:, 1:-1], insertion[:, 1:-1]], dim=1)  # (B, 2, K - 2, C, S, S)
    with torch.inference_mode():
        p = model.probabilities(model(inner.flatten(0, 2))).view(len(image), 2, -1).double()  # (B, 2, K - 2)
    ends = ends.double()
    deleted = torch.cat([ends[:, :1], p[:, 0], ends[:, 1:]], dim=1)  # intact -> baseline
    inserted = torch.cat([ends[:, 1:], p[:, 1], ends[:, :1]], dim=1)  # baseline -> intact
    return deleted, inserted


def curve_area(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``(B,)`` area under ``(B, K)`` scores over the fraction of patches replaced (trapezoids, x in [0, 1])."""
    return torch.trapezoid(scores, counts.double() / counts[-1], dim=-1)


def map_areas(
    model: ViTClassifier,
    images: torch.Tensor,
    baseline: torch.Tensor,
    maps: dict[str, torch.Tensor],
    *,
    counts: torch.Tensor,
    ends: torch.Tensor,
    generator: torch.Generator,
    batch: int,
) -> dict[str, torch.Tensor]:
    """Deletion and insertion areas ``(B, 2)`` per slice of each map ``{name: (B, gh, gw)}``, cells ordered by the
    map (ties at random), ``batch`` slices per forward batch; the same curve points and ends for every map."""
    grid = tuple(next(iter(maps.values())).shape[-2:])
    areas = {}
    for name, cells in maps.items():
        parts = []
        for part in torch.arange(len(images)).split(batch):
            order = patch_order(cells[part], generator)
            deleted, inserted = curves(model, images[part], baseline[part], order, counts, grid, ends[part])
            parts.append(torch.stack([curve_area(deleted, counts), curve_area(inserted, counts)], dim=1))
        areas[name] = torch.cat(parts)
    return areas


class _GridGradCAM(GradCAM):
    """Grad-CAM left on the patch grid: the package resizes to the input, which would blur the patch order."""

    grid: tuple[int, int]

    def get_target_width_height(self, input_tensor: torch.Tensor) -> tuple[int, int]:
        return self.grid[1], self.grid[0]


class _EveryToken(nn.Module):
    """The model's function with every token through every block (air masked as keys where the model masks it, so
    the same logits): the block outputs then lie on the full patch grid, where Grad-CAM reads them (the model itself
    lets air patches skip the blocks)."""

    def __init__(self, model: ViTClassifier) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.vit.forward_head(self.model.vit.forward_features_every_token(images))


def grad_cam(model: ViTClassifier, images: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Grad-CAM of the lesion logit at the last block's ``norm1`` (the package's ViT recipe), ``(B, gh, gw)``."""
    prefix = model.vit.num_prefix_tokens

    def to_grid(tokens: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, D, gh, gw), prefix tokens dropped
        return tokens[:, prefix:].reshape(tokens.shape[0], *grid, tokens.shape[-1]).permute(0, 3, 1, 2)

    layer = model.vit.blocks[-1].norm1
    with _GridGradCAM(model=_EveryToken(model), target_layers=[layer], reshape_transform=to_grid) as cam:
        cam.grid = grid
        maps = cam(input_tensor=images, targets=[ClassifierOutputTarget(1)] * len(images))  # (B, gh, gw), in [0, 1]
    model.zero_grad(set_to_none=True)  # the package backpropagates into the parameters
    return torch.from_numpy(maps)


def explanation_maps(
    model: ViTClassifier,
    batch: dict,
    baseline: torch.Tensor,
    grid: tuple[int, int],
    generator: torch.Generator,
    seconds: dict[str, float],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every method's map on the patch grid ``(B, gh, gw)`` and on the model grid ``(B, S, S)``, by method; the time
    each method took is added to ``seconds``."""
    images = batch["image"]
    patch = images.shape[-1] // grid[1]

    def timed(method: str, make) -> torch.Tensor:
        start = time.perf_counter()
        out = make()
        seconds[method] = seconds.get(method, 0.0) + time.perf_counter() - start
        return out

    def last_block() -> torch.Tensor:
        with torch.no_grad(), record_attention(model, head_fusion=model.hparams.rollout_head_fusion) as attentions:
            model(images)  # the model's own forward: air masked as keys where the model masks it
        return last_block_attention(attentions, num_prefix_tokens=model.vit.num_prefix_tokens, grid_size=grid).float()

    def lesion_probability(x: torch.Tensor) -> torch.Tensor:
        return model.probabilities(model(x))

    with torch.no_grad():
        floors = localisation_maps(model, batch)  # rollout (model.explain) and the floors, on the model grid
    on_grid = {
        "rollout": timed("rollout", lambda: model.explain(images)[1]),
        "gradient rollout": timed("gradient rollout", lambda: explain_gradient_rollout(model, images, target=1)),
        "last-block attention": timed("last-block attention", last_block),
        "Grad-CAM": timed("Grad-CAM", lambda: grad_cam(model, images, grid)),
        "occlusion": timed(
            "occlusion", lambda: occlusion_sensitivity(lesion_probability, images, baseline, patch_size=patch)
        ),
        "random": torch.rand(len(images), *grid, generator=generator),
        "floor: image": F.avg_pool2d(floors["floor_image"][:, None], patch)[:, 0],  # mean brain window
        "floor: head": F.avg_pool2d(floors["floor_head"][:, None], patch)[:, 0],  # head fraction of the patch
    }
    size = images.shape[-2:]
    on_pixels = {
        name: F.interpolate(m[:, None].float(), size=size, mode="bilinear", align_corners=False)[:, 0].clamp_min(0)
        for name, m in on_grid.items()
    }
    on_pixels.update(
        {"rollout": floors["rollout"], "floor: image": floors["floor_image"], "floor: head": floors["floor_head"]}
    )
    return on_grid, on_pixels


def lesion_slices(data: CTSliceDataModule, split: str) -> dict[str, torch.Tensor]:
    """Every slice of ``split`` with label 1 and a known lesion mask inside the head, as one batch (no augmentation)."""
    data.check("test")
    dataset = CTSliceDataset(data.split_table(split), windows=data.windows, img_size=data.img_size)
    if not len(dataset):
        raise ValueError(f"manifest {data.manifest} has no rows in split {split!r}")
    keep: dict[str, list[torch.Tensor]] = {}
    for batch in DataLoader(dataset, batch_size=32):
        lesion = (batch["mask"] > 0.5) & (batch["head"] > 0.5)
        chosen = (batch["label"] == 1) & batch["has_mask"] & lesion.flatten(1).any(dim=1)
        for key in ("image", "mask", "head", "has_mask", "index"):
            keep.setdefault(key, []).append(batch[key][chosen])
    return {key: torch.cat(values) for key, values in keep.items()}


def read_windows(ckpt: Path, windows: list[str] | None, in_chans: int) -> list[tuple[float, float]]:
    """The HU windows the model was trained on: ``--windows``, else ``config.yaml`` of the checkpoint's run folder."""
    if windows is None:
        config = ckpt.resolve().parent.parent / "config.yaml"
        if not config.is_file():
            raise ValueError(f"no {config} beside checkpoint {ckpt}: pass --windows (e.g. --windows brain subdural)")
        windows = yaml.safe_load(config.read_text())["data"]["init_args"].get("windows", "brain")
    pairs = parse_windows(windows)
    if len(pairs) != in_chans:
        raise ValueError(f"--windows gives {len(pairs)} windows for a model with in_chans={in_chans}")
    return pairs


# Passes through the network per slice (forward + backward counted as 2), given the number of patches.
FORWARDS = {
    "rollout": lambda n: 1,
    "gradient rollout": lambda n: 2,
    "last-block attention": lambda n: 1,
    "Grad-CAM": lambda n: 2,
    "occlusion": lambda n: n + 1,  # one per occluded patch, and the intact slice
}


def score_methods(
    model: ViTClassifier,
    manifest: Path,
    windows: list[tuple[float, float]],
    *,
    split: str = "test",
    n_slices: int = 64,
    steps: int = 16,
    seed: int = 0,
    predicted_positive: bool = False,
    batch_slices: int = 8,
) -> tuple[list[dict], dict]:
    """Deletion / insertion areas and localisation scores of every method in ``METHODS`` on lesion slices of
    ``split``: one row per method, and the facts the report states (slices chosen, P(lesion) at both ends, grid)."""
    if model.task != "binary":
        raise ValueError(f"the model is a {model.task} model; the benchmark scores P(lesion) of a binary model")
    generator = torch.Generator().manual_seed(seed)
    data = CTSliceDataModule(
        str(manifest), windows=windows, img_size=model.hparams.img_size, num_workers=0, augment=False
    )
    slices = lesion_slices(data, split)
    baseline_all = brain_baseline(slices["image"], slices["head"], windows)
    with torch.inference_mode():
        p_intact = model.probabilities(model(slices["image"]))
        p_baseline = model.probabilities(model(baseline_all))
    eligible = torch.nonzero(p_intact >= 0.5)[:, 0] if predicted_positive else torch.arange(len(p_intact))
    if not len(eligible):
        raise ValueError(f"split {split!r} of {manifest} has no lesion slices to score")
    chosen = eligible[torch.randperm(len(eligible), generator=generator)[:n_slices]].sort().values

    grid = patch_grid(model, slices["image"].shape)
    counts = patch_counts(grid[0] * grid[1], steps)
    spacing = model_grid_spacing_mm(model.hparams.img_size)
    tolerance = model.hparams.localisation_tolerance_mm
    metrics = {m: LocalisationMetrics(tolerance_mm=tolerance, pixel_spacing_mm=spacing) for m in METHODS}
    areas = {m: {"deletion": [], "insertion": []} for m in METHODS}
    seconds: dict[str, float] = {}
    for part in chosen.split(batch_slices):
        batch = {key: value[part] for key, value in slices.items()}
        baseline = baseline_all[part]
        on_grid, on_pixels = explanation_maps(model, batch, baseline, grid, generator, seconds)
        ends = torch.stack([p_intact[part], p_baseline[part]], dim=1)  # the first and last point, shared by all maps
        for method in METHODS:
            metrics[method].update(on_pixels[method], batch["mask"][:, 0], batch["head"][:, 0], known=batch["has_mask"])
            order = patch_order(on_grid[method], generator)
            deleted, inserted = curves(model, batch["image"], baseline, order, counts, grid, ends)
            areas[method]["deletion"].append(curve_area(deleted, counts))
            areas[method]["insertion"].append(curve_area(inserted, counts))

    rows = []
    for method in METHODS:
        scores = {name: float(value) for name, value in metrics[method].compute().items()}
        row = {"method": method, "pointing": scores["pointing"], "energy_ratio": scores["energy_ratio"]}
        row.update(pixel_auroc=scores["pixel_auroc"], dice=scores["dice"], slices=int(scores["slices"]))
        row["ms_per_slice"] = 1000 * seconds[method] / len(chosen) if method in seconds else float("nan")
        row["forwards"] = FORWARDS.get(method, lambda n: 0)(grid[0] * grid[1])
        for curve in ("deletion", "insertion"):
            values = torch.cat(areas[method][curve])
            row[curve] = float(values.mean())
            row[f"{curve}_se"] = float(values.std() / np.sqrt(len(values))) if len(values) > 1 else float("nan")
        rows.append(row)
    facts = {
        "chosen": chosen,
        "lesion_slices": len(slices["index"]),
        "called_positive": int((p_intact >= 0.5).sum()),
        "p_intact": p_intact,
        "p_baseline": p_baseline,
        "grid": grid,
        "counts": counts,
    }
    return rows, facts


def markdown_table(rows: list[dict]) -> str:
    header = "| method | deletion AUC ↓ | insertion AUC ↑ | pointing | energy ratio | pixel AUROC | Dice at half max |"
    header += " passes per slice | ms per slice | n slices |"
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cost = f"{r['forwards']} | {r['ms_per_slice']:.0f}" if r["forwards"] else "- | -"
        lines.append(
            f"| {r['method']} | {r['deletion']:.3f} ± {r['deletion_se']:.3f} | {r['insertion']:.3f} ± "
            f"{r['insertion_se']:.3f} | {r['pointing']:.3f} | {r['energy_ratio']:.2f} | {r['pixel_auroc']:.3f} "
            f"| {r['dice']:.3f} | {cost} | {r['slices']} |"
        )
    return "\n".join(lines)


def record_table(rows: list[dict]) -> dict:
    """The table as a record keeps it (``benchmarks.recording.table``)."""
    columns = ["method", "deletion AUC ↓", "insertion AUC ↑", "pointing", "energy ratio", "pixel AUROC",
               "Dice at half max", "passes per slice", "ms per slice", "n slices"]  # fmt: skip
    cells = [[r["method"], f"{r['deletion']:.3f} ± {r['deletion_se']:.3f}", f"{r['insertion']:.3f} ± "
              f"{r['insertion_se']:.3f}", r["pointing"], r["energy_ratio"], r["pixel_auroc"], r["dice"],
              r["forwards"] or None, r["ms_per_slice"] if r["forwards"] else None, r["slices"]]
             for r in rows]  # fmt: skip
    return table(columns, cells, [None, None, None, ".3f", ".2f", ".3f", ".3f", "d", ".0f", "d"])


def main(argv: list[str] | None = None, records: Path | None = None) -> str:
    """Measure and print the table; with ``records`` (a folder) also write the record ``faithfulness.json``."""
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ckpt", type=Path, required=True, help="vit-ct checkpoint of a binary model")
    parser.add_argument("--manifest", type=Path, required=True, help="manifest CSV the model was evaluated on")
    parser.add_argument("--split", default="test", choices=("train", "val", "test"))
    parser.add_argument("--n-slices", type=int, default=64, help="lesion slices scored (fewer if the split has fewer)")
    parser.add_argument("--steps", type=int, default=16, help="points of each curve, after the first")
    parser.add_argument("--seed", type=int, default=0, help="seeds the slice draw, the random map and tie-breaking")
    parser.add_argument("--windows", nargs="+", help="HU windows of the model input; default: the run's config.yaml")
    parser.add_argument("--predicted-positive", action="store_true", help="only slices with P(lesion) >= 0.5")
    parser.add_argument("--batch-slices", type=int, default=8, help="slices whose curves share one forward batch")
    parser.add_argument("--out", type=Path, help="also write the table to this .md file")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.n_slices < 1 or args.batch_slices < 1:
        parser.error(
            f"--steps must be >= 2, --n-slices and --batch-slices >= 1 (got {args.steps}, {args.n_slices},"
            f" {args.batch_slices})"
        )
    start = time.perf_counter()
    command = shlex.join(["python", "benchmarks/faithfulness.py", *(sys.argv[1:] if argv is None else argv)])
    model = ViTClassifier.load_from_checkpoint(args.ckpt, map_location="cpu").eval()
    windows = read_windows(args.ckpt, args.windows, model.hparams.in_chans)
    rows, facts = score_methods(
        model,
        args.manifest,
        windows,
        split=args.split,
        n_slices=args.n_slices,
        steps=args.steps,
        seed=args.seed,
        predicted_positive=args.predicted_positive,
        batch_slices=args.batch_slices,
    )
    chosen, n_lesion, n_positive = facts["chosen"], facts["lesion_slices"], facts["called_positive"]
    p_intact, p_baseline, grid, counts = facts["p_intact"], facts["p_baseline"], facts["grid"], facts["counts"]
    seconds = time.perf_counter() - start
    which = "predicted positive (P >= 0.5) " if args.predicted_positive else ""
    report = "\n".join(
        [
            markdown_table(rows),
            "",
            f"{len(chosen)} {which}lesion slices of split `{args.split}` ({n_lesion} lesion slices in it,"
            f" {n_positive} called positive); P(lesion): intact {float(p_intact[chosen].mean()):.3f},"
            f" baseline {float(p_baseline[chosen].mean()):.3f} (means over the scored slices). Curves: {len(counts)}"
            f" points over {grid[0] * grid[1]} patches of {grid[0]} x {grid[1]}; mean ± standard error over slices.",
            f"Baseline: head pixels at {BASELINE_HU:.0f} HU (normal brain), windowed; air kept. Floors: image = mean"
            " first window per patch; head = head fraction per patch (ties random: a random order within the head).",
            "",
            f"`{command}` ({seconds:.0f} s, {torch.get_num_threads()} threads)",
        ]
    )
    print(f"measured on {describe_machine()}\n")
    print(report)
    if args.out:
        args.out.write_text(report + "\n")
    if records is not None:
        slug = {r["method"]: re.sub(r"[^a-z0-9]+", "_", r["method"].lower()).strip("_") for r in rows}
        figures = {f"{slug[r['method']]}_{name}": r[name] for r in rows
                   for name in ("deletion", "insertion", "pointing", "pixel_auroc", "dice")}  # fmt: skip
        notes = {"checkpoint": str(args.ckpt), "split": args.split, "slices": len(chosen), "lesion_slices": n_lesion,
                 "steps": args.steps, "seed": args.seed, "threads": torch.get_num_threads()}  # fmt: skip
        write_record("faithfulness", figures, command=command, tables={"faithfulness": record_table(rows)},
                     seconds=seconds, notes=notes, folder=records)  # fmt: skip
    return report


if __name__ == "__main__":
    main(records=RECORDS)
