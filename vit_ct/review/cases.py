"""Review a trained model's predictions and attention-rollout maps (arXiv:2005.00928), slice by slice: loading a
run, the review table, metrics, case selection and export behind ``notebooks/attention_review.ipynb``.

Figures and the case browser are in :mod:`vit_ct.review.figures`; ``python -m vit_ct.review`` runs the notebook
headless (:mod:`vit_ct.review.notebook`) and writes its figures and CSVs to ``--output_dir``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import yaml
from rich.progress import track
from torchmetrics.functional.classification import binary_auroc, binary_confusion_matrix, binary_roc

from vit_ct.data.contract import READ_OPTIONS
from vit_ct.data.datamodule import CTSliceDataModule
from vit_ct.data.grid import to_source_grid
from vit_ct.data.reader import load_ct_slice, load_mask
from vit_ct.data.splits import SPLIT_FRACTIONS
from vit_ct.data.windows import parse_windows
from vit_ct.explain.attention import num_prefix_tokens, patch_grid, record_attention
from vit_ct.explain.localisation import (
    MAP_SOURCES,
    localisation_maps,
    model_grid_spacing_mm,
    score_slices,
    spacing_per_slice,
)
from vit_ct.explain.maps import explain_gradient_rollout
from vit_ct.explain.rollout import last_block_attention, per_block_maps, per_head_maps
from vit_ct.explain.sink import air_patches, class_token_shares, sink_per_slice
from vit_ct.model import ViTClassifier
from vit_ct.runs import LATEST_SUMMARY
from vit_ct.scan_results import scan_auroc, scan_column, scan_summary

GROUPS = {"TP": "true positive", "FP": "false positive", "FN": "false negative", "TN": "true negative"}
SCORES = ("pointing", "energy", "mask_fraction", "pixel_auroc")
METHODS = ("rollout", "gradient rollout", "last-block attention")


# --- where things are -----------------------------------------------------------------------------------------------


def project_root(start: str | os.PathLike | None = None) -> Path:
    """The nearest of ``start`` (default: the working folder) and its parents holding ``pyproject.toml`` or
    ``runs/latest``, else ``start``: Jupyter starts a notebook's kernel in ``notebooks/``, papermill where it runs."""
    start = Path(start or os.getcwd()).resolve()
    for folder in (start, *start.parents):
        if (folder / "pyproject.toml").is_file() or (folder / "runs" / "latest").exists():
            return folder
    return start


def project_path(path: str | os.PathLike) -> Path:
    """``path`` as given when absolute or found from the working folder, else relative to :func:`project_root`."""
    path = Path(path).expanduser()
    if path.is_absolute() or path.exists():
        return path.resolve()
    return project_root() / path


def resolve_checkpoint(ckpt_path: str | os.PathLike | None) -> Path:
    """The checkpoint to review; None: ``best_checkpoint`` (else ``last_checkpoint``) of ``runs/latest/summary.json``.

    Raises:
        ValueError: the checkpoint or the summary does not exist, saying what to do.
    """
    if ckpt_path is None:
        summary = project_path(LATEST_SUMMARY)
        if not summary.is_file():
            raise ValueError(f"ckpt_path is None and {summary} does not exist: run `make demo` or set ckpt_path")
        runs = json.loads(summary.read_text())
        ckpt_path = runs.get("best_checkpoint") or runs.get("last_checkpoint")
        if not ckpt_path:
            raise ValueError(f"{summary} names no checkpoint: set ckpt_path")
    path = project_path(ckpt_path)
    if not path.is_file():
        raise ValueError(f"checkpoint {path} not found (ckpt_path={str(ckpt_path)!r})")
    return path


def run_config(ckpt_path: str | os.PathLike) -> dict:
    """The ``config.yaml`` of the run a checkpoint belongs to (``RUN/checkpoints/x.ckpt`` -> ``RUN/config.yaml``),
    or ``{}`` when there is none (a checkpoint copied elsewhere)."""
    ckpt_path = Path(ckpt_path)
    for folder in (ckpt_path.parent.parent, ckpt_path.parent):
        if (folder / "config.yaml").is_file():
            return yaml.safe_load((folder / "config.yaml").read_text()) or {}
    return {}


