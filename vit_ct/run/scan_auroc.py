"""Scan-level AUROC during validation and test (:mod:`vit_ct.metrics.lesion_probability`): a scan's probability is the
maximum over its slices, and a scan is positive when its scan label says so or, without scan labels, when any of its
slices is. A callback: it needs the split's table to group the slices of a batch into scans."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from vit_ct.data.manifests.labels import lesion_labels, scan_lesion_labels
from vit_ct.metrics.lesion_probability import lesion_scores, scan_auroc, scan_column, scan_summary


class ScanAUROC(Callback):
    """Logs ``val/scan_auroc`` and ``test/scan_auroc`` when the split's rows name their scan (a ``scan`` column, as
    ``vit-ct manifest`` writes, else ``patient_id``: one scan per patient) and the scans hold both classes."""

    def __init__(self) -> None:
        self._scores: list[tuple[int, float]] = []

    def _start(self, *_) -> None:
        self._scores = []

    on_validation_epoch_start = on_test_epoch_start = _start

    def _batch(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if isinstance(outputs, dict) and "prob" in outputs:
            scores = lesion_scores(outputs["prob"].float(), pl_module.task, pl_module.class_names).cpu().tolist()
            self._scores += list(zip(outputs["index"].cpu().tolist(), scores, strict=True))

    on_validation_batch_end = on_test_batch_end = _batch

    def _end(self, trainer, pl_module, stage: str) -> None:
        dataset = getattr(trainer.datamodule, "datasets", {}).get(stage)
        table = getattr(dataset, "table", None)
        if table is None or trainer.sanity_checking:
            return
        scores = self._scores
        if dist.is_available() and dist.is_initialized():  # every rank holds its shard's slices
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, scores)
            scores = [s for part in parts for s in part]
        key = scan_column(table)
        if key is None or not scores:
            return
        index, probs = (np.array(v) for v in zip(*dict(scores).items(), strict=True))
        rows = table.iloc[index]
        slices = pd.DataFrame(
            {
                key: rows[key].to_numpy(),
                "order": index,
                "image": rows["image_ref"].to_numpy(),
                "p_lesion": probs,
                "positive": _lesion(table).iloc[index].to_numpy(),
            }
        )
        auroc = scan_auroc(scan_summary(slices, key))
        if np.isfinite(auroc):
            pl_module.log(f"{stage}/scan_auroc", auroc)  # the same on every rank

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        self._end(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        self._end(trainer, pl_module, "test")


def _lesion(table: pd.DataFrame) -> pd.Series:
    """Each row's lesion label for its scan's: the scan label where the manifest gives scan labels, else the slice's
    (a scan then holds a lesion when one of its slices does)."""
    scans = scan_lesion_labels(table)
    return lesion_labels(table, table.attrs.get("label_columns")) if scans is None else scans
