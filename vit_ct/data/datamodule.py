"""CT slices listed in a manifest CSV, as windowed tensors on the model grid, in typed batches.

``CTSliceDataModule`` reads the user's own manifest (the built-in synthetic set's data module,
:class:`vit_ct.sim.synthetic.SyntheticCTDataModule`, reads the set it generates through exactly this path).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, TypedDict

import lightning as L
import numpy as np
import pandas as pd
import torch
from lightning.pytorch.utilities import rank_zero_warn
from monai import transforms as mt
from monai.data.utils import worker_init_fn
from rich.progress import track
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler

from vit_ct.data.distributed import EpochShuffleSampler, MarkedPaddingSampler, ResumableDataLoader, decode_index, global_seed
from vit_ct.data.grid import to_model_grid
from vit_ct.data.manifest import manifest_frame, assign_splits, check_label_range, read_manifest, validate_manifest_files, write_bad_files
from vit_ct.data.reader import load_ct_slice, load_mask, read_pixel_spacing
from vit_ct.data.scans import Scan, Skipped, find_scans, scan_table
from vit_ct.data.splits import SPLIT_FRACTIONS
from vit_ct.data.windows import AIR_HU, parse_windows, stack_windows

HEAD_HU = -300.0  # above it: tissue, not air (fat is -100)
Window = str | tuple[float, float]


class CTBatch(TypedDict):
    """One batch. ``B`` slices, ``C`` windows, ``S`` = ``img_size``."""

    image: torch.Tensor  # (B, C, S, S) windowed HU in [0, 1]
    mask: torch.Tensor  # (B, 1, S, S) lesion mask, 0/1; zeros where unknown
    head: torch.Tensor  # (B, 1, S, S) head (not air) mask, 0/1: where localisation is scored
    has_mask: torch.Tensor  # (B,) bool: a mask file was given
    label: torch.Tensor  # (B,) int64 class, or (B, L) int64 0/1 for multi-label; -1 where unknown (prediction)
    index: torch.Tensor  # (B,) row of the split's table
    valid: torch.Tensor  # (B,) bool: False on a repeat that pads a DDP shard (metrics skip it)
    source_shape: torch.Tensor  # (B, 2) rows, columns of the source slice
    pixel_spacing_mm: torch.Tensor  # (B,) mm per model-grid pixel; NaN where the file gives no spacing


def slice_item(
    hu: np.ndarray,
    mask: np.ndarray | None,
    *,
    label: torch.Tensor,
    index: int,
    windows: Sequence[tuple[float, float]],
    img_size: int,
    pixel_spacing_mm: tuple[float, float] | None = None,
) -> dict:
    """One slice as a :class:`CTBatch` item (all keys but ``valid``) on the model grid.

    Args:
        hu: Slice ``(rows, cols)`` in HU.
        mask: Lesion mask ``(rows, cols)``, 0/1; None when unknown (an empty mask, ``has_mask`` False).
        label: Class, or 0/1 per label for multi-label data.
        index: Row of the split's table.
        windows: HU windows, one channel each.
        img_size: Side of the model input.
        pixel_spacing_mm: The source slice's (row, column) spacing in mm; None when unknown.
    """
    rows, cols = hu.shape
    has_mask = mask is not None
    # Pad in HU with air before windowing, so the padding is air in every window.
    hu = to_model_grid(torch.from_numpy(hu)[None], img_size, fill=AIR_HU)
    image = torch.from_numpy(stack_windows(hu[0].numpy(), windows))
    if has_mask:
        mask = torch.from_numpy(mask.astype(np.float32))[None]
        mask = (to_model_grid(mask, img_size, mode="area") >= 0.5).float()
    else:
        mask = torch.zeros(1, img_size, img_size)
    return {
        "image": image,
        "mask": mask,
        "head": (hu > HEAD_HU).float(),  # padding is air, so it is outside the head too
        "has_mask": torch.tensor(has_mask),
        "label": label,
        "index": torch.tensor(index),
        "source_shape": torch.tensor([rows, cols]),
        "pixel_spacing_mm": torch.tensor(model_grid_spacing(pixel_spacing_mm, (rows, cols), img_size)),
    }


def model_grid_spacing(spacing_mm: tuple[float, float] | None, shape: tuple[int, int], img_size: int) -> float:
    """mm per pixel of the model grid: the slice is padded to a square of its longer side, then resized to
    ``img_size``. The mean of row and column spacing (they differ little in CT); NaN when the spacing is unknown."""
    if spacing_mm is None:
        return math.nan
    return (spacing_mm[0] + spacing_mm[1]) / 2 * max(shape) / img_size


class CTSliceDataset(Dataset):
    """Rows of a manifest table as :class:`CTBatch` items.

    Args:
        table: Rows of one split (see :func:`vit_ct.data.manifest.read_manifest`).
        windows: HU windows, one channel each.
        img_size: Side of the model input.
        label_columns: Multi-label columns; None reads ``label``.
        transform: MONAI dictionary transform over ``image`` and ``mask`` (training augmentation).
        cache: Keep every preprocessed slice in memory after the first read.
    """

    def __init__(
        self,
        table: pd.DataFrame,
        *,
        windows: Sequence[tuple[float, float]],
        img_size: int,
        label_columns: Sequence[str] | None = None,
        transform=None,
        cache: bool = False,
    ) -> None:
        self.table = table.reset_index(drop=True)
        self.windows = list(windows)
        self.img_size = img_size
        self.label_columns = list(label_columns) if label_columns else None
        self.transform = transform
        self._cache: dict[int, dict] | None = {} if cache else None

    def __len__(self) -> int:
        return len(self.table)

    def load(self, index: int) -> dict:
        """Windowed slice and mask of row ``index`` on the model grid, before augmentation."""
        if self._cache is not None and index in self._cache:
            return self._cache[index]
        row = self.table.iloc[index]
        hu = load_ct_slice(row["image"], frame=manifest_frame(row))
        mask_path = row.get("mask")
        has_mask = isinstance(mask_path, str) and bool(mask_path)
        mask = load_mask(mask_path, frame=manifest_frame(row)) if has_mask else None
        if self.label_columns:
            # int64, as torchmetrics wants its targets; the loss takes them as float
            label = torch.tensor(row[self.label_columns].astype("Int64").fillna(-1).to_numpy(dtype=np.int64))
        else:
            label = torch.tensor(-1 if pd.isna(row["label"]) else int(row["label"]))
        spacing = read_pixel_spacing(row["image"], frame=manifest_frame(row))
        item = slice_item(
            hu, mask, label=label, index=index, windows=self.windows, img_size=self.img_size, pixel_spacing_mm=spacing
        )
        if self._cache is not None:
            self._cache[index] = item
        return item

    def fill_cache(self, description: str, indices: Sequence[int] | None = None) -> None:
        """Read the rows ``indices`` (default: every row) now, with a progress bar (no-op without a cache).

        Filled before the DataLoader starts its workers, so they share the cache instead of each filling its own.
        """
        if self._cache is not None:
            rows = range(len(self)) if indices is None else sorted(set(indices))
            for index in track(rows, description=description, transient=True):
                self.load(index)

    def __getitem__(self, index: int) -> CTBatch:
        index, valid = decode_index(index)  # a DDP padding repeat arrives as -1 - index (vit_ct.data.distributed)
        item = dict(self.load(index), valid=torch.tensor(valid))
        if self.transform is not None:
            out = self.transform({"image": item["image"], "mask": item["mask"], "head": item["head"]})
            item["image"] = torch.as_tensor(out["image"]).float()
            item["mask"] = (torch.as_tensor(out["mask"]) > 0.5).float()
            item["head"] = (torch.as_tensor(out["head"]) > 0.5).float()
        return item


class RandWindowedNoised(mt.RandGaussianNoised):
    """Gaussian noise on the pixels a window shows, the way noise in HU looks once windowed: a pixel a window clips
    (air below it, bone above it) stays clipped. Noise added to the clipped floor would turn air into faint tissue,
    which no scanner produces and which the model's air mask (``ViTClassifier(mask_air=True)``) would then miss."""

    def __call__(self, data):
        before = {key: torch.as_tensor(data[key]) for key in self.key_iterator(data)}
        out = super().__call__(data)
        for key, image in before.items():
            shown = (image > 0) & (image < 1)
            out[key] = torch.where(shown, torch.as_tensor(out[key]).clamp(0, 1), image)
        return out