def review_datamodule(
    model: ViTClassifier,
    manifest: str | os.PathLike,
    *,
    split: str | None = "test",
    batch_size: int = 16,
    config: dict | None = None,
    input_windows=None,
) -> CTSliceDataModule:
    """The slices of ``split`` of ``manifest``, prepared as the model was trained: input size, windows and read
    options from the model's input contract (its checkpoint's), the patient split from the run's ``config``; no
    augmentation.

    Args:
        model: The model under review.
        manifest: Manifest CSV (see the README).
        split: ``train``, ``val``, ``test``, or None for every row.
        batch_size: Slices per forward pass.
        config: The run's CLI config (:func:`run_config`); ``{}``: defaults.
        input_windows: The model's input windows, for a checkpoint that predates recorded inputs; None: its
            contract's, else the run config's, else ``brain`` for a one-channel model.
    """
    data = ((config or {}).get("data") or {}).get("init_args") or {}
    contract = model.input_contract
    windows = input_windows or contract.windows or data.get("windows")
    windows = windows or ("brain" if model.hparams.in_chans == 1 else None)
    if windows is None or len(parse_windows(windows)) != model.hparams.in_chans:
        raise ValueError(
            f"the model takes {model.hparams.in_chans} input windows, got input_windows={windows!r}: pass the"
            " windows it was trained with (e.g. ['brain', 'subdural'])"
        )
    read_options = contract.read_options or {name: data[name] for name in READ_OPTIONS if name in data}
    return CTSliceDataModule(
        str(project_path(manifest)),
        windows=windows,
        img_size=model.hparams.img_size,
        **read_options,
        batch_size=batch_size,
        num_workers=0,
        augment=False,
        cache=False,
        split_fractions=tuple(data.get("split_fractions", SPLIT_FRACTIONS)),
        split_seed=data.get("split_seed", 0),
        predict_split=split,
    )


