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
from rich.progress import track
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler

from vit_ct.data.augment import BatchAugmentation
from vit_ct.data.contract import InputContract
from vit_ct.data.distributed import (
    EpochShuffleSampler,
    MarkedPaddingSampler,
    ResumableDataLoader,
    decode_index,
    global_seed,
)
from vit_ct.data.grid import to_model_grid
from vit_ct.data.manifest import (
    assign_splits,
    check_label_range,
    manifest_frame,
    read_manifest,
    validate_manifest_files,
    write_bad_files,
)
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
        cache: Keep every preprocessed slice in memory after the first read.
        read_options: Keyword arguments of :func:`~vit_ct.data.reader.load_ct_slice` (``modalities``,
            ``stored_values_are_hu``).
    """

    def __init__(
        self,
        table: pd.DataFrame,
        *,
        windows: Sequence[tuple[float, float]],
        img_size: int,
        label_columns: Sequence[str] | None = None,
        cache: bool = False,
        read_options: dict | None = None,
    ) -> None:
        self.table = table.reset_index(drop=True)
        self.read_options = dict(read_options or {})
        self.windows = list(windows)
        self.img_size = img_size
        self.label_columns = list(label_columns) if label_columns else None
        self._cache: dict[int, dict] | None = {} if cache else None

    def __len__(self) -> int:
        return len(self.table)

    def load(self, index: int) -> dict:
        """Windowed slice and mask of row ``index`` on the model grid, before augmentation."""
        if self._cache is not None and index in self._cache:
            return self._cache[index]
        row = self.table.iloc[index]
        hu = load_ct_slice(row["image"], frame=manifest_frame(row), **self.read_options)
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
        return dict(self.load(index), valid=torch.tensor(valid))


class CTSliceDataModule(L.LightningDataModule):
    """CT slices from a manifest CSV (columns ``image``, ``label``, optional ``patient_id``, ``split``, ``mask``,
    ``slice``; see the README).

    Args:
        manifest: Path of the manifest CSV.
        windows: HU windows stacked as channels: preset names (``brain``, ``subdural``, ``bone``, ``stroke``) or
            ``[centre, width]`` pairs. ``["brain", "subdural", "bone"]`` is the RSNA 3-channel input. With a
            checkpoint (``--ckpt_path``, ``--model.weights``) the command takes the checkpoint's windows.
        img_size: Side of the square model input; slices are padded to square with air and resized. With a
            checkpoint the command takes the checkpoint's input size.
        label_columns: Multi-label data: the names of its 0/1 label columns (instead of ``label``).
        batch_size: Slices per batch (per device under DDP).
        num_workers: DataLoader worker processes.
        augment: Random flips, rotations, scaling, shifts, noise and contrast on the training split, applied to whole
            batches on the training device (:class:`~vit_ct.data.augment.BatchAugmentation`), after the cache.
        cache: Keep preprocessed slices in memory, read before the first epoch (fast epochs for sets that fit).
            Under DDP each rank caches only its shard of the evaluation splits, but the whole training split (its
            shards are dealt anew every epoch).
        split_fractions: Train/val/test fractions of patients for rows without a ``split``.
        split_seed: Seed of that patient-level split.
        predict_split: Split that ``predict`` covers; None covers every row of the manifest.
        on_bad_file: ``raise``: check every file up front and stop, listing each bad row; ``skip``: leave bad rows
            out and list them in ``bad_files.csv`` in the run folder (named in the log).
        weighted_sampler: Draw training slices with inverse class frequency (against class imbalance).
        modalities: DICOM Modality values accepted as HU; other modalities (MR, NM, RT dose, ...) are bad files.
            ``null`` accepts any file and takes its values as they are.
        stored_values_are_hu: Accept CT DICOM without rescale slope/intercept, taking stored values as HU (by
            default such files are bad files: some scanners store HU + 1024).
        scans: Predict on whole scans instead of a manifest: DICOM folders (one series, or a tree of studies and
            series) and NIfTI volumes, one path or a list (``[a, b]``). Slices are grouped by series and ordered along
            the slice normal; objects that are not CT slices are skipped and listed in ``skipped.csv`` of the output
            folder.
    """

    def __init__(
        self,
        manifest: str | None = None,
        *,
        scans: str | list[str] | None = None,
        windows: Window | list[Window] = ("brain", "subdural"),
        img_size: int = 192,
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
        modalities: tuple[str, ...] | None = ("CT",),
        stored_values_are_hu: bool = False,
    ) -> None:
        super().__init__()
        if manifest is not None and scans:
            raise ValueError("give data.manifest or data.scans, not both")
        self.manifest = manifest
        self.scans = ([scans] if isinstance(scans, str) else list(scans)) if scans else None
        self.found_scans: list[Scan] = []
        self.skipped_objects: list[Skipped] = []  # files under `scans` that are not CT slices
        try:
            self.windows = parse_windows(windows)
        except ValueError as err:
            raise ValueError(f"data.windows: {err}") from None
        if img_size <= 0:
            raise ValueError(f"data.img_size must be a positive number of pixels, got {img_size}")
        if batch_size <= 0:
            raise ValueError(f"data.batch_size must be a positive number of slices, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"data.num_workers must be 0 (load in the main process) or more, got {num_workers}")
        if len(split_fractions) != 3 or abs(sum(split_fractions) - 1.0) > 1e-6 or min(split_fractions) < 0:
            raise ValueError(
                f"data.split_fractions must be three non-negative numbers (train, val, test) summing to 1, got"
                f" {split_fractions}"
            )
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
        self.augmentation = BatchAugmentation()
        self.read_options = {
            "modalities": None if modalities is None else tuple(modalities),
            "stored_values_are_hu": stored_values_are_hu,
        }
        self.table: pd.DataFrame | None = None
        self.bad_rows: list = []
        self.bad_rows_report: Path | None = None  # bad_files.csv, written when on_bad_file="skip" left rows out
        self._labelled = False  # whether `table` was read requiring labels
        self.datasets: dict[str, CTSliceDataset] = {}

    @property
    def num_channels(self) -> int:
        """Input channels of the model: one per window."""
        return len(self.windows)

    def input_contract(self, patch_size: int) -> InputContract:
        """How this module prepares slices for a model with ``patch_size`` (recorded in its checkpoints)."""
        return InputContract.of(
            img_size=self.img_size, patch_size=patch_size, windows=self.windows, read_options=self.read_options
        )

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
            # Files first: the split keeps copies of one image (found by content) together.
            table, self.bad_rows = validate_manifest_files(table, on_bad_file=self.on_bad_file, **self.read_options)
            self.table = assign_splits(table, fractions=self.split_fractions, seed=self.split_seed)
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

    def report_bad_rows(self, folder: str | Path, *, shown_as: str | Path | None = None) -> Path | None:
        """Write the rows ``on_bad_file="skip"`` left out to ``folder/bad_files.csv``, once, and name it in the log.

        Under ``vit-ct`` the run folder (``fit``) or the output folder (``predict``) is chosen once the run exists;
        without a trainer, :meth:`setup` writes it beside the manifest.

        Args:
            folder: Where to write it.
            shown_as: The folder to name in the log, when ``folder`` is a staging folder that will become it.
        """
        if not self.bad_rows or self.bad_rows_report is not None:
            return self.bad_rows_report
        self.bad_rows_report = write_bad_files(self.bad_rows, Path(folder) / "bad_files.csv")
        rank_zero_warn(
            f"{len({b.line for b in self.bad_rows})} manifest rows name unusable files and were skipped;"
            f" listed in {Path(shown_as or folder) / 'bad_files.csv'}"
        )
        return self.bad_rows_report

    def split_table(self, split: str | None) -> pd.DataFrame:
        table = self.load_table() if self.table is None else self.table  # as `setup` read it (labelled or not)
        return table if split is None else table[table["split"] == split]

    def _dataset(self, split: str | None) -> CTSliceDataset:
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
                read_options=self.read_options,
            )
            indices, ranks = None, self._ranks()
            if split != "train" and ranks.get("num_replicas", 1) > 1:
                # An evaluation shard is fixed (in order, rank::world), so each rank caches only the slices it reads.
                # Training shards are dealt anew every epoch: each rank caches the whole training split.
                indices = [decode_index(i)[0] for i in MarkedPaddingSampler(self.datasets[key], **ranks)]
            self.datasets[key].fill_cache(f"reading {key} slices", indices)
        return self.datasets[key]

    def setup(self, stage: str) -> None:
        model = self.trainer.lightning_module if self.trainer is not None else None
        self.check(stage, num_classes=getattr(model, "hparams", {}).get("num_classes"))
        if self.trainer is None:
            self.report_bad_rows(self.manifest_path().resolve().parent)
        if stage == "fit":
            self._dataset("train")
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
            pin_memory=self._pin_memory(),
            drop_last=False,
        )

    def _pin_memory(self) -> bool:
        """Page-locked batches when they go to a CUDA device: the copy then overlaps the step before."""
        trainer = self.trainer
        return trainer is not None and trainer.strategy.root_device.type == "cuda"

    def _ranks(self) -> dict[str, int]:
        """``num_replicas`` and ``rank`` of this process under a multi-process strategy, else empty."""
        trainer = self.trainer
        kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
        return {"num_replicas": kwargs["num_replicas"], "rank": kwargs["rank"]} if kwargs else {}

    def train_dataloader(self) -> DataLoader:
        dataset = self._dataset("train")
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
            pin_memory=self._pin_memory(),
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

    def on_after_batch_transfer(self, batch: CTBatch, dataloader_idx: int) -> CTBatch:
        """Augment training batches where they are now (GPU or CPU), with a generator seeded by (seed, rank, batch
        number), so that a resumed run draws what the interrupted one would have drawn."""
        trainer = self.trainer
        if not (self.augment and trainer is not None and trainer.training):
            return batch
        image = batch["image"]
        number = trainer.fit_loop.epoch_loop.batch_progress.total.ready  # batches drawn before this one, checkpointed
        state = np.random.SeedSequence([global_seed(), trainer.global_rank, number]).generate_state(2)
        generator = torch.Generator(device=image.device).manual_seed(int(state[0]) << 32 | int(state[1]))
        return self.augmentation(batch, generator)
