"""``vit-ct predict`` outputs: ``predictions.csv``, one rollout map (``.npy``, source grid) and one overlay PNG
per slice, as the contract in the README describes.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
from lightning.pytorch.callbacks import BasePredictionWriter

from vit_ct.data.filecheck import atomic_write
from vit_ct.data.grid import to_source_grid
from vit_ct.data.manifest import manifest_frame
from vit_ct.data.reader import load_ct_slice, load_mask
from vit_ct.explain.overlay import render_overlay, save_png


def _slug(text: str) -> str:
    name = Path(str(text)).name
    for suffix in (".gz", ".nii", ".dcm", ".npy"):
        name = name.removesuffix(suffix)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:80] or "slice"


def save_npy(array: np.ndarray, path: Path) -> None:
    """Write a ``.npy`` atomically."""
    with atomic_write(path) as tmp, open(tmp, "wb") as f:
        np.save(f, array)


def sink_columns(prediction: dict, i: int) -> dict[str, float]:
    """Slice ``i``'s attention-sink columns: ``rollout_air``, ``rollout_outside_head``, and per block ``b``
    ``cls_prefix_b{b}`` / ``cls_air_b{b}`` (see :mod:`vit_ct.explain.sink`); none when the batch had no head mask."""
    shares = ("rollout_air", "rollout_outside_head")
    columns = {name: float(prediction[name][i]) for name in shares if name in prediction}
    for name in ("cls_prefix", "cls_air"):
        if name in prediction:
            columns.update({f"{name}_b{b}": float(v) for b, v in enumerate(prediction[name][i].tolist())})
    return columns


class PredictionWriter(BasePredictionWriter):
    """Writes each predicted slice's rollout map and overlay, then ``predictions.csv`` once all ranks are done.

    Args:
        output_dir: Folder of the outputs (created; files of the same names are replaced).
        window: (centre, width) HU of the overlay's grey image.
    """

    def __init__(self, output_dir: str | Path, *, window: tuple[float, float] = (40.0, 80.0)) -> None:
        super().__init__(write_interval="batch")
        self.output_dir = Path(output_dir)
        self.window = window
        self.rows: list[dict] = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        for sub in ("maps", "overlays"):
            (self.output_dir / sub).mkdir(parents=True, exist_ok=True)
        self.rows = []

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        dataset = trainer.predict_dataloaders.dataset
        table = dataset.table
        names = pl_module.class_names
        for i, index in enumerate(prediction["index"].tolist()):
            row = table.iloc[index]
            rows, cols = batch["source_shape"][i].tolist()
            heat = to_source_grid(prediction["rollout"][i].float().cpu(), rows, cols).clamp_min(0).numpy()
            stem = f"{index:06d}_{_slug(row['image_ref'])}"
            map_path, overlay_path = Path("maps") / f"{stem}.npy", Path("overlays") / f"{stem}.png"
            save_npy(heat.astype(np.float32), self.output_dir / map_path)
            hu = load_ct_slice(row["image"], frame=manifest_frame(row), **dataset.read_options)
            mask = load_mask(row["mask"], frame=manifest_frame(row)) if isinstance(row.get("mask"), str) else None
            save_png(render_overlay(hu, heat, mask, window=self.window), self.output_dir / overlay_path)
            record = {"index": index, "image": row["image_ref"]}
            prob = prediction["prob"][i].float().cpu()
            if prob.ndim == 0:
                record["prob"] = float(prob)
            else:
                record.update({f"prob_{name}": float(p) for name, p in zip(names, prob.tolist(), strict=True)})
            labels = pl_module.hparams.class_names if pl_module.task == "multilabel" else None
            if labels:
                known = {name: row[name] for name in labels if name in row and not pd.isna(row[name])}
                record.update({f"label_{name}": int(value) for name, value in known.items()})
            elif "label" in row and not pd.isna(row["label"]):
                record["label"] = int(row["label"])
            record.update({"rollout": map_path.as_posix(), "overlay": overlay_path.as_posix()})
            record.update(sink_columns(prediction, i))
            self.rows.append(record)

    def on_predict_epoch_end(self, trainer, pl_module) -> None:
        partial = self.output_dir / f".predictions.rank{trainer.global_rank}.csv"
        pd.DataFrame(self.rows).to_csv(partial, index=False)
        trainer.strategy.barrier()  # every rank calls it: no collective inside rank-0-only code
        if trainer.is_global_zero:
            parts = sorted(self.output_dir.glob(".predictions.rank*.csv"))
            frames = [pd.read_csv(p) for p in parts if p.stat().st_size > 1]
            # A distributed sampler repeats a few slices to even out the ranks: keep each slice once.
            table = pd.concat(frames).drop_duplicates("index").sort_values("index").drop(columns="index")
            with atomic_write(self.output_dir / "predictions.csv") as tmp:
                table.to_csv(tmp, index=False)
            for p in parts:
                p.unlink()
        trainer.strategy.barrier()
