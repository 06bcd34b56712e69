"""One case in depth (rollout, gradient rollout, last-block attention and occlusion sensitivity, attention per head and
per block), and the export of the cases a reviewer flags."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.data.transforms.grid import to_source_grid
from vit_ct.explain.attention import num_prefix_tokens, patch_grid, record_attention
from vit_ct.explain.map_reading import MapReading
from vit_ct.explain.maps import explain_gradient_rollout
from vit_ct.explain.occlusion import brain_baseline, occlusion_sensitivity
from vit_ct.explain.rollout import last_block_attention, per_block_maps, per_head_maps
from vit_ct.inspection.loading import REVIEW_READING
from vit_ct.metrics.lesion_probability import lesion_scores
from vit_ct.metrics.schema import PREDICTIONS, REVIEW
from vit_ct.metrics.sink import air_patches, class_token_shares
from vit_ct.review.summaries import gallery
from vit_ct.review.table import case_images, outcome
from vit_ct.task import ViTClassifier

METHODS = ("rollout", "gradient rollout", "last-block attention", "occlusion")  # the maps of one case


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


def case_maps(
    model: ViTClassifier, datamodule: CTSliceDataModule, row: pd.Series, *, reading: MapReading = REVIEW_READING
) -> CaseMaps:
    """Rollout, gradient rollout (class 1: lesion, for binary), last-block attention and occlusion sensitivity (the
    fall of P(lesion) with each patch at normal brain: one forward pass per patch), plus per-head and per-block
    class-token attention, of the slice of a :func:`run_review` row."""
    item = datamodule.predict_dataloader().dataset.load(int(row.name))
    image = item["image"][None].to(model.device)  # (1, C, S, S)
    explained = model.explained(image, reading=reading)
    rollout = explained.rollout
    with torch.no_grad(), record_attention(model) as attentions:  # every head
        model(image)
    prefix, grid = num_prefix_tokens(model), patch_grid(model, image.shape)
    air = air_patches(item["head"][None], grid)
    on_prefix, on_air = class_token_shares(explained.class_attention, air, prefix)
    fusion = model.hparams.rollout_head_fusion
    gradient = explain_gradient_rollout(model, image, target=1 if model.task == "binary" else None)
    last = last_block_attention(attentions, fusion, num_prefix_tokens=prefix, grid_size=grid)
    baseline = brain_baseline(image, item["head"][None].to(image.device), datamodule.windows)
    occlusion = occlusion_sensitivity(
        lambda x: lesion_scores(model.probabilities(model(x)), model.task, model.class_names), image, baseline,
        patch_size=image.shape[-1] // grid[1],
    )  # fmt: skip
    heads = per_head_maps(attentions, block=-1, num_prefix_tokens=prefix, grid_size=grid)
    blocks = per_block_maps(attentions, fusion, num_prefix_tokens=prefix, grid_size=grid)
    rows, cols = int(row["rows"]), int(row["cols"])

    def to_source(maps: torch.Tensor) -> np.ndarray:
        return to_source_grid(maps.float().cpu(), rows, cols).clamp_min(0).numpy()

    hu, mask = case_images(row, datamodule.read_options)
    named = {"rollout": rollout[0], "gradient rollout": gradient[0], "last-block attention": last[0]}
    named["occlusion"] = occlusion[0].clamp_min(0)  # what hiding lowers; where hiding raises P(lesion), nothing
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


def review_csv(table: pd.DataFrame) -> pd.DataFrame:
    """The table without its in-memory maps, for a CSV; the per-block sink shares as ``cls_prefix_b{i}`` and
    ``cls_air_b{i}`` columns, as in ``predictions.csv``."""
    out = table.drop(columns=[REVIEW.rollout, REVIEW.cls_prefix, REVIEW.cls_air], errors="ignore")
    for name in (REVIEW.cls_prefix, REVIEW.cls_air):
        if name in table and len(table):
            blocks = np.stack(table[name].to_numpy())  # (slices, blocks)
            for b in range(blocks.shape[1]):
                out[PREDICTIONS.block(name, b)] = blocks[:, b]
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
        missing = sorted(set(flagged) - set(table[REVIEW.image]))
        if missing:
            raise ValueError(f"flagged cases {missing} are not among the {len(table)} reviewed slices")
        rows = table[table[REVIEW.image].isin(list(flagged))]
    rows = review_csv(rows.assign(group=outcome(rows, threshold)))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows.to_csv(path, index=False)
    return rows
