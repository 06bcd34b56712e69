"""W&B media for attention rollout (arXiv:2005.00928): overlays of a fixed set of validation slices every few
epochs, and a table of test predictions with their overlays.
"""

from __future__ import annotations

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_warn

from vit_ct.data.manifests.labels import lesion_rows
from vit_ct.explain.maps import upsampled_rollout
from vit_ct.explain.overlay import render_overlay

# `render_overlay` windows HU; the model input is already windowed to [0, 1], which this window leaves unchanged.
IDENTITY_WINDOW = (0.5, 1.0)


def _wandb_logger(trainer) -> WandbLogger | None:
    return next((logger for logger in trainer.loggers if isinstance(logger, WandbLogger)), None)


def _split_dataset(trainer, split: str):
    """The datamodule's preprocessed dataset of ``split`` (``CTSliceDataModule.datasets``), or None."""
    dataset = getattr(trainer.datamodule, "datasets", {}).get(split)
    return dataset if hasattr(dataset, "load") else None


def _has_mask(table) -> np.ndarray:
    if "mask" not in table.columns:
        return np.zeros(len(table), dtype=bool)
    return np.array([isinstance(m, str) and bool(m) for m in table["mask"]])


class RolloutOverlayCallback(Callback):
    """Logs attention-rollout overlays to W&B; does nothing without a ``WandbLogger``.

    Validation: every ``every_n_epochs`` epochs, the same slices each time (chosen once by dataset index: the first
    ``n_slices`` positives with a lesion mask, then the first ``n_negatives`` negatives), as ``val/rollout_overlays``
    with the lesion mask as a W&B mask layer. Test end: ``test/predictions``, a table of the first ``table_slices``
    test slices (index, image, label, probability, overlay).

    Every rank computes the same few maps (so sharded models stay in step); only rank 0 logs, with no collective
    call inside.

    Args:
        every_n_epochs: Validation epochs between overlays.
        n_slices: Positive slices with a lesion mask to show.
        n_negatives: Negative slices to show beside them.
        table_slices: Test slices in the predictions table; None: all.
        batch_size: Slices per forward pass.
    """

    def __init__(
        self,
        *,
        every_n_epochs: int = 1,
        n_slices: int = 4,
        n_negatives: int = 2,
        table_slices: int | None = 64,
        batch_size: int = 16,
    ) -> None:
        if every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be >= 1, got {every_n_epochs}")
        if n_slices < 0 or n_negatives < 0 or (table_slices is not None and table_slices < 0) or batch_size < 1:
            raise ValueError("n_slices, n_negatives and table_slices must be >= 0 and batch_size >= 1")
        self.every_n_epochs = every_n_epochs
        self.n_slices = n_slices
        self.n_negatives = n_negatives
        self.table_slices = table_slices
        self.batch_size = batch_size
        self.val_indices: list[int] | None = None

    def _choose_val_slices(self, dataset) -> list[int]:
        positive = lesion_rows(dataset.table, dataset.label_columns)
        chosen = np.flatnonzero(positive & _has_mask(dataset.table))[: self.n_slices]
        negatives = np.flatnonzero(~positive)[: self.n_negatives]
        return sorted(int(i) for i in np.concatenate([chosen, negatives]))

    def _overlays(self, pl_module, dataset, indices: list[int]) -> list[dict]:
        """Per slice: index, label, probabilities, overlay RGB ``(S, S, 3)`` and lesion mask (when known)."""
        was_training = pl_module.training
        pl_module.eval()
        rows = []
        try:
            for start in range(0, len(indices), self.batch_size):
                items = [dataset.load(i) for i in indices[start : start + self.batch_size]]
                image = torch.stack([item["image"] for item in items]).to(pl_module.device)  # (B, C, S, S)
                logits, heat = upsampled_rollout(pl_module, image)
                probs = pl_module.probabilities(logits).cpu()
                for item, p, h, x in zip(items, probs, heat.cpu().numpy(), image[:, 0].cpu().numpy(), strict=True):
                    mask = item["mask"][0].numpy() > 0.5 if bool(item["has_mask"]) else None
                    rows.append(
                        {
                            "index": int(item["index"]),
                            "label": item["label"].tolist(),
                            "prob": p.tolist(),
                            "overlay": render_overlay(x, h, mask, window=IDENTITY_WINDOW),
                            "mask": mask,
                        }
                    )
        finally:
            pl_module.train(was_training)
        return rows

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        logger = _wandb_logger(trainer)
        if logger is None or trainer.sanity_checking or (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        dataset = _split_dataset(trainer, "val")
        if dataset is None:
            rank_zero_warn("RolloutOverlayCallback: the datamodule has no `datasets['val']`; no overlays logged")
            return
        if self.val_indices is None:
            self.val_indices = self._choose_val_slices(dataset)
        if not self.val_indices:
            return
        rows = self._overlays(pl_module, dataset, self.val_indices)
        if not trainer.is_global_zero:
            return
        masks = [
            {"lesion": {"mask_data": row["mask"].astype(np.uint8), "class_labels": {1: "lesion"}}}
            if row["mask"] is not None
            else None
            for row in rows
        ]
        logger.log_image(
            "val/rollout_overlays",
            [row["overlay"] for row in rows],
            step=trainer.global_step,
            caption=[f"#{row['index']} label {row['label']} P={_format_prob(row['prob'])}" for row in rows],
            masks=masks,
        )

    def on_test_end(self, trainer, pl_module) -> None:
        logger = _wandb_logger(trainer)
        if logger is None:
            return
        dataset = _split_dataset(trainer, "test")
        if dataset is None:
            rank_zero_warn("RolloutOverlayCallback: the datamodule has no `datasets['test']`; no table logged")
            return
        indices = list(range(len(dataset)))[: self.table_slices]
        rows = self._overlays(pl_module, dataset, indices)
        if not trainer.is_global_zero:
            return
        import wandb

        # W&B stores a table holding images as a run artifact (staged under WANDB_DATA_DIR until synced)
        table = wandb.Table(columns=["index", "image", "label", "probability", "overlay"])
        images = dataset.table["image_ref" if "image_ref" in dataset.table else "image"]
        for row in rows:
            label = row["label"] if isinstance(row["label"], int) else str(row["label"])  # multi-label: as text
            overlay = wandb.Image(row["overlay"], caption=f"#{row['index']}")
            table.add_data(row["index"], str(images.iloc[row["index"]]), label, _format_prob(row["prob"]), overlay)
        logger.experiment.log({"test/predictions": table, "trainer/global_step": trainer.global_step})


def _format_prob(prob: float | list[float]) -> str | float:
    """P(lesion) as a number; several class or label probabilities as text."""
    if isinstance(prob, float):
        return round(prob, 4)
    return ", ".join(f"{p:.3f}" for p in prob)
