"""CT slices listed in a manifest CSV, as windowed tensors on the model grid, in typed batches.

``CTSliceDataModule`` reads the user's own manifest (the built-in synthetic set's data module,
:class:`vit_ct.sim.synthetic.SyntheticCTDataModule`, reads the set it generates through exactly this path).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
import torch
from filelock import FileLock, Timeout
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler

from vit_ct.data.cache.check_record import CheckRecord
from vit_ct.data.cache.slice_cache import SliceCache, cache_folder
from vit_ct.data.io.dicom import NOTES
from vit_ct.data.io.scans import Scan, Skipped, find_scans, scan_table
from vit_ct.data.loading.distributed import (
    EpochShuffleSampler,
    MarkedPaddingSampler,
    ResumableDataLoader,
    decode_index,
    global_seed,
)
from vit_ct.data.loading.slice_dataset import CTBatch, CTSliceDataset, collate, slice_item
from vit_ct.data.loading.slice_module import SliceDataModule, Window
from vit_ct.data.manifests.labels import values_read_as_lesion
from vit_ct.data.manifests.manifest import (
    assign_splits,
    check_label_range,
    read_manifest,
    validate_manifest_files,
    write_bad_files,
)
from vit_ct.data.manifests.splits import SPLIT_FRACTIONS
from vit_ct.data.transforms.contract import DEFAULT_IMG_SIZE, DEFAULT_WINDOWS, InputContract
from vit_ct.data.transforms.model_input import HEAD_HU, model_grid_spacing

# HEAD_HU, model_grid_spacing, CTBatch and slice_item lived here before; sim and saved code import them from here.
__all__ = ["HEAD_HU", "CTBatch", "CTSliceDataModule", "CTSliceDataset", "model_grid_spacing", "slice_item"]


class CTSliceDataModule(SliceDataModule):
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
            batches on the training device (:class:`~vit_ct.data.transforms.augment.BatchAugmentation`), after the
            cache.
        scanner_augment: Also another scanner's reconstruction kernel, dose and HU calibration, in HU before the
            windows (:class:`~vit_ct.data.transforms.scanner_augment.ScannerAugmentation`, MONAI's Gaussian filter), on
            the training split: for CT from scanners the training set does not have.
        cache: ``true`` (or ``memory``): keep preprocessed slices in memory (fast epochs for sets that fit): float32
            HU on the model grid, windowed as each batch is read, copied before the first epoch from what the
            pre-run check stores under ``cache_dir`` (256 KiB a slice at 256), so that a later run reads no file.
            Under DDP each rank holds only its shard of the evaluation splits, but the whole training split (its
            shards are dealt anew every epoch). ``disk``: store every slice once on the model grid (float16 HU,
            windowed when a batch is read) in memory-mapped files under ``cache_dir``, shared by every worker and
            rank, rebuilt only where files or the grid change (large sets: 128 KiB a slice at 256). ``false``: read
            every file every epoch.
        cache_dir: Folder of the check record (every file's verdict, so later runs read no file again) and of the
            disk cache; None: ``$VIT_CT_CACHE_DIR``, else ``~/.cache/vit-ct``.
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
        context_mm: Read each slice with its neighbours this far below and above, as further channels (rules:
            :mod:`vit_ct.data.manifests.neighbours`); None: each slice alone. With a checkpoint, the checkpoint's.
    """

    def __init__(
        self,
        manifest: str | None = None,
        *,
        scans: str | list[str] | None = None,
        windows: Window | list[Window] = DEFAULT_WINDOWS,
        img_size: int = DEFAULT_IMG_SIZE,
        label_columns: list[str] | None = None,
        batch_size: int = 32,
        num_workers: int = 2,
        augment: bool = True,
        scanner_augment: bool = False,
        cache: bool | Literal["memory", "disk"] = True,
        cache_dir: str | None = None,
        split_fractions: tuple[float, float, float] = SPLIT_FRACTIONS,
        split_seed: int = 0,
        predict_split: Literal["train", "val", "test"] | None = None,
        on_bad_file: Literal["raise", "skip"] = "raise",
        weighted_sampler: bool = False,
        modalities: tuple[str, ...] | None = ("CT",),
        stored_values_are_hu: bool = False,
        context_mm: float | None = None,
    ) -> None:
        read_options = {"modalities": None if modalities is None else tuple(modalities),
                        "stored_values_are_hu": stored_values_are_hu}  # fmt: skip
        super().__init__(windows=windows, img_size=img_size, batch_size=batch_size, num_workers=num_workers,
                         augment=augment, read_options=read_options, scanner_augment=scanner_augment,
                         context_mm=context_mm)  # fmt: skip
        if manifest is not None and scans:
            raise ValueError("give data.manifest or data.scans, not both")
        self.manifest = manifest
        self.scans = ([scans] if isinstance(scans, str) else list(scans)) if scans else None
        self.found_scans: list[Scan] = []
        self.skipped_objects: list[Skipped] = []  # files under `scans` that are not CT slices
        if len(split_fractions) != 3 or abs(sum(split_fractions) - 1.0) > 1e-6 or min(split_fractions) < 0:
            raise ValueError(
                f"data.split_fractions must be three non-negative numbers (train, val, test) summing to 1, got"
                f" {split_fractions}"
            )
        self.label_columns = label_columns
        if cache not in (True, False, "memory", "disk"):
            raise ValueError(f"data.cache must be true, false, 'memory' or 'disk', got {cache!r}")
        self.cache = "memory" if cache is True else cache
        self.cache_dir = cache_dir
        self.slice_cache: SliceCache | None = None  # with a cache, once the manifest is checked
        self.check_record: CheckRecord | None = None  # the manifest's verdicts, once checked
        self.split_fractions = tuple(split_fractions)
        self.split_seed = split_seed
        self.predict_split = predict_split
        self.on_bad_file = on_bad_file
        self.weighted_sampler = weighted_sampler
        self.table: pd.DataFrame | None = None
        self.bad_rows: list = []
        self.bad_rows_report: Path | None = None  # bad_files.csv, written when on_bad_file="skip" left rows out
        self._labelled = False  # whether `table` was read requiring labels
        self._said: set[str] = set()  # notes on the manifest already said (each setup checks it again)
        self.datasets: dict[str, CTSliceDataset] = {}

    @classmethod
    def from_contract(cls, contract: InputContract, **kwargs):
        """The slices of a manifest (or scans) prepared as ``contract`` says: input size, windows, read options;
        ``kwargs``: the rest of the arguments (``manifest``, ``batch_size``, ...). How the review builds its data.

        Raises:
            ValueError: the contract does not know its windows (a checkpoint written before inputs were recorded:
                :meth:`~vit_ct.data.transforms.contract.InputContract.completed` fills them in).
        """
        if contract.windows is None:
            raise ValueError(
                f"the model's input ({contract.describe()}) does not say its windows: the checkpoint predates recorded"
                " inputs; give the windows it was trained with"
            )
        return cls(**{**kwargs, **contract.data_arguments()})

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
            table, self.bad_rows = self._check_files(table, path)
            self.table = assign_splits(table, fractions=self.split_fractions, seed=self.split_seed)
            self._labelled = require_labels
        return self.table

    def _check_files(self, table: pd.DataFrame, manifest: Path) -> tuple[pd.DataFrame, list]:
        """`validate_manifest_files` with this manifest's check record (and disk cache), one process at a time: the
        others (DDP ranks started at once, a second run) wait, then find every verdict and slot there."""
        folder = cache_folder(self.cache_dir, manifest)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(
                f"cannot use the cache folder {folder} ({e}): choose a writable folder with --data.init_args.cache_dir"
                " (or VIT_CT_CACHE_DIR)"
            ) from None
        lock = FileLock(folder / "check.lock")
        try:
            lock.acquire(timeout=1)
        except Timeout:
            print(f"{manifest}: waiting for another process checking it ({lock.lock_file})", file=sys.stderr)
            lock.acquire()
        try:
            self.check_record = CheckRecord(folder / "checked.sqlite")
            if self.cache:  # the in-memory cache is filled from exact (float32) HU, the disk cache's are float16
                dtype = np.float16 if self.cache == "disk" else np.float32
                self.slice_cache = SliceCache.for_grid(
                    folder, img_size=self.img_size, read_options=self.read_options, hu_dtype=dtype
                )
            try:
                checked = validate_manifest_files(
                    table,
                    on_bad_file=self.on_bad_file,
                    record=self.check_record,
                    cache=self.slice_cache,
                    **self.read_options,
                )
            finally:
                self.check_record.close()
        finally:
            lock.release()
        rank_zero_info(
            f"{manifest}: {len(table)} rows checked, {self.check_record.added} files read"
            + (f", {self.slice_cache.written} slices cached" if self.slice_cache is not None else "")
            + f" (verdicts in {self.check_record.path})"
        )
        say_read_notes(manifest, checked[0])
        return checked

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
            say_read_notes("data.scans", self.table)
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
        note = values_read_as_lesion(table) if num_classes == 2 else None
        if note and note not in self._said:  # once a run, not once a stage
            self._said.add(note)
            rank_zero_warn(note)

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
            places, neighbours = self.scan_places(table, f"{self.manifest or 'data.scans'} ({key})")
            self.datasets[key] = CTSliceDataset(
                table,
                windows=self.windows,
                img_size=self.img_size,
                label_columns=self.label_columns,
                cache=self.cache == "memory",
                read_options=self.read_options,
                store=self.slice_cache,
                hu_items=self.scanner_augment and split == "train",  # windowed after the augmentation in HU
                neighbours=neighbours,
                places=places,
            )
            indices, ranks = None, self._ranks()
            if split != "train" and ranks.get("num_replicas", 1) > 1:
                # An evaluation shard is fixed (in order, rank::world), so each rank caches only the slices it reads.
                # Training shards are dealt anew every epoch: each rank caches the whole training split.
                indices = [decode_index(i)[0] for i in MarkedPaddingSampler(self.datasets[key], **ranks)]
            self.datasets[key].fill_cache(f"reading {key} slices", indices)
        return self.datasets[key]

    def setup(self, stage: str) -> None:
        hparams = getattr(self.trainer.lightning_module, "hparams", {}) if self.trainer is not None else {}
        self.read_volumes |= bool(hparams.get("sequence"))  # a sequence head reads each slice in its scan
        self.check(stage, num_classes=hparams.get("num_classes"))
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
            collate_fn=collate,
        )

    def train_dataloader(self) -> DataLoader:
        dataset = self._dataset("train")
        if self.weighted_sampler and dataset.scans is not None:
            raise ValueError(
                f"data.weighted_sampler draws slices by their slice label, which manifest {self.manifest} does not"
                " have (it gives scan labels): leave weighted_sampler false"
            )
        if self.weighted_sampler and not self.label_columns:
            labels = dataset.table["label"].to_numpy(dtype=int)
            weights = 1.0 / np.bincount(labels)[labels]
            sampler = WeightedRandomSampler(torch.as_tensor(weights, dtype=torch.double), len(labels))
            return self._loader(dataset, sampler=sampler)  # Lightning shards it under DDP
        # Our own shuffle (also for one process): its order depends on (seed, epoch) only, so resuming is exact.
        # with scan labels, the slices of a scan come together (its bag is pooled within the batch)
        sampler = EpochShuffleSampler(dataset, seed=global_seed(), groups=dataset.scans, **self._ranks())
        return ResumableDataLoader(
            dataset,
            sampler=sampler,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self._pin_memory(),
            drop_last=False,
            collate_fn=collate,
        )

    def _split_loader(self, split: str) -> DataLoader:
        workers = {"num_workers": self.num_workers, "persistent_workers": self.num_workers > 0}
        return self._evaluation_loader(
            self._dataset(split), pin_memory=self._pin_memory(), collate_fn=collate, **workers
        )

    def val_dataloader(self) -> DataLoader:
        return self._split_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._split_loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self._dataset(self.predict_split))


def say_read_notes(where, checked: pd.DataFrame) -> None:
    """One line per correction the reader made on the checked rows' slices (``attrs["read_notes"]``)."""
    for note, count in checked.attrs.get("read_notes", {}).items():
        rank_zero_info(f"{where}: {count} slice{'s' * (count != 1)} with {note} ({NOTES.get(note, '')})")