def train_augmentation(img_size: int):
    """MONAI geometric + intensity augmentation; the mask follows every geometric transform."""
    keys = ["image", "mask", "head"]
    return mt.Compose(
        [
            mt.RandFlipd(keys, prob=0.5, spatial_axis=1),  # left-right: heads are near symmetric
            mt.RandAffined(
                keys,
                prob=0.8,
                rotate_range=math.pi / 12,
                scale_range=0.1,
                translate_range=0.06 * img_size,
                mode=("bilinear", "nearest", "nearest"),
                padding_mode="zeros",
            ),
            RandWindowedNoised("image", prob=0.3, std=0.02),
            mt.RandAdjustContrastd("image", prob=0.3, gamma=(0.8, 1.25)),
        ]
    )


class CTSliceDataModule(L.LightningDataModule):
    """CT slices from a manifest CSV (columns ``image``, ``label``, optional ``patient_id``, ``split``, ``mask``,
    ``slice``; see the README).

    Args:
        manifest: Path of the manifest CSV.
        windows: HU windows stacked as channels: preset names (``brain``, ``subdural``, ``bone``, ``stroke``) or
            ``[centre, width]`` pairs. ``["brain", "subdural", "bone"]`` is the RSNA 3-channel input.
        img_size: Side of the square model input; slices are padded to square with air and resized.
        label_columns: Multi-label data: the names of its 0/1 label columns (instead of ``label``).
        batch_size: Slices per batch (per device under DDP).
        num_workers: DataLoader worker processes.
        augment: Random flips, rotations, scaling, shifts, noise and contrast on the training split.
        cache: Keep preprocessed slices in memory, read before the first epoch (fast epochs for sets that fit).
            Under DDP each rank caches only its shard of the evaluation splits, but the whole training split (its
            shards are dealt anew every epoch).
        split_fractions: Train/val/test fractions of patients for rows without a ``split``.
        split_seed: Seed of that patient-level split.
        predict_split: Split that ``predict`` covers; None covers every row of the manifest.
        on_bad_file: ``raise``: check every file up front and stop, listing each bad row; ``skip``: leave bad rows
            out and list them in ``bad_files.csv`` in the run folder (named in the log).
        weighted_sampler: Draw training slices with inverse class frequency (against class imbalance).
        scans: Predict on whole scans instead of a manifest: DICOM folders (one series, or a tree of studies and
            series) and NIfTI volumes, one path or a list (``[a, b]``). Slices are grouped by series and ordered along the slice normal; objects that
            are not CT slices are skipped and listed in ``skipped.csv`` of the output folder.
    """

    def __init__(
        self,
        manifest: str | None = None,
        *,
        scans: str | list[str] | None = None,
        windows: Window | list[Window] = "brain",
        img_size: int = 128,
        label_columns: list[str] | None = None,
        batch_size: int = 32,
        num_workers: int = 2,
        augment: bool = True,
        cache: bool = True,
        split_fractions: tuple[float, float, float] = SPLIT_FRACTIONS,
        split_seed: int = 0,
        predict_split: Literal["train", "val", "test"] | None = None,
        on_bad_file: Literal["raise", "skip"] = "raise",
        weighted_sampler: bool = False,
    ) -> None:
        super().__init__()
        if manifest is not None and scans:
            raise ValueError("give data.manifest or data.scans, not both")
        self.manifest = manifest
        self.scans = ([scans] if isinstance(scans, str) else list(scans)) if scans else None
        self.found_scans: list[Scan] = []
        self.skipped_objects: list[Skipped] = []  # files under `scans` that are not CT slices
        self.windows = parse_windows(windows)
        if img_size <= 0:
            raise ValueError(f"img_size must be positive, got {img_size}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if abs(sum(split_fractions) - 1.0) > 1e-6 or min(split_fractions) < 0:
            raise ValueError(f"split_fractions must be three non-negative numbers summing to 1, got {split_fractions}")
        self.img_size = img_size
        self.label_columns = label_columns
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.augment = augment
        self.cache = cache
        self.split_fractions = tuple(split_fractions)
        self.split_seed = split_seed
        self.predict_split = predict_split
        self.on_bad_file = on_bad_file
        self.weighted_sampler = weighted_sampler
        self.table: pd.DataFrame | None = None
        self.bad_rows: list = []
        self.bad_rows_report: Path | None = None  # bad_files.csv, written when on_bad_file="skip" left rows out
        self._labelled = False  # whether `table` was read requiring labels
        self.datasets: dict[str, CTSliceDataset] = {}

    @property
    def num_channels(self) -> int:
        """Input channels of the model: one per window."""
        return len(self.windows)

    def manifest_path(self) -> Path:
        if self.manifest is None:
            raise ValueError("data.manifest is not set: pass --data.manifest PATH.csv")
        return Path(self.manifest)

    def load_table(self, *, require_labels: bool = True) -> pd.DataFrame:
        """The whole manifest, split by patient where it gives no split, with bad files handled.

        Args:
            require_labels: False for prediction, where rows (or the whole manifest) may be unlabelled.
        """
        if self.scans is not None:
            return self._scan_rows(require_labels)
        if self.table is None or (require_labels and not self._labelled):
            path = self.manifest_path()
            table = read_manifest(path, label_columns=self.label_columns, require_labels=require_labels)
            table = assign_splits(table, fractions=self.split_fractions, seed=self.split_seed)
            self.table, self.bad_rows = validate_manifest_files(table, on_bad_file=self.on_bad_file)
            self._labelled = require_labels
        return self.table

    def _scan_rows(self, require_labels: bool) -> pd.DataFrame:
        """The slices of ``scans`` as manifest rows (unlabelled, no split), read once."""
        if require_labels:
            raise ValueError(
                "data.scans carry no labels, so they serve `vit-ct predict` only; to train or test on them, write a"
                " manifest with `vit-ct manifest FOLDER --output my.csv`, fill in its label column and pass"
                " --data.manifest my.csv"
            )
        if self.table is None:
            self.found_scans, self.skipped_objects = find_scans(self.scans)
            table = scan_table(self.found_scans)
            table["image_ref"] = table["image"]
            table["label"] = pd.array([pd.NA] * len(table), dtype="Int64")
            table["split"] = None
            table.attrs.update(label_columns=None, manifest=None)
            self.table, self.bad_rows = validate_manifest_files(table, on_bad_file=self.on_bad_file)
        return self.table

    def check(self, stage: str, *, num_classes: int | None = None) -> None:
        """Read the manifest and check its rows, files and labels now, so bad input stops a run before it starts.

        Args:
            stage: ``fit``, ``validate``, ``test`` or ``predict`` (whose rows may be unlabelled).
            num_classes: Outputs of the model; single-label classes must be below it.

        Raises:
            ValueError: naming the manifest and its lines at fault: missing columns, bad labels or split names,
                unusable files with ``on_bad_file="raise"``, labels out of range for ``num_classes``.
        """
        table = self.load_table(require_labels=stage != "predict")
        if num_classes is not None:
            check_label_range(table, num_classes)

    def report_bad_rows(self, folder: str | Path) -> Path | None:
        """Write the rows ``on_bad_file="skip"`` left out to ``folder/bad_files.csv``, once, and name it in the log.

        Under ``vit-ct`` the run folder is chosen by a callback of the CLI once the run exists; without a trainer,
        :meth:`setup` writes it beside the manifest.
        """
        if not self.bad_rows or self.bad_rows_report is not None:
            return self.bad_rows_report
        self.bad_rows_report = write_bad_files(self.bad_rows, Path(folder) / "bad_files.csv")
        rank_zero_warn(
            f"{len({b.line for b in self.bad_rows})} manifest rows name unusable files and were skipped;"
            f" listed in {self.bad_rows_report}"
        )
        return self.bad_rows_report

    def split_table(self, split: str | None) -> pd.DataFrame:
        table = self.load_table() if self.table is None else self.table  # as `setup` read it (labelled or not)
        return table if split is None else table[table["split"] == split]

    def _dataset(self, split: str | None, *, train: bool = False) -> CTSliceDataset:
        key = split or "all"
        if key not in self.datasets:
            table = self.split_table(split)
            if table.empty:
                raise ValueError(f"manifest {self.manifest} has no rows in split {key!r}")
            self.datasets[key] = CTSliceDataset(
                table,
                windows=self.windows,
                img_size=self.img_size,
                label_columns=self.label_columns,
                cache=self.cache,
            )
            indices, ranks = None, self._ranks()
            if split != "train" and ranks.get("num_replicas", 1) > 1:
                # An evaluation shard is fixed (in order, rank::world), so each rank caches only the slices it reads.
                # Training shards are dealt anew every epoch: each rank caches the whole training split.
                indices = [decode_index(i)[0] for i in MarkedPaddingSampler(self.datasets[key], **ranks)]
            self.datasets[key].fill_cache(f"reading {key} slices", indices)
        dataset = self.datasets[key]
        if train and self.augment:
            dataset = CTSliceDataset(
                dataset.table,
                windows=self.windows,
                img_size=self.img_size,
                label_columns=self.label_columns,
                transform=train_augmentation(self.img_size).set_random_state(seed=global_seed()),
            )
            dataset._cache = self.datasets[key]._cache  # share the preprocessed slices
        return dataset

    def setup(self, stage: str) -> None:
        model = self.trainer.lightning_module if self.trainer is not None else None
        self.check(stage, num_classes=getattr(model, "hparams", {}).get("num_classes"))
        if self.trainer is None:
            self.report_bad_rows(self.manifest_path().resolve().parent)
        if stage == "fit":
            self._dataset("train", train=True)
            self._dataset("val")
        elif stage in ("validate", "test"):
            self._dataset("val" if stage == "validate" else "test")
        elif stage == "predict":
            self._dataset(self.predict_split)

    def _loader(self, dataset: Dataset, *, shuffle: bool = False, sampler=None) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle and sampler is None,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            worker_init_fn=worker_init_fn,  # each worker reseeds MONAI's random transforms (not shared copies)
            drop_last=False,
        )

    def _ranks(self) -> dict[str, int]:
        """``num_replicas`` and ``rank`` of this process under a multi-process strategy, else empty."""
        trainer = self.trainer
        kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
        return {"num_replicas": kwargs["num_replicas"], "rank": kwargs["rank"]} if kwargs else {}

    def train_dataloader(self) -> DataLoader:
        dataset = self._dataset("train", train=True)
        if self.weighted_sampler and not self.label_columns:
            labels = dataset.table["label"].to_numpy(dtype=int)
            weights = 1.0 / np.bincount(labels)[labels]
            sampler = WeightedRandomSampler(torch.as_tensor(weights, dtype=torch.double), len(labels))
            return self._loader(dataset, sampler=sampler)  # Lightning shards it under DDP
        # Our own shuffle (also for one process): its order depends on (seed, epoch) only, so resuming is exact.
        sampler = EpochShuffleSampler(dataset, seed=global_seed(), **self._ranks())
        return ResumableDataLoader(
            dataset,
            sampler=sampler,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            worker_init_fn=worker_init_fn,  # each worker reseeds MONAI's random transforms (not shared copies)
            drop_last=False,
        )

    def _evaluation_loader(self, dataset: CTSliceDataset) -> DataLoader:
        ranks = self._ranks()
        if ranks.get("num_replicas", 1) > 1:  # pad the shards with marked repeats, never count a slice twice
            return self._loader(dataset, sampler=MarkedPaddingSampler(dataset, **ranks))
        return self._loader(dataset)

    def val_dataloader(self) -> DataLoader:
        return self._evaluation_loader(self._dataset("val"))

    def test_dataloader(self) -> DataLoader:
        return self._evaluation_loader(self._dataset("test"))

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self._dataset(self.predict_split))
