"""The review table: one row per slice of a split, the model run over it once (P(lesion), rollout, attention sink,
localisation against the lesion where there is a mask), and the slices' images and maps back on their own grid."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from vit_ct.data.io.reader import load_ct_slice, load_mask
from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.data.manifests.labels import lesion_label
from vit_ct.data.transforms.grid import to_source_grid
from vit_ct.explain.maps import localisation_maps
from vit_ct.metrics.lesion_probability import lesion_scores, scan_column
from vit_ct.metrics.localisation import MAP_SOURCES, SCORES, scores_per_slice
from vit_ct.metrics.sink import sink_per_slice
from vit_ct.model import ViTClassifier
from vit_ct.progress import track


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
        (:func:`vit_ct.metrics.sink.sink_per_slice`: ``rollout_air``, ``rollout_outside_head``, and ``cls_prefix`` /
        ``cls_air`` arrays with one share per block), and per map source (``rollout``, ``floor_image``,
        ``floor_head``, ``perfect_patch``) the localisation scores ``{source}_{score}`` on the model grid, as the
        model's ``test/`` metrics, NaN where the slice has no lesion mask.
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
        prob = lesion_scores(model.probabilities(logits), model.task, model.class_names).cpu().numpy()
        lesions = lesion_label(batch["label"]).tolist()
        sink = sink_per_slice(rollout, explained.class_attention, batch["head"], model.num_prefix)
        scores = {name: sink[name] for name in ("rollout_air", "rollout_outside_head")}
        if batch["has_mask"].any():
            maps = localisation_maps(model, batch, rollout=rollout)
            per_slice = scores_per_slice(maps, batch, tolerance_mm=model.hparams.localisation_tolerance_mm)
            scores.update({name: values.cpu().numpy() for name, values in per_slice.items()})
        for i, index in enumerate(batch["index"].tolist()):
            row = split_rows.iloc[index]
            label = int(lesions[i])
            mask = row.get("mask")
            records.append(
                {
                    "index": index,
                    "image": row["image_ref"],
                    "image_path": row["image"],
                    "scan": row[scan_key] if scan_key else None,
                    "mask_path": mask if isinstance(mask, str) and mask else None,
                    "frame": None if pd.isna(row.get("slice", pd.NA)) else int(row["slice"]),
                    "label": pd.NA if label < 0 else label,
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


def outcome(table: pd.DataFrame, threshold: float = 0.5) -> pd.Series:
    """``TP``, ``FP``, ``FN``, ``TN`` per slice (``prob > threshold`` is positive, as in torchmetrics), or
    ``unlabelled``."""
    predicted = table["prob"].to_numpy() > threshold
    label = table["label"].astype("Int64")
    lesion = (label == 1).fillna(False).to_numpy(dtype=bool)
    codes = np.where(predicted, np.where(lesion, "TP", "FP"), np.where(lesion, "FN", "TN"))
    return pd.Series(np.where(label.isna().to_numpy(), "unlabelled", codes), index=table.index, name="group")
