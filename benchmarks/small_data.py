"""A few hundred slices of someone else's head CT: does simulator pretraining make the ViT worth using?

Side by side in one run, on a held-out synthetic set drawn from a *different* simulator family than pretraining
(sharper kernels, lower dose, beam hardening, fainter and smaller bleeds, 256 x 256 int16 DICOM, its own seeds):
the vit-ct ViT from scratch, the weights that ship with vit-ct as they are and fine-tuned with labels only (the
recipe of ``configs/finetune.yaml``: a manifest without masks) or with the masks, the demo's weights fine-tuned, a
checkpoint of ``configs/pretrain.yaml`` fine-tuned, and timm's ``resnet18`` from scratch, all on the same slices for
the same number of epochs. Scored on the test split: AUROC (patient-bootstrap 95% interval) against a
global-image-statistics floor, and the maps (ViT attention rollout, ResNet Grad-CAM, arXiv:1610.02391) against the
lesion masks (pointing game overall and by lesion-size quartile, energy in mask, in-head pixel AUROC, Dice and HD95
of the half-maximum region) beside the windowed image and the head mask as "maps" and the perfect patch map (the
ceiling of any map on the patch grid).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import lightning as L
import numpy as np
import pandas as pd
import timm
import torch
import torch.nn.functional as F
import yaml
from pytorch_grad_cam import GradCAM
from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from timm.optim import param_groups_weight_decay
from torch.utils.data import DataLoader

from benchmarks.recording import RECORDS, table, write_record
from vit_ct.data.loading.datamodule import CTSliceDataModule, CTSliceDataset
from vit_ct.explain.map_reading import MapReading
from vit_ct.explain.maps import upsample
from vit_ct.explain.segmentation import perfect_patch_map
from vit_ct.metrics.localisation import LocalisationMetrics, model_grid_spacing_mm, score_slices
from vit_ct.metrics.sink import mass_share
from vit_ct.run.hardware import auto_precision, describe_machine
from vit_ct.sim.phantom import PhantomConfig
from vit_ct.sim.projector import Kernel
from vit_ct.sim.synthetic import build_synthetic_dataset
from vit_ct.task import ViTClassifier
from vit_ct.task.optim import warmup_cosine_schedule
from vit_ct.task.settings import flat_config, group_of

WINDOWS = ["brain", "subdural"]  # as configs/pretrain.yaml and configs/finetune.yaml
FINETUNE = Path(__file__).resolve().parents[1] / "configs" / "finetune.yaml"
TOLERANCE_MM = 5.0

# The user's set: the same anatomy model as the pretraining simulator, but another scanner and reconstruction
# (sharp ramp / Shepp-Logan kernels instead of smooth ones, half the dose, beam hardening on), fainter bleeds
# (45-85 HU instead of 50-90, 30% low-contrast, 30% small) and its own seed family, stored as int16 DICOM.
HELDOUT = PhantomConfig(
    size=256,
    pixel_spacing_mm=0.9,
    bleed_hu_range=(45.0, 85.0),
    low_contrast_fraction=0.3,
    small_fraction=0.3,
    lookalike_probability=0.4,
    photons_per_ray_range=(4.0e5, 1.5e6),
    kernels=("ramp", "shepp-logan"),
    beam_hardening=0.5,
)
HELDOUT_SEED = 20_261_129  # the pretraining simulator draws from seeds 0, 10^6 and 2 x 10^6

# A second user's set with settings the scanner-randomised pretraining set (vit_ct.sim.cohort) never draws, so that
# the benchmark also measures a shift outside every pretraining range: 1.25 mm pixels (a 320 mm field of view, heads
# a third smaller in pixels; the cohort draws 0.7-1.0 mm, raised to ~1.04 mm at most to fit its largest heads) and
# an edge-enhancing bone kernel sharper than any it draws (half response 1.3 and edge boost 1.5 against at most 1.0
# and 0.6), at a noise inside its range (9-12 HU in white matter; the cohort's 5th-95th percentiles: 3-13 HU),
# HELDOUT's lesion mix and seeds of its own.
HELDOUT_FAR = PhantomConfig(
    size=256,
    pixel_spacing_mm=1.25,
    bleed_hu_range=(45.0, 85.0),
    low_contrast_fraction=0.3,
    small_fraction=0.3,
    lookalike_probability=0.4,
    photons_per_ray_range=(2.0e6, 5.0e6),
    kernels=(Kernel(half_response=1.3, edge_boost=1.5),),
    beam_hardening=0.05,
)
HELDOUT_FAR_SEED = 20_261_201
HELDOUT_FAMILIES = {"near": (HELDOUT, HELDOUT_SEED), "far": (HELDOUT_FAR, HELDOUT_FAR_SEED)}
# --as-scans: a family drawn as a report labels scans: half the patients bleed, on each of their slices with chance
# 0.35 (a positive scan holds slices without blood too), the other half on none; its own seeds
AS_SCANS = {"patient_bleed_fraction": 0.5, "bleed_fraction": 0.35}
AS_SCANS_SEED_OFFSET = 7


@dataclass(frozen=True)
class Row:
    """One trained model of the table."""

    name: str
    model: str  # "vit" or "resnet18"
    img_size: int
    start: str = "scratch"  # or "checkpoint" (--pretrained), "shipped" (--shipped NAME), "demo" (--demo CKPT)
    masks: bool = False  # train on the lesion masks too; False: the manifest the model sees has no mask column
    labels: str = "slice"  # "scan": the manifest the model sees has one label per scan (scan_label), none per slice
    train: bool = True  # False: score the (pretrained) weights as they are
    recipe: tuple[tuple[str, object], ...] = ()  # fine-tuned rows: changes to configs/finetune.yaml's model section

    @property
    def pretrained(self) -> bool:
        return self.start != "scratch"


SHIPPED = "vit-ct/headct-tiny-256"


ROWS = {
    "resnet18": Row("ResNet-18, scratch", "resnet18", 128),
    "vit": Row("ViT, scratch", "vit", 128),
    "vit-masks": Row("ViT, scratch + masks", "vit", 128, masks=True),
    "vit-pre": Row("ViT, pretrained, not fine-tuned", "vit", 128, start="checkpoint", train=False),
    "vit-ft": Row("ViT, fine-tuned", "vit", 128, start="checkpoint"),
    "vit-ft-masks": Row("ViT, fine-tuned + masks", "vit", 128, start="checkpoint", masks=True),
    "vit-256": Row("ViT, scratch", "vit", 256),
    "vit-ft-256": Row("ViT, fine-tuned", "vit", 256, start="checkpoint"),
    "resnet18-256": Row("ResNet-18, scratch", "resnet18", 256),
    "shipped": Row("ViT, shipped weights, not fine-tuned", "vit", 256, start="shipped", train=False),
    "shipped-ft": Row("ViT, shipped, fine-tuned, labels only", "vit", 256, start="shipped"),
    "shipped-ft-unanchored": Row(
        "ViT, shipped, fine-tuned, labels only, no anchor",
        "vit",
        256,
        start="shipped",
        recipe=(("anchor_loss_weight", 0.0),),
    ),
    "shipped-ft-masks": Row("ViT, shipped, fine-tuned + masks", "vit", 256, start="shipped", masks=True),
    "shipped-ft-scan": Row("ViT, shipped, fine-tuned, scan labels only", "vit", 256, start="shipped", labels="scan"),
    "demo-ft": Row("ViT, demo weights, fine-tuned, labels only", "vit", 192, start="demo"),
}

USAGE = """example (the README's table):
  .venv/bin/python -m benchmarks.small_data --rows shipped shipped-ft shipped-ft-masks demo-ft vit-256 resnet18-256 \\
      --seeds 0 1 2 --demo runs/latest/checkpoints/last.ckpt --out small_data.md

Rows (--rows): shipped (the weights that ship with vit-ct, --shipped, scored as they are), shipped-ft (fine-tuned
with labels only, the recipe of configs/finetune.yaml, read from it; trained once per --seeds), shipped-ft-unanchored
(the same without the anchor loss that holds the rollout to the shipped weights'), shipped-ft-scan (the same recipe
from one label per scan, each patient's one scan: positive when any of its slices is; no slice label, no mask),
shipped-ft-masks (+ masks: the patch and attention losses on the lesion masks, which a user's set rarely has), demo-
ft (the demo's weights, --demo, fine-tuned at their 192 x 192), vit-256 and resnet18-256 (from scratch at the held-
out set's native 256 x 256), and at 128 x 128 resnet18, vit, vit-masks, and vit-pre / vit-ft / vit-ft-masks / vit-
ft-256 from --pretrained (a checkpoint of configs/pretrain.yaml).
Every row trains --epochs epochs on the same train split (bf16 autocast where the CPU has native bf16, else fp32;
batch 16, flips/rotations/scaling/noise), from the same seed, and is scored with its final weights (no checkpoint
picked on the small validation split). The ViT's maps are read as `vit-ct test` reads them: over --map-shifts shifted
grids (default 2), beside the perfect map on that grid and on the patch grid.
"""


class ResNetClassifier(L.LightningModule):
    """timm's ``resnet18`` from scratch, trained like the ViT: AdamW, warm-up + cosine per step, label smoothing."""

    def __init__(self, *, in_chans: int, lr: float, weight_decay: float, warmup_epochs: float, label_smoothing: float):
        super().__init__()
        self.save_hyperparameters()
        self.net = timm.create_model("resnet18", pretrained=False, in_chans=in_chans, num_classes=2)
        self.val_scores: list[torch.Tensor] = []
        self.val_labels: list[torch.Tensor] = []

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.net(image)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().softmax(dim=-1)[:, 1]

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits = self(batch["image"]).float()
        loss = F.cross_entropy(logits, batch["label"], label_smoothing=self.hparams.label_smoothing)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(logits))
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.val_scores.append(self.probabilities(self(batch["image"])))
        self.val_labels.append(batch["label"])

    def on_validation_epoch_end(self) -> None:
        labels, scores = torch.cat(self.val_labels).numpy(), torch.cat(self.val_scores).numpy()
        self.val_scores, self.val_labels = [], []
        self.log("val/auroc", roc_auc_score(labels, scores) if len(set(labels)) == 2 else float("nan"))

    def configure_optimizers(self):
        groups = param_groups_weight_decay(self.net, weight_decay=self.hparams.weight_decay)  # as the ViT's groups
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr)
        schedule = warmup_cosine_schedule(optimizer, self.trainer, self.hparams.warmup_epochs)
        return {"optimizer": optimizer, "lr_scheduler": schedule}


def family_root(family: str, as_scans: bool = False) -> Path:
    """Where a held-out family is built unless ``--root`` says otherwise: ``data/heldout[-far][-scans]``."""
    return Path("data/heldout" + ("" if family == "near" else "-far") + ("-scans" if as_scans else ""))


def finetune_recipe() -> dict:
    """The model section of ``configs/finetune.yaml``, the README's recipe, less the start weights and depth that a
    row sets: what every fine-tuned row trains with, read from the file so that the two cannot drift apart."""
    model = flat_config(yaml.safe_load(FINETUNE.read_text())["model"])
    return {k: v for k, v in model.items() if k not in ("pretrained", "weights", "depth")}


def recipe_change(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--set``: a model argument of ``ViTClassifier`` and its YAML value."""
    key, sep, value = text.partition("=")
    if not sep or group_of(key) is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE with KEY a setting of ViTClassifier (e.g. lr)")
    return key, yaml.safe_load(value)


def build_model(row: Row, args: argparse.Namespace) -> L.LightningModule:
    """The row's network and recipe: ``configs/finetune.yaml``'s for fine-tuning (with the row's changes to it), a
    from-scratch rate otherwise."""
    common = {"label_smoothing": 0.1, "weight_decay": 0.05}
    if row.model == "resnet18":
        return ResNetClassifier(in_chans=len(WINDOWS), lr=1e-3, warmup_epochs=2.0, **common)
    start = {"checkpoint": {"weights": str(args.pretrained)}, "demo": {"weights": str(args.demo)}}
    start["shipped"] = {"pretrained": args.shipped}
    if row.pretrained:
        recipe = {**finetune_recipe(), **dict(args.recipe_changes or {}), **dict(row.recipe)}  # the row's own last
    else:
        recipe = {"lr": 1e-3, "drop_path_rate": 0.1, **common}
        recipe |= {"patch_loss_weight": 1.0, "attention_loss_weight": 1.0} if row.masks else {}
    return ViTClassifier.from_hparams(
        arch="vit_tiny_patch16_224",
        stem="conv",
        depth=6,
        img_size=row.img_size,
        in_chans=len(WINDOWS),
        **start.get(row.start, {}),
        **recipe,
    )


def split_tensors(data: CTSliceDataModule, split: str) -> dict[str, torch.Tensor]:
    """Every slice of ``split`` as one batch, unaugmented, in manifest order."""
    dataset = CTSliceDataset(data.split_table(split), windows=data.windows, img_size=data.img_size)
    parts: dict[str, list[torch.Tensor]] = {}
    for batch in DataLoader(dataset, batch_size=64):
        for key in ("image", "mask", "head", "has_mask", "label"):
            parts.setdefault(key, []).append(batch[key])
    return {key: torch.cat(values) for key, values in parts.items()}


def image_statistics(batch: dict[str, torch.Tensor]) -> np.ndarray:
    """Global statistics of each windowed slice over its head: mean, spread, bright tails, per window."""
    head = batch["head"][:, 0] > 0.5
    features = []
    for c in range(batch["image"].shape[1]):
        for image, inside in zip(batch["image"][:, c], head, strict=True):
            values = image[inside] if inside.any() else image.flatten()
            q = torch.quantile(values.float(), torch.tensor([0.5, 0.9, 0.99, 0.999]))
            features.append([values.mean(), values.std(), *q, (values > 0.85).float().mean()])
    n = len(batch["image"])
    return torch.tensor(features).view(batch["image"].shape[1], n, -1).permute(1, 0, 2).flatten(1).numpy()


def statistics_floor(train: dict, test: dict) -> np.ndarray:
    """P(lesion) of a logistic regression on :func:`image_statistics`, fitted on train: what no spatial model sees."""
    floor = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
    floor.fit(image_statistics(train), train["label"].numpy())
    return floor.predict_proba(image_statistics(test))[:, 1]


def patient_bootstrap_auroc(labels, scores, patients, *, n: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """AUROC and its 95% interval from resampling patients (slices of one patient are not independent)."""
    labels, scores, patients = np.asarray(labels), np.asarray(scores), np.asarray(patients)
    groups = [np.flatnonzero(patients == p) for p in np.unique(patients)]
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(n):
        rows = np.concatenate([groups[i] for i in rng.integers(0, len(groups), len(groups))])
        if len(np.unique(labels[rows])) == 2:
            draws.append(roc_auc_score(labels[rows], scores[rows]))
    low, high = np.percentile(draws, [2.5, 97.5])
    return float(roc_auc_score(labels, scores)), float(low), float(high)


def grad_cam_maps(model: ResNetClassifier, images: torch.Tensor) -> torch.Tensor:
    """Grad-CAM of the lesion logit at the last residual block, resized to the input: ``(B, S, S)`` in [0, 1]."""
    with GradCAM(model=model.net, target_layers=[model.net.layer4[-1]]) as cam:
        maps = cam(input_tensor=images, targets=[ClassifierOutputTarget(1)] * len(images))
    model.zero_grad(set_to_none=True)
    return torch.from_numpy(maps).float()


def score_maps(maps: torch.Tensor, test: dict, lesion: torch.Tensor, img_size: int) -> dict[str, float]:
    """Localisation of ``(B, S, S)`` maps on the test lesion slices, and the pointing game per quartile of lesion
    size (``pointing_q1`` the smallest quarter; ``lesion_px_quartiles`` its edges in pixels at ``img_size``)."""
    spacing = model_grid_spacing_mm(img_size)
    metric = LocalisationMetrics(tolerance_mm=TOLERANCE_MM, pixel_spacing_mm=spacing)
    masks, head = test["mask"][lesion, 0], test["head"][lesion, 0]
    metric.update(maps, masks, head, known=test["has_mask"][lesion])
    scores = {key: float(value) for key, value in metric.compute().items()}
    out = {k: scores[k] for k in ("pointing", "energy_ratio", "pixel_auroc", "dice", "hd95_mm", "slices")}
    out["outside_head"] = float(mass_share(maps, head < 0.5).mean())  # the map's share off the head, per slice
    n = len(maps)
    spacings = torch.full((n,), spacing, dtype=torch.float64)
    scored, per_slice = score_slices(maps, masks, head, tolerance_px=TOLERANCE_MM / spacings, spacing_mm=spacings,
                                     surface_distance=False)  # fmt: skip
    area = ((masks > 0.5) & (head > 0.5)).flatten(1).sum(dim=1)[scored].double().numpy()
    edges = np.quantile(area, [0.25, 0.5, 0.75]) if len(area) else np.array([])
    quartile = np.searchsorted(edges, area, side="right")  # 0..3
    for q in range(4):
        chosen = quartile == q
        out[f"pointing_q{q + 1}"] = float(per_slice["pointing"].numpy()[chosen].mean()) if chosen.any() else np.nan
    out["lesion_px_quartiles"] = [int(area.min()), *map(int, edges), int(area.max())] if len(area) else []
    return out


def scan_auroc(labels: np.ndarray, probs: np.ndarray, patients: np.ndarray) -> float:
    """AUROC over scans (each patient's one scan): its highest slice probability against "a slice holds a bleed"."""
    scans = pd.DataFrame({"label": labels, "prob": probs, "scan": patients}).groupby("scan").max()
    if scans["label"].nunique() < 2:  # undefined without scans of both kinds
        return float("nan")
    return float(roc_auc_score(scans["label"], scans["prob"]))


def evaluate(
    model: L.LightningModule, test: dict, lesion: torch.Tensor, img_size: int, map_shifts: int = 1
) -> tuple[np.ndarray, dict]:
    """P(lesion) on every test slice and the localisation of the model's map on the lesion slices (a ViT's rollout
    over ``map_shifts`` shifted grids; P(lesion) from the unshifted pass)."""
    model.eval()
    reading = MapReading(shifts=map_shifts)
    probs, maps = [], []
    for part in torch.arange(len(test["image"])).split(32):
        images = test["image"][part]
        if isinstance(model, ViTClassifier):  # one forward pass gives the logits and the rollout
            with torch.no_grad():
                logits, rollout = model.explain(images, reading=reading)
            rollout = upsample(rollout, images.shape[-2:])  # (B, S, S)
            maps.append(rollout)
        else:
            with torch.no_grad():
                logits = model(images)
            maps.append(
                grad_cam_maps(model, images) if lesion[part].any() else torch.zeros(len(part), *images.shape[-2:])
            )
        probs.append(model.probabilities(logits))
    maps = torch.cat(maps)[lesion]
    return torch.cat(probs).float().numpy(), score_maps(maps, test, lesion, img_size)


class KeepBestByValidation(L.Callback):
    """Keeps a copy of the weights at the validation with the highest ``val/auroc``: the other checkpoint rule,
    scored beside the final weights."""

    def __init__(self) -> None:
        self.best, self.state, self.epoch = float("-inf"), None, None

    def on_validation_end(self, trainer, pl_module) -> None:
        value = float(trainer.callback_metrics.get("val/auroc", float("nan")))
        if not trainer.sanity_checking and value > self.best:
            self.best, self.epoch = value, trainer.current_epoch
            self.state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def train(row: Row, data: CTSliceDataModule, args: argparse.Namespace, seed: int) -> tuple[L.LightningModule, dict]:
    L.seed_everything(seed, workers=True, verbose=False)
    model = build_model(row, args)
    if not row.train:
        return model, {"train_s": 0.0, "images_seen": 0, "images_per_s": float("nan"), "val_auroc": float("nan")}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision=auto_precision("cpu")[0],
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=args.val_every,
        callbacks=[keep := KeepBestByValidation()],
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - start
    seen = args.epochs * len(data.split_table("train"))
    val = float(trainer.callback_metrics.get("val/auroc", float("nan")))
    cost = {"train_s": seconds, "images_seen": seen, "images_per_s": seen / seconds, "val_auroc": val}
    return model, {**cost, "best_val_state": keep.state, "best_val_epoch": keep.epoch}


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | input | test AUROC [95% CI] | scan AUROC | map | pointing | by lesion size (quartiles) "
        "| energy ratio | outside head | pixel AUROC | Dice at half max | HD95 mm | train s | images/s |",
        "|---|---|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def num(value, fmt):
        return "" if value is None or (isinstance(value, float) and np.isnan(value)) else format(value, fmt)

    for r in rows:
        auroc = f"{r['auroc']:.3f} [{r['auroc_low']:.2f}, {r['auroc_high']:.2f}]" if "auroc" in r else ""
        pointing, dice = (num(r.get(key), ".3f") for key in ("pointing", "dice"))
        if r.get("seeds", 1) > 1:  # the mean over seeds ± their standard deviation
            auroc = f"{r['auroc']:.3f} ± {r['auroc_sd']:.3f} ({r['seeds']} seeds)"
            pointing, dice = (f"{r[key]:.3f} ± {r[key + '_sd']:.3f}" for key in ("pointing", "dice"))
        by_size = " / ".join(num(r.get(f"pointing_q{q}"), ".2f") for q in range(1, 5)) if "pointing_q1" in r else ""
        lines.append(
            f"| {r['name']} | {r['input']} | {auroc} | {num(r.get('scan_auroc'), '.3f')} | {r.get('map', '')} "
            f"| {pointing} "
            f"| {by_size} | {num(r.get('energy_ratio'), '.2f')} | {num(r.get('outside_head'), '.1%')} "
            f"| {num(r.get('pixel_auroc'), '.3f')} "
            f"| {dice} | {num(r.get('hd95_mm'), '.1f')} "
            f"| {num(r.get('train_s'), '.0f')} | {num(r.get('images_per_s'), '.1f')} |"
        )
    return "\n".join(lines)


SPREAD = ("auroc", "pointing", "dice")  # the figures whose spread over seeds a row also gives


def mean_over_seeds(runs: list[dict]) -> dict:
    """One row from the same row trained with several seeds: the mean of every figure, the spread of ``SPREAD``."""
    if len(runs) == 1:
        return runs[0]
    row = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            row[key] = float(np.nanmean([r[key] for r in runs]))
    row.update({f"{key}_sd": float(np.std([r[key] for r in runs], ddof=1)) for key in SPREAD})
    row.update(seeds=len(runs), per_seed=runs)
    return row


def record_of(results: list[dict]) -> tuple[dict, dict]:
    """The table as a record keeps it (the cells as :func:`markdown` prints them) and the figures of every row."""
    lines = markdown(results).splitlines()
    columns = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    figures = {}
    for r in results:
        slug = re.sub(r"[^a-z0-9]+", "_", f"{r['name']} {r['input']}".lower()).strip("_")
        keys = ("auroc", "scan_auroc", "pointing", "pixel_auroc", "dice", "hd95_mm", "outside_head",
                *(f"{k}_sd" for k in SPREAD))  # fmt: skip
        figures |= {f"{slug}_{key}": r[key] for key in keys if isinstance(r.get(key), (int, float))}
    return table(columns, rows), figures


def main(argv: list[str] | None = None, records: Path | None = None) -> str:
    """Train, score and print the table; with ``records`` (a folder) also write the record
    ``small_data_<family>.json`` there."""
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--pretrained", type=Path, help="vit-ct checkpoint of the simulator pretraining (vit-pre, vit-ft*)"
    )
    parser.add_argument("--shipped", default=SHIPPED, help="shipped weights of the shipped* rows (default %(default)s)")
    parser.add_argument("--demo", type=Path, help="the demo's checkpoint, for demo-ft (runs/latest/checkpoints/...)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of the --seeded-rows (mean, sd)")
    parser.add_argument("--seeded-rows", nargs="*", default=["shipped-ft"], help="rows trained once per --seeds")
    parser.add_argument(
        "--rows", nargs="+", default=["resnet18", "vit", "vit-masks", "vit-pre", "vit-ft", "vit-ft-masks", "vit-ft-256"]
    )
    parser.add_argument("--family", choices=sorted(HELDOUT_FAMILIES), default="near", help="HELDOUT or HELDOUT_FAR")
    parser.add_argument(
        "--as-scans", action="store_true",
        help="draw the family as scans are labelled (AS_SCANS: half the patients bleed, the others on no slice)",
    )  # fmt: skip
    parser.add_argument(
        "--root", type=Path, help="where the held-out set is built (default data/heldout[-far][-scans])"
    )
    parser.add_argument("--patients", type=int, default=120, help="patients of the held-out set (60%% train)")
    parser.add_argument("--slices-per-patient", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--val-every", type=int, default=5, help="validate every N epochs (logged, not selected on)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--set", dest="recipe_changes", type=recipe_change, action="append", metavar="KEY=VALUE",
        help="change configs/finetune.yaml's model section for every fine-tuned row (YAML value), e.g. "
        "anchor_loss_weight=4; repeatable",
    )  # fmt: skip
    parser.add_argument(
        "--map-shifts", type=int, default=2, choices=(1, 2, 4, 8, 16),
        help="read the ViT's rollout over this many shifted grids per axis, as vit-ct test does (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the table (.md) and every figure (.json beside it)")
    args = parser.parse_args(argv)
    unknown = set(args.rows) - set(ROWS)
    if unknown:
        parser.error(f"unknown --rows {sorted(unknown)}; choose from {sorted(ROWS)}")
    if any(ROWS[r].start == "checkpoint" for r in args.rows) and args.pretrained is None:
        parser.error(
            "pretrained rows (vit-pre, vit-ft*) need --pretrained CKPT (from vit-ct fit --config configs/pretrain.yaml)"
        )
    if any(ROWS[r].start == "demo" for r in args.rows) and args.demo is None:
        parser.error("demo-ft needs --demo CKPT (the checkpoint `make demo` keeps)")
    for flag in ("pretrained", "demo"):
        if getattr(args, flag) is not None and not getattr(args, flag).is_file():
            parser.error(f"--{flag} {getattr(args, flag)}: no such file")
    command = shlex.join(["python", "benchmarks/small_data.py", *(sys.argv[1:] if argv is None else argv)])
    start = time.perf_counter()

    phantom, family_seed = HELDOUT_FAMILIES[args.family]
    family = args.family + ("_scans" if args.as_scans else "")
    if args.as_scans:
        phantom, family_seed = replace(phantom, **AS_SCANS), family_seed + AS_SCANS_SEED_OFFSET
    manifest = build_synthetic_dataset(
        args.root or family_root(args.family, args.as_scans),
        n_patients=args.patients,
        slices_per_patient=args.slices_per_patient,
        seed=family_seed,
        config=phantom,
        split_fractions=(0.6, 0.1, 0.3),
    )
    table = pd.read_csv(manifest)
    labels_only = manifest.with_name("manifest_labels_only.csv")  # what a user without masks has
    table.drop(columns="mask").to_csv(labels_only, index=False)
    scan_labels_only = manifest.with_name("manifest_scan_labels_only.csv")  # a report's verdict per scan
    scan_label = table.groupby("patient_id")["label"].transform("max")
    table.drop(columns=["mask", "label"]).assign(scan_label=scan_label).to_csv(scan_labels_only, index=False)
    results: list[dict] = []
    sizes = sorted({ROWS[r].img_size for r in args.rows})
    for size in sizes:
        data, data_labels_only, data_scan_labels = (
            CTSliceDataModule(str(m), windows=WINDOWS, img_size=size, batch_size=args.batch_size, num_workers=0,
                              augment=True)
            for m in (manifest, labels_only, scan_labels_only)
        )  # fmt: skip
        data.check("fit")
        test, train_set = split_tensors(data, "test"), split_tensors(data, "train")
        patients = data.split_table("test")["patient_id"].to_numpy()
        lesion = (
            (test["label"] == 1) & test["has_mask"] & ((test["mask"] > 0.5) & (test["head"] > 0.5)).flatten(1).any(1)
        )
        labels = test["label"].numpy()
        low, lo, hi = patient_bootstrap_auroc(labels, statistics_floor(train_set, test), patients, seed=args.seed)
        results.append(
            {
                "name": "floor: global image statistics",
                "input": f"{size}",
                "auroc": low,
                "auroc_low": lo,
                "auroc_high": hi,
            }
        )
        ceilings = [("ceiling: perfect patch map", 16)]
        if args.map_shifts > 1:  # the ceiling of the grid the maps are read on
            ceilings.append((f"ceiling: perfect map, {16 // args.map_shifts}-pixel grid", 16 // args.map_shifts))
        perfect = [(name, perfect_patch_map(test["mask"][lesion, 0] > 0.5, (size // cell, size // cell)))
                   for name, cell in ceilings]  # fmt: skip
        for name, maps in (
            ("floor: windowed image", test["image"][lesion, 0]),
            ("floor: head mask", test["head"][lesion, 0]),
            *perfect,
        ):
            results.append(
                {"name": name, "input": f"{size}", "map": "itself", **score_maps(maps.float(), test, lesion, size)}
            )
        for key in [r for r in args.rows if ROWS[r].img_size == size]:
            row = ROWS[key]
            runs = []
            for seed in args.seeds if key in args.seeded_rows and row.train else [args.seed]:
                seen = data if row.masks else (data_scan_labels if row.labels == "scan" else data_labels_only)
                model, cost = train(row, seen, args, seed)
                probs, localisation = evaluate(model, test, lesion, size, args.map_shifts)
                auroc, lo, hi = patient_bootstrap_auroc(labels, probs, patients, seed=args.seed)
                localisation["scan_auroc"] = scan_auroc(labels, probs, patients)
                best_state = cost.pop("best_val_state", None)
                if best_state is not None:  # the checkpoint rule "best val/auroc", scored beside the final weights
                    model.load_state_dict(best_state)
                    best_probs, best_maps = evaluate(model, test, lesion, size, args.map_shifts)
                    cost["best_val_test_auroc"] = float(roc_auc_score(labels, best_probs))
                    cost["best_val_test_pointing"] = best_maps["pointing"]
                runs.append(
                    {
                        "name": row.name,
                        "row": key,
                        "seed": seed,
                        "input": f"{size}",
                        "auroc": auroc,
                        "auroc_low": lo,
                        "auroc_high": hi,
                        "map": "rollout" if row.model == "vit" else "Grad-CAM",
                        **localisation,
                        **cost,
                        "row_config": asdict(row),
                    }
                )
                print(markdown(runs[-1:]), flush=True)
            results.append(mean_over_seeds(runs))
    counts = table.groupby("split").agg(
        slices=("label", "size"), positives=("label", "sum"), patients=("patient_id", "nunique")
    )
    seconds = time.perf_counter() - start
    described = ", ".join(
        f"{s}: {int(c.slices)} slices ({int(c.positives)} with a bleed) of {int(c.patients)} patients"
        for s, c in counts.iterrows()
    )
    rules = []
    for r in results:
        runs = r.get("per_seed", [r])
        if "best_val_test_auroc" in runs[0]:
            final = ", ".join(f"{x['auroc']:.3f}" for x in runs)
            best = ", ".join(f"{x['best_val_test_auroc']:.3f} (epoch {x['best_val_epoch']})" for x in runs)
            rules.append(f"{r['name']}: test AUROC of the final weights {final}; of the best val/auroc {best}.")
    report = "\n".join(
        [
            markdown(results),
            "",
            *rules,
            f"Held-out set ({described}); lesion slices scored for localisation: {int(lesion.sum())}."
            f" {args.epochs} epochs per model, batch {args.batch_size}, final weights; rows without masks train on"
            " a manifest without its mask column. AUROC interval: 2,000 patient-level bootstrap draws (over seeds:"
            " mean ± standard deviation). Pointing by lesion size: quartiles of"
            f" {results[-1].get('lesion_px_quartiles', [])} lesion pixels at the row's input size (smallest first).",
            "",
            f"`{command}` ({seconds / 60:.0f} min, {torch.get_num_threads()} threads)",
        ]
    )
    print(f"measured on {describe_machine()}\n")
    print(report)
    if args.out:
        args.out.write_text(report + "\n")
        args.out.with_suffix(".json").write_text(
            json.dumps({"command": command, "rows": results}, indent=1, default=str)
        )
    if records is not None:
        results_table, figures = record_of(results)
        notes = {"family": family, "set": described, "epochs": args.epochs, "seeds": args.seeds,
                 "map_shifts": args.map_shifts,
                 "rules": rules, "lesion_slices": int(lesion.sum()), "threads": torch.get_num_threads()}  # fmt: skip
        write_record(f"small_data_{family}", figures, command=command, tables={"small_data": results_table},
                     seconds=seconds, notes=notes, folder=records)  # fmt: skip
    return report


if __name__ == "__main__":
    main(records=RECORDS)