def load_review(
    ckpt_path: str | None,
    manifest: str | os.PathLike,
    *,
    split: str | None = "test",
    batch_size: int = 16,
    input_windows=None,
) -> tuple[ViTClassifier, CTSliceDataModule]:
    """The model of ``ckpt_path`` (None: the latest run's best) in eval mode, and its :func:`review_datamodule`."""
    path = resolve_checkpoint(ckpt_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = ViTClassifier.load_from_checkpoint(path, map_location=device).eval()
    config = run_config(path)
    datamodule = review_datamodule(
        model, manifest, split=split, batch_size=batch_size, config=config, input_windows=input_windows
    )
    return model, datamodule


# --- the review table -----------------------------------------------------------------------------------------------


def localisation_scores(
    maps: torch.Tensor,
    masks: torch.Tensor,
    head: torch.Tensor,
    *,
    known: torch.Tensor,
    tolerance_mm: float,
    pixel_spacing_mm: float | torch.Tensor | None,
) -> dict[str, np.ndarray]:
    """Per-slice pointing, energy, mask fraction and pixel AUROC, scored exactly as
    :class:`vit_ct.explain.localisation.LocalisationMetrics` scores them; NaN on the slices it skips.

    Args:
        maps: ``(B, H, W)`` maps.
        masks: ``(B, H, W)`` lesion masks, 0/1.
        head: ``(B, H, W)`` head masks, 0/1.
        known: ``(B,)`` bool: the slice's mask is known.
        tolerance_mm: Pointing-game tolerance.
        pixel_spacing_mm: Pixel size of the grid, one for all or ``(B,)``; None or NaN: a 230 mm field of view.
    """
    spacing = spacing_per_slice(pixel_spacing_mm, model_grid_spacing_mm(maps.shape[-1]), len(maps), maps.device)
    scored, per_slice = score_slices(maps, masks, head, known=known, tolerance_px=tolerance_mm / spacing)
    scores = {name: np.full(len(maps), np.nan) for name in SCORES}
    for name, values in per_slice.items():
        scores[name][scored.cpu().numpy()] = values.double().cpu().numpy()
    return scores


def lesion_probability(model: ViTClassifier, logits: torch.Tensor) -> torch.Tensor:
    """P(lesion) ``(B,)``: the positive class for binary, 1 - P(class 0) for multi-class."""
    if model.task == "multilabel":
        raise ValueError("the review covers single-label models; a multi-label model has no single P(lesion)")
    probs = model.probabilities(logits)
    return probs if probs.dim() == 1 else 1.0 - probs[:, 0]


def run_review(
    model: ViTClassifier, datamodule: CTSliceDataModule, *, threshold: float = 0.5, progress: bool = True
) -> pd.DataFrame:
    """Runs the model over the datamodule's ``predict_split`` and tabulates every slice.

    Returns:
        One row per slice, indexed by its row in the split (``index``): ``image`` (as in the manifest),
        ``image_path``, ``scan`` (the manifest's ``scan``, else ``patient_id``), ``mask_path`` (None without a mask),
        ``frame``, ``label`` (Int64: 0/1 lesion, <NA> when unknown), ``prob`` (P(lesion)), ``group`` (:func:`outcome`
        at ``threshold``), ``rows``, ``cols`` (the source slice), ``rollout`` (the ``(grid_h, grid_w)`` map;
        :func:`source_map` brings it to the source grid), the attention sink
        (:func:`vit_ct.explain.sink.sink_per_slice`: ``rollout_air``, ``rollout_outside_head``, and ``cls_prefix`` /
        ``cls_air`` arrays with one share per block), and per map source (``rollout``, ``floor_image``,
        ``floor_head``) the localisation scores ``{source}_{score}`` on the model grid, as the model's ``test/``
        metrics, NaN where the slice has no lesion mask.
    """
    model.eval()
    datamodule.setup("predict")
    loader = datamodule.predict_dataloader()
    split_rows = loader.dataset.table
    scan_key = scan_column(split_rows)
    records = []
    for batch in track(loader, description="reviewing slices", disable=not progress, transient=True):
        batch = {k: v.to(model.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        explained = model.explained(batch["image"])
        logits, rollout = explained.output, explained.rollout
        prob = lesion_probability(model, logits).cpu().numpy()
        sink = sink_per_slice(rollout, explained.class_attention, batch["head"], model.num_prefix)
        scores = {name: sink[name] for name in ("rollout_air", "rollout_outside_head")}
        if batch["has_mask"].any():
            for source, maps in localisation_maps(model, batch, rollout=rollout).items():
                per_slice = localisation_scores(
                    maps,
                    batch["mask"][:, 0],
                    batch["head"][:, 0],
                    known=batch["has_mask"],
                    tolerance_mm=model.hparams.localisation_tolerance_mm,
                    pixel_spacing_mm=batch.get("pixel_spacing_mm"),
                )
                scores.update({f"{source}_{name}": values for name, values in per_slice.items()})
        for i, index in enumerate(batch["index"].tolist()):
            row = split_rows.iloc[index]
            label = int(batch["label"][i])
            mask = row.get("mask")
            records.append(
                {
                    "index": index,
                    "image": row["image_ref"],
                    "image_path": row["image"],
                    "scan": row[scan_key] if scan_key else None,
                    "mask_path": mask if isinstance(mask, str) and mask else None,
                    "frame": None if pd.isna(row.get("slice", pd.NA)) else int(row["slice"]),
                    "label": pd.NA if label < 0 else int(label > 0),
                    "prob": float(prob[i]),
                    "rows": int(batch["source_shape"][i, 0]),
                    "cols": int(batch["source_shape"][i, 1]),
                    "rollout": rollout[i].float().cpu().numpy(),
                    "cls_prefix": sink["cls_prefix"][i].cpu().numpy(),  # per block
                    "cls_air": sink["cls_air"][i].cpu().numpy(),
                    **{name: float(values[i]) for name, values in scores.items()},
                }
            )
    table = pd.DataFrame(records).set_index("index")
    table["label"] = table["label"].astype("Int64")
    table.attrs["read_options"] = dict(datamodule.read_options)  # how case_images reads the slices again
    for column in (f"{source}_{name}" for source in MAP_SOURCES for name in SCORES):
        if column not in table:
            table[column] = np.nan
    table.insert(table.columns.get_loc("prob") + 1, "group", outcome(table, threshold))
    return table


def source_map(row: pd.Series, column: str = "rollout") -> np.ndarray:
    """A patch-grid map of a table row on the source slice's rows x columns (as ``vit-ct predict`` writes it)."""
    grid = torch.as_tensor(np.asarray(row[column], dtype=np.float32))
    return to_source_grid(grid, int(row["rows"]), int(row["cols"])).clamp_min(0).numpy()


def case_images(row: pd.Series, read_options: dict | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """The source slice in HU and its lesion mask (None without one), read with ``read_options`` (of
    :func:`load_ct_slice`; the review table's ``attrs["read_options"]``, as the model's data module read it)."""
    frame = None if pd.isna(row.get("frame")) else int(row["frame"])
    hu = load_ct_slice(row["image_path"], frame=frame, **(read_options or {}))
    mask = load_mask(row["mask_path"], frame=frame) if isinstance(row.get("mask_path"), str) else None
    return hu, mask


# --- metrics --------------------------------------------------------------------------------------------------------


def _labelled(table: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    known = table["label"].notna().to_numpy()
    return table["prob"].to_numpy(dtype=np.float64)[known], table["label"].to_numpy()[known].astype(np.int64)


def outcome(table: pd.DataFrame, threshold: float = 0.5) -> pd.Series:
    """``TP``, ``FP``, ``FN``, ``TN`` per slice (``prob > threshold`` is positive, as in torchmetrics), or
    ``unlabelled``."""
    predicted = table["prob"].to_numpy() > threshold
    label = table["label"].astype("Int64")
    lesion = (label == 1).fillna(False).to_numpy(dtype=bool)
    codes = np.where(predicted, np.where(lesion, "TP", "FP"), np.where(lesion, "FN", "TN"))
    return pd.Series(np.where(label.isna().to_numpy(), "unlabelled", codes), index=table.index, name="group")


def confusion(table: pd.DataFrame, threshold: float = 0.5) -> pd.DataFrame:
    """2 x 2 counts over the labelled slices: rows true label 0/1, columns predicted 0/1 (sklearn's layout), from
    torchmetrics (P > ``threshold`` is positive), as the training metrics count them."""
    prob, label = _labelled(table)
    counts = binary_confusion_matrix(torch.from_numpy(prob), torch.from_numpy(label), threshold=threshold).numpy()
    return pd.DataFrame(counts, index=pd.Index([0, 1], name="true"), columns=pd.Index([0, 1], name="predicted"))


def scan_results(table: pd.DataFrame) -> pd.DataFrame | None:
    """One row per scan of the review table, as ``scans.csv`` of ``vit-ct predict``: ``prob`` the maximum over the
    scan's slices, ``label`` 1 when any slice has a lesion; None when the slices name no scan."""
    if "scan" not in table.columns or table["scan"].isna().any():
        return None
    slices = table.reset_index().rename(columns={"index": "order", "prob": "p_lesion"})
    slices["positive"] = (slices["label"] > 0).astype("boolean").where(slices["label"].notna())
    return scan_summary(slices, "scan")


def summary_metrics(table: pd.DataFrame, threshold: float = 0.5) -> pd.Series:
    """Slices, positives, AUROC (NaN with one class only), accuracy, sensitivity, specificity at ``threshold``; and
    where the slices name their scans, the scans, the positive scans and the scan-level AUROC (:func:`scan_results`)."""
    prob, label = _labelled(table)
    (tn, fp), (fn, tp) = confusion(table, threshold).to_numpy()
    both = 0 < label.sum() < len(label)
    auroc = float(binary_auroc(torch.from_numpy(prob), torch.from_numpy(label))) if both else float("nan")

    def ratio(a: int, b: int) -> float:
        return a / b if b else float("nan")

    metrics = {
        "slices": len(label),
        "positives": int(label.sum()),
        "auroc": auroc,
        "accuracy": ratio(tp + tn, len(label)),
        "sensitivity": ratio(tp, tp + fn),
        "specificity": ratio(tn, tn + fp),
    }
    scans = scan_results(table)
    if scans is not None:
        known = scans[scans["label"].notna()]
        metrics.update(scans=len(known), positive_scans=int(known["label"].sum()), scan_auroc=scan_auroc(scans))
    return pd.Series(metrics)


def roc_points(table: pd.DataFrame) -> pd.DataFrame:
    """ROC curve over the labelled slices (torchmetrics): ``fpr``, ``tpr``, ``threshold`` (highest first)."""
    prob, label = _labelled(table)
    fpr, tpr, thresholds = binary_roc(torch.from_numpy(prob), torch.from_numpy(label))
    return pd.DataFrame({"fpr": fpr.numpy(), "tpr": tpr.numpy(), "threshold": thresholds.numpy()})


def calibration_bins(table: pd.DataFrame, n_bins: int = 10) -> pd.DataFrame:
    """Reliability diagram data: ``n_bins`` equal-width bins of P(lesion), right edge inclusive (as sklearn's
    ``calibration_curve``): ``lower``, ``upper``, ``count``, ``mean_prob``, ``fraction_positive`` (NaN when empty)."""
    prob, label = _labelled(table)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    bins = np.searchsorted(edges[1:-1], prob)  # bin i holds (edges[i], edges[i + 1]]; bin 0 also 0
    count = np.bincount(bins, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_prob = np.bincount(bins, weights=prob, minlength=n_bins) / count
        fraction = np.bincount(bins, weights=label, minlength=n_bins) / count
    return pd.DataFrame(
        {"lower": edges[:-1], "upper": edges[1:], "count": count, "mean_prob": mean_prob, "fraction_positive": fraction}
    )


def expected_calibration_error(bins: pd.DataFrame) -> float:
    """Count-weighted mean of |fraction positive - mean probability| over the bins."""
    full = bins[bins["count"] > 0]
    gap = (full["fraction_positive"] - full["mean_prob"]).abs()
    return float((gap * full["count"]).sum() / full["count"].sum()) if len(full) else float("nan")


def sink_summary(table: pd.DataFrame) -> pd.DataFrame:
    """The attention sink over the reviewed slices, per block: the class token's mean attention on prefix tokens
    (class token, registers) and on air patches; the table's ``attrs`` carry the mean ``rollout_air`` (share of
    the rollout on patches without a head pixel) and ``rollout_outside_head`` (on the slice grid)."""
    blocks = pd.DataFrame(
        {name: np.stack(table[name].to_numpy()).mean(axis=0) for name in ("cls_prefix", "cls_air")}
    ).rename_axis("block")
    blocks.attrs = {name: float(table[name].mean()) for name in ("rollout_air", "rollout_outside_head")}
    return blocks


def localisation_summary(table: pd.DataFrame) -> pd.DataFrame | None:
    """Mean localisation scores per map source over the scored slices, as the model's ``test/{source}_{score}``
    (``energy_ratio`` = mean energy / mean mask fraction); None when no slice has a lesion mask."""
    scored = table["rollout_pointing"].notna()
    if not scored.any():
        return None
    rows = {}
    for source in MAP_SOURCES:
        means = {name: table.loc[scored, f"{source}_{name}"].mean() for name in SCORES}
        means["energy_ratio"] = means["energy"] / means["mask_fraction"]
        rows[source] = {**means, "slices": int(scored.sum())}
    return pd.DataFrame.from_dict(rows, orient="index")


def gallery(table: pd.DataFrame, group: str, n: int | None = 4, *, threshold: float = 0.5) -> pd.DataFrame:
    """Up to ``n`` slices of one group (``TP``, ``FP``, ``FN``, ``TN``, ``unlabelled``), most confident first:
    highest P(lesion) first for predicted positives (and unlabelled slices), lowest first for predicted negatives;
    ties in table order."""
    if group not in (*GROUPS, "unlabelled"):
        raise ValueError(f"group must be one of {[*GROUPS, 'unlabelled']}, got {group!r}")
    rows = table[outcome(table, threshold) == group]
    rows = rows.sort_values("prob", ascending=group in ("FN", "TN"), kind="stable")
    return rows if n is None else rows.head(n)


def review_order(table: pd.DataFrame, *, threshold: float = 0.5) -> pd.DataFrame:
    """Every slice, group by group (TP, FP, FN, TN, then unlabelled), most confident first: the browser's order."""
    return pd.concat([gallery(table, group, None, threshold=threshold) for group in (*GROUPS, "unlabelled")])


def pick_case(table: pd.DataFrame, image: str | None = None, *, threshold: float = 0.5) -> pd.Series:
    """The row of ``image`` (as in the manifest); None: the most confident true positive, else the first slice."""
    if image is not None:
        rows = table[table["image"] == image]
        if rows.empty:
            raise ValueError(f"case {image!r} is not among the {len(table)} reviewed slices")
        return rows.iloc[0]
    return review_order(table, threshold=threshold).iloc[0]


# --- one case in depth ----------------------------------------------------------------------------------------------


@dataclass
class CaseMaps:
    """Maps of one slice, on its source grid (rows x columns), for a person to compare."""

    row: pd.Series
    hu: np.ndarray  # (rows, cols) HU
    mask: np.ndarray | None  # (rows, cols) bool lesion mask
    maps: dict[str, np.ndarray]  # METHODS -> (rows, cols)
    heads: np.ndarray  # (heads, rows, cols): class token's attention per head, last block
    blocks: np.ndarray  # (blocks, rows, cols): class token's attention per block, heads fused
    sink: pd.DataFrame  # per block: the class token's attention on prefix tokens and on air patches (heads fused)


def case_maps(model: ViTClassifier, datamodule: CTSliceDataModule, row: pd.Series) -> CaseMaps:
    """Rollout, gradient rollout (class 1: lesion, for binary) and last-block attention, plus per-head and per-block
    class-token attention, of the slice of a :func:`run_review` row."""
    item = datamodule.predict_dataloader().dataset.load(int(row.name))
    image = item["image"][None].to(model.device)  # (1, C, S, S)
    explained = model.explained(image)
    rollout = explained.rollout
    with torch.no_grad(), record_attention(model) as attentions:  # every head
        model(image)
    prefix, grid = num_prefix_tokens(model), patch_grid(model, image.shape)
    air = air_patches(item["head"][None], grid)
    on_prefix, on_air = class_token_shares(explained.class_attention, air, prefix)
    fusion = model.hparams.rollout_head_fusion
    gradient = explain_gradient_rollout(model, image, target=1 if model.task == "binary" else None)
    last = last_block_attention(attentions, fusion, num_prefix_tokens=prefix, grid_size=grid)
    heads = per_head_maps(attentions, block=-1, num_prefix_tokens=prefix, grid_size=grid)
    blocks = per_block_maps(attentions, fusion, num_prefix_tokens=prefix, grid_size=grid)
    rows, cols = int(row["rows"]), int(row["cols"])

    def to_source(maps: torch.Tensor) -> np.ndarray:
        return to_source_grid(maps.float().cpu(), rows, cols).clamp_min(0).numpy()

    hu, mask = case_images(row, datamodule.read_options)
    named = {"rollout": rollout[0], "gradient rollout": gradient[0], "last-block attention": last[0]}
    return CaseMaps(
        row=row,
        hu=hu,
        mask=mask,
        maps={name: to_source(m) for name, m in named.items()},
        heads=to_source(heads[0]),
        blocks=to_source(blocks[0]),
        sink=pd.DataFrame({"cls_prefix": on_prefix[0].cpu().numpy(), "cls_air": on_air[0].cpu().numpy()}).rename_axis(
            "block"
        ),
    )


# --- export ---------------------------------------------------------------------------------------------------------


def review_csv(table: pd.DataFrame) -> pd.DataFrame:
    """The table without its in-memory maps, for a CSV; the per-block sink shares as ``cls_prefix_b{i}`` and
    ``cls_air_b{i}`` columns, as in ``predictions.csv``."""
    out = table.drop(columns=["rollout", "cls_prefix", "cls_air"], errors="ignore")
    for name in ("cls_prefix", "cls_air"):
        if name in table and len(table):
            blocks = np.stack(table[name].to_numpy())  # (slices, blocks)
            for b in range(blocks.shape[1]):
                out[f"{name}_b{b}"] = blocks[:, b]
    return out.reset_index()


def export_flagged(
    table: pd.DataFrame, path: str | os.PathLike, flagged: Sequence[str] | None = None, *, threshold: float = 0.5
) -> pd.DataFrame:
    """Write the flagged cases to a CSV and return them.

    Args:
        table: A :func:`run_review` table.
        path: CSV to write.
        flagged: Images (as in the manifest) a reviewer flagged; None: the false negatives at ``threshold``.
        threshold: Operating point of the groups.
    """
    if flagged is None:
        rows = gallery(table, "FN", None, threshold=threshold)
    else:
        missing = sorted(set(flagged) - set(table["image"]))
        if missing:
            raise ValueError(f"flagged cases {missing} are not among the {len(table)} reviewed slices")
        rows = table[table["image"].isin(list(flagged))]
    rows = review_csv(rows.assign(group=outcome(rows, threshold)))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows.to_csv(path, index=False)
    return rows
