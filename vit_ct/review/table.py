"""The review table: one row per slice of a split, the model run over it once (P(lesion), rollout, attention sink,
localisation against the lesion where there is a mask), and the slices' images and maps back on their own grid."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from vit_ct.data.io.reader import load_ct_slice, load_mask
from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.data.manifests.labels import lesion_label
from vit_ct.data.manifests.manifest import frame_number, manifest_frame
from vit_ct.data.transforms.grid import to_source_grid
from vit_ct.explain.map_reading import MapReading
from vit_ct.inspection.loading import REVIEW_READING
from vit_ct.metrics.lesion_probability import lesion_scores, scan_column
from vit_ct.metrics.localisation import MAP_SOURCES, SCORES
from vit_ct.metrics.schema import PREDICTIONS, REVIEW
from vit_ct.progress import track
from vit_ct.task import ViTClassifier
from vit_ct.task.inference import infer


def run_review(
    model: ViTClassifier,
    datamodule: CTSliceDataModule,
    *,
    threshold: float = 0.5,
    progress: bool = True,
    reading: MapReading = REVIEW_READING,
) -> pd.DataFrame:
    """Runs the model over the datamodule's ``predict_split`` (:func:`vit_ct.task.inference.infer`, the pass of
    ``vit-ct predict``, scoring the floors too) and tabulates every slice.

    Returns:
        :class:`vit_ct.metrics.schema.ReviewColumns`: one row per slice, indexed by its row in the split (``index``):
        ``image`` (as in the manifest),
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
        inference = infer(model, batch, reading, sources=MAP_SOURCES)
        prob = lesion_scores(inference.prob, model.task, model.class_names).cpu().numpy()
        lesions = lesion_label(batch["label"]).tolist()
        for i, index in enumerate(inference.index.tolist()):
            row = split_rows.iloc[index]
            label = int(lesions[i])
            mask = row.get("mask")
            records.append(
                {
                    PREDICTIONS.index: index,
                    REVIEW.image: row["image_ref"],
                    REVIEW.image_path: row["image"],
                    REVIEW.scan: row[scan_key] if scan_key else None,
                    REVIEW.mask_path: mask if isinstance(mask, str) and mask else None,
                    REVIEW.frame: manifest_frame(row),
                    REVIEW.label: pd.NA if label < 0 else label,
                    REVIEW.prob: float(prob[i]),
                    REVIEW.rows: int(batch["source_shape"][i, 0]),
                    REVIEW.cols: int(batch["source_shape"][i, 1]),
                    REVIEW.rollout: inference.rollout[i].float().cpu().numpy(),
                    REVIEW.cls_prefix: inference.sink[PREDICTIONS.cls_prefix][i].cpu().numpy(),  # per block
                    REVIEW.cls_air: inference.sink[PREDICTIONS.cls_air][i].cpu().numpy(),
                    **{name: float(inference.sink[name][i]) for name in inference.shares},
                    **inference.score_columns(i),
                }
            )
    table = pd.DataFrame(records).set_index(PREDICTIONS.index)
    table[REVIEW.label] = table[REVIEW.label].astype("Int64")
    table.attrs["read_options"] = dict(datamodule.read_options)  # how case_images reads the slices again
    for column in (PREDICTIONS.score(source, name) for source in MAP_SOURCES for name in SCORES):
        if column not in table:
            table[column] = np.nan
    table.insert(table.columns.get_loc(REVIEW.prob) + 1, REVIEW.group, outcome(table, threshold))
    return table


def source_map(row: pd.Series, column: str = REVIEW.rollout) -> np.ndarray:
    """A patch-grid map of a table row on the source slice's rows x columns (as ``vit-ct predict`` writes it)."""
    grid = torch.as_tensor(np.asarray(row[column], dtype=np.float32))
    return to_source_grid(grid, int(row[REVIEW.rows]), int(row[REVIEW.cols])).clamp_min(0).numpy()


def case_images(row: pd.Series, read_options: dict | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """The source slice in HU and its lesion mask (None without one), read with ``read_options`` (of
    :func:`load_ct_slice`; the review table's ``attrs["read_options"]``, as the model's data module read it)."""
    frame = frame_number(row.get(REVIEW.frame))
    hu = load_ct_slice(row[REVIEW.image_path], frame=frame, **(read_options or {}))
    mask_path = row.get(REVIEW.mask_path)
    mask = load_mask(mask_path, frame=frame) if isinstance(mask_path, str) else None
    return hu, mask


def outcome(table: pd.DataFrame, threshold: float = 0.5) -> pd.Series:
    """``TP``, ``FP``, ``FN``, ``TN`` per slice (``prob > threshold`` is positive, as in torchmetrics), or
    ``unlabelled``."""
    predicted = table[REVIEW.prob].to_numpy() > threshold
    label = table[REVIEW.label].astype("Int64")
    lesion = (label == 1).fillna(False).to_numpy(dtype=bool)
    codes = np.where(predicted, np.where(lesion, "TP", "FP"), np.where(lesion, "FN", "TN"))
    return pd.Series(np.where(label.isna().to_numpy(), "unlabelled", codes), index=table.index, name=REVIEW.group)
