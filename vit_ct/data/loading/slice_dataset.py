"""Rows of a manifest table as batch items: each slice's HU and lesion mask on the model grid, windowed as channels;
read from the files, from memory, or from the disk cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset, default_collate

from vit_ct.data.cache.slice_cache import SliceCache
from vit_ct.data.io.reader import load_ct_slice, load_mask, read_pixel_spacing
from vit_ct.data.loading.distributed import decode_index
from vit_ct.data.manifests.manifest import SPACING_COLUMN, manifest_frame
from vit_ct.data.manifests.scan_labels import scan_ids, scan_labels_tensor
from vit_ct.data.transforms.model_input import apply_windows, grid_hu, grid_mask, model_grid_spacing
from vit_ct.progress import track

_FILL_CHUNK = 256  # slices copied at once when the in-memory cache is filled from the disk cache


class ScanKeys(TypedDict, total=False):
    """The keys of a batch only where the manifest has scan labels (:mod:`vit_ct.data.manifests.scan_labels`)."""

    scan_label: torch.Tensor  # (B,) int64, or (B, L) 0/1; -1 where unknown: the label of the slice's scan
    scan: torch.Tensor  # (B,) int64: the slice's scan, numbered within its split


class VolumeKeys(TypedDict, total=False):
    """The keys of a batch only where the model reads slices in their scan (a sequence head): each slice's volume
    (one series or NIfTI volume of a patient, :func:`~vit_ct.data.manifests.neighbours.slice_places`) and its place
    along it."""

    volume: torch.Tensor  # (B,) int64: the slice's volume, numbered within its split; -1 where unknown
    position_mm: torch.Tensor  # (B,) float32: the slice's position along the slice normal, mm; NaN where unknown


class CTBatch(ScanKeys, VolumeKeys):
    """One batch. ``B`` slices, ``C`` windows, ``S`` = ``img_size``.

    With the disk cache (``cache: disk``) the loaders' batches carry ``hu`` ``(B, 1, S, S)`` float16 on the model grid
    and a uint8 ``mask`` instead of ``image`` and ``head``: :meth:`CTSliceDataModule.on_after_batch_transfer` windows
    them where they land (on the GPU when there is one), so the model, the callbacks and the metrics see this batch.
    """

    image: torch.Tensor  # (B, C, S, S) windowed HU in [0, 1]
    mask: torch.Tensor  # (B, 1, S, S) lesion mask, 0/1; zeros where unknown
    head: torch.Tensor  # (B, 1, S, S) head (not air) mask, 0/1: where localisation is scored
    has_mask: torch.Tensor  # (B,) bool: a mask file was given
    label: torch.Tensor  # (B,) int64 class, or (B, L) int64 0/1 for multi-label; -1 where unknown (prediction)
    index: torch.Tensor  # (B,) row of the split's table
    valid: torch.Tensor  # (B,) bool: False on a repeat that pads a DDP shard (metrics skip it)
    source_shape: torch.Tensor  # (B, 2) rows, columns of the source slice
    pixel_spacing_mm: torch.Tensor  # (B,) mm per model-grid pixel; NaN where neither the file nor the manifest gives it


def slice_item(
    hu: np.ndarray,
    mask: np.ndarray | None,
    *,
    label: torch.Tensor,
    index: int,
    windows: Sequence[tuple[float, float]] | None,
    img_size: int,
    pixel_spacing_mm: tuple[float, float] | None = None,
) -> dict:
    """One slice as a :class:`CTBatch` item (all keys but ``valid``) on the model grid; with ``windows`` None, its HU
    (``hu``, windowed where the batch lands: :func:`~vit_ct.data.transforms.model_input.apply_windows`).

    Args:
        hu: Slice ``(rows, cols)`` in HU.
        mask: Lesion mask ``(rows, cols)``, 0/1; None when unknown (an empty mask, ``has_mask`` False).
        label: Class, or 0/1 per label for multi-label data.
        index: Row of the split's table.
        windows: HU windows, one channel each; None: not yet.
        img_size: Side of the model input.
        pixel_spacing_mm: The source slice's (row, column) spacing in mm; None when unknown.
    """
    rows, cols = hu.shape
    item = {
        "hu": grid_hu(hu, img_size),
        "mask": torch.zeros(1, img_size, img_size) if mask is None else grid_mask(mask, img_size),
        "has_mask": torch.tensor(mask is not None),
        "label": label,
        "index": torch.tensor(index),
        "source_shape": torch.tensor([rows, cols]),
        "pixel_spacing_mm": torch.tensor(model_grid_spacing(pixel_spacing_mm, (rows, cols), img_size)),
    }
    return item if windows is None else apply_windows(item, windows)


def table_labels(table: pd.DataFrame, label_columns: Sequence[str] | None) -> torch.Tensor:
    """``(N,)`` class or ``(N, L)`` 0/1 labels of a table's rows as int64 (as torchmetrics wants its targets; the loss
    takes them as float), -1 where unknown."""
    values = table[list(label_columns)] if label_columns else table["label"]
    return torch.from_numpy(values.astype("Int64").fillna(-1).to_numpy(dtype=np.int64))


class CTSliceDataset(Dataset):
    """Rows of a manifest table as :class:`CTBatch` items.

    Args:
        table: Rows of one split (see :func:`vit_ct.data.manifests.manifest.read_manifest`).
        windows: HU windows, one channel each.
        img_size: Side of the model input.
        label_columns: Multi-label columns; None reads ``label``.
        cache: Keep every preprocessed slice in memory after the first read; from ``store`` when given: its HU on
            the model grid, copied once, windowed as each batch is read.
        read_options: Keyword arguments of :func:`~vit_ct.data.io.reader.load_ct_slice` (``modalities``,
            ``stored_values_are_hu``).
        store: Read the slices from this disk cache instead of their files (slot of each row in the table's
            ``cache_slot``); items then hold HU on the model grid, windowed later (``CTBatch``), but ``load`` still
            gives them windowed. With ``cache``, items are as from the files, from HU copied into memory first.
        hu_items: Items from the files hold HU too, windowed where the batch lands (for augmentation in HU).
        neighbours: ``(N, 2)`` rows of ``table`` read with each row, below and above it
            (:class:`~vit_ct.data.manifests.neighbours.Neighbours`), as further channels after the row's own (``hu``
            ``(3, S, S)``, ``image`` 3 x the windows); None: each row alone. Mask, head, label and the rest are the
            row's own; the neighbours come from wherever the row comes from (files, memory, disk cache).
        places: Each row's volume ``(N,)`` int (-1: unknown) and position ``(N,)`` mm (NaN: unknown), as
            :func:`~vit_ct.data.manifests.neighbours.slice_places` finds them: batches carry them (``volume``,
            ``position_mm``) for a model that reads each slice in its scan. None: they do not.
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
        store: SliceCache | None = None,
        hu_items: bool = False,
        neighbours: np.ndarray | None = None,
        places: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.table = table.reset_index(drop=True)
        if neighbours is not None and neighbours.shape != (len(self.table), 2):
            raise ValueError(f"neighbours must be ({len(self.table)}, 2) rows, got {neighbours.shape}")
        self.neighbours = None if neighbours is None else np.asarray(neighbours, dtype=np.int64)
        self.hu_items = hu_items
        self.read_options = dict(read_options or {})
        self.windows = list(windows)
        self.img_size = img_size
        self.label_columns = list(label_columns) if label_columns else None
        self.labels = table_labels(self.table, self.label_columns)
        # scan labels (multiple-instance learning, vit_ct.data.manifests.scan_labels): each row's scan label and number
        self.scan_labels = scan_labels_tensor(self.table)
        self.scans = None if self.scan_labels is None else torch.from_numpy(scan_ids(self.table))
        self.volumes = self.positions = None
        if places is not None:
            if any(len(column) != len(self.table) for column in places):
                raise ValueError(f"places must give a volume and a position for each of {len(self.table)} rows")
            self.volumes = torch.as_tensor(np.asarray(places[0], dtype=np.int64))
            self.positions = torch.as_tensor(np.asarray(places[1], dtype=np.float32))
        self.store = None if cache else store  # batches straight from the disk cache
        self._source = store if cache else None  # what the in-memory cache is filled from
        # Workers index these arrays, never the table: its Python objects would be copied into every worker's memory.
        self.slots = self.table["cache_slot"].to_numpy(dtype=np.int64) if store is not None else None
        # mm per pixel of the manifest's `pixel_spacing_mm` (NaN where empty): for files that carry no spacing
        given = self.table.get(SPACING_COLUMN)
        self.given_spacing = None if given is None else given.to_numpy(dtype=np.float64, na_value=np.nan)
        # Rows held in memory: their item (read from the files), or their place in `_held` (copied from the store)
        self._cache: dict[int, dict | int] | None = {} if cache else None
        self._held: dict[str, torch.Tensor] = {}  # the store's batch keys, one block of rows each

    def __len__(self) -> int:
        return len(self.table)

    def load(self, index: int) -> dict:
        """Windowed slice and mask of row ``index`` on the model grid, before augmentation (in HU with
        ``hu_items``), with its neighbours' channels after its own."""
        if self.store is not None:
            return apply_windows(self._stored_items([index])[0], self.windows)
        if self._source is not None:
            return self._held_items([index])[0]
        item = self._load_row(index)
        if self.neighbours is None:
            return item
        key = "hu" if self.hu_items else "image"
        around = [self._load_row(int(row))[key] for row in self.neighbours[index]]
        return {**item, key: torch.cat([item[key], *around])}

    def _load_row(self, index: int) -> dict:
        """:meth:`load` of row ``index`` alone, from the files or the in-memory cache of items."""
        if self._cache is not None and index in self._cache:
            return self._cache[index]
        row = self.table.iloc[index]
        hu = load_ct_slice(row["image"], frame=manifest_frame(row), **self.read_options)
        mask_path = row.get("mask")
        has_mask = isinstance(mask_path, str) and bool(mask_path)
        mask = load_mask(mask_path, frame=manifest_frame(row)) if has_mask else None
        spacing = read_pixel_spacing(row["image"], frame=manifest_frame(row)) or self._given_spacing(index)
        windows = None if self.hu_items else self.windows
        item = slice_item(
            hu, mask, label=self.labels[index].clone(), index=index, windows=windows, img_size=self.img_size,
            pixel_spacing_mm=spacing,
        )  # fmt: skip
        if self._cache is not None:
            self._cache[index] = item
        return item

    def fill_cache(self, description: str, indices: Sequence[int] | None = None) -> None:
        """Read the rows ``indices`` (default: every row) now, with a progress bar (no-op without a cache).

        Filled before the DataLoader starts its workers, so they share the cache instead of each filling its own.
        """
        if self._cache is None:
            return
        rows = range(len(self)) if indices is None else sorted(set(indices))
        if self.neighbours is not None and indices is not None:  # the neighbours of a shard's rows are read too
            rows = sorted({*rows, *self.neighbours[list(rows)].ravel().tolist()})
        if self._source is None:
            for index in track(rows, description=description, transient=True):
                self._load_row(index)
            return
        self._hold(rows, description)

    def _hold(self, rows: Sequence[int], description: str | None = None) -> None:
        """Copy the slices of ``rows`` from the store into memory, one block per key (float32 HU on the model grid:
        a quarter of the windowed float32 channels, head and mask; forked DataLoader workers share its pages); the
        store verifies each slot's checksum as it reads it."""
        rows = [int(index) for index in dict.fromkeys(rows) if index not in self._cache]
        if not rows:
            return
        # Blocks from torch's allocator: numpy asks the kernel for huge pages, which stalled in compaction where the
        # VM's RAM held page cache (benchmarks/loader_throughput.py times the cached loader)
        shape, store = (len(rows), 1, self.img_size, self.img_size), self._source
        held = {"hu": torch.empty(shape, dtype=torch.from_numpy(np.empty(0, store.hu_dtype)).dtype)}
        if store.has_masks:
            held["mask"] = torch.zeros(shape, dtype=torch.uint8)
        chunks = range(0, len(rows), _FILL_CHUNK)
        for start in track(chunks, description=description, transient=True) if description else chunks:
            chunk = np.asarray(rows[start : start + _FILL_CHUNK], dtype=np.int64)
            part = slice(start, start + len(chunk))
            out_mask = held["mask"][part, 0].numpy() if "mask" in held else None
            batch = store.batch(self.slots[chunk], out=held["hu"][part, 0].numpy(), out_mask=out_mask)
            self._fill_spacing(batch, chunk)
            for key, value in batch.items():
                if key in ("hu", "mask"):
                    continue  # gathered into their blocks
                if key not in held:
                    held[key] = value.new_empty((len(rows), *value.shape[1:]))
                held[key][part] = value
        first = len(self._cache)
        self._held = {key: torch.cat([self._held[key], block]) for key, block in held.items()} if self._held else held
        self._cache.update(zip(rows, range(first, first + len(rows)), strict=True))

    def _held_items(self, sampled: Sequence[int]) -> CachedBatch:
        """Items of sampler indices from memory (`_hold`), in one gather, windowed (in HU with ``hu_items``): the
        items the files give, to the bit (the same float32 HU, the same window arithmetic)."""
        rows, valid = zip(*(decode_index(i) for i in sampled), strict=True)
        around = [] if self.neighbours is None else self.neighbours[list(rows)].T.tolist()  # below, above
        self._hold([*rows, *(row for side in around for row in side)])  # rows not filled ahead: once, here
        places = torch.tensor([self._cache[row] for row in rows])
        batch = {key: block[places] for key, block in self._held.items()}
        if around:
            hu = self._held["hu"]
            batch["hu"] = torch.cat([batch["hu"], *(hu[[self._cache[row] for row in side]] for side in around)], 1)
        rows = torch.tensor(rows)
        batch.update(label=self.labels[rows], index=rows, valid=torch.tensor(valid), **self._scan_items(rows))
        return CachedBatch(batch if self.hu_items else apply_windows(batch, self.windows))

    def _stored_items(self, sampled: Sequence[int]) -> CachedBatch:
        """Items of sampler indices from the disk cache, in one gather."""
        rows, valid = zip(*(decode_index(i) for i in sampled), strict=True)
        rows = np.array(rows)
        if self.neighbours is None:
            batch = self.store.batch(self.slots[rows])
        else:  # one gather for the rows and their neighbours; the batch's other keys are the rows' own
            read = self.store.batch(self.slots[np.concatenate([rows, *self.neighbours[rows].T])])
            batch = {key: value[: len(rows)] for key, value in read.items()}
            batch["hu"] = torch.cat(read["hu"].split(len(rows)), dim=1)
        batch.update(label=self.labels[rows], index=torch.from_numpy(rows), valid=torch.tensor(valid))
        batch.update(self._scan_items(torch.from_numpy(rows)))
        self._fill_spacing(batch, rows)
        return CachedBatch(batch)

    def _given_spacing(self, index: int) -> tuple[float, float] | None:
        """The manifest's pixel spacing of row ``index`` as (rows, columns) mm; None where it gives none."""
        value = np.nan if self.given_spacing is None else self.given_spacing[index]
        return None if np.isnan(value) else (float(value), float(value))

    def _fill_spacing(self, batch: dict, rows: np.ndarray) -> None:
        """Where a batch from the disk cache has no pixel spacing (its slot's file carries none), the manifest's, on
        the model grid (as :func:`~vit_ct.data.transforms.model_input.model_grid_spacing` scales it)."""
        if self.given_spacing is None:
            return
        given = torch.from_numpy(self.given_spacing[rows]) * batch["source_shape"].amax(dim=1) / self.img_size
        spacing = batch["pixel_spacing_mm"]
        batch["pixel_spacing_mm"] = torch.where(spacing.isnan(), given.to(spacing.dtype), spacing)

    def __getitem__(self, index: int) -> CTBatch:
        if self.store is not None:
            return self._stored_items([index])[0]
        if self._source is not None:
            return self._held_items([index])[0]
        index, valid = decode_index(
            index
        )  # a DDP padding repeat arrives as -1 - index (vit_ct.data.loading.distributed)
        return dict(self.load(index), valid=torch.tensor(valid), **self._scan_items(index))

    def _scan_items(self, rows: torch.Tensor | int) -> dict[str, torch.Tensor]:
        """``scan_label`` and ``scan`` (the scan's number in this split) of ``rows``, where the table has scan
        labels; ``volume`` and ``position_mm`` where the dataset was given their places; nothing otherwise."""
        items = {}
        if self.scan_labels is not None:
            items.update(scan_label=self.scan_labels[rows], scan=self.scans[rows])
        if self.volumes is not None:
            items.update(volume=self.volumes[rows], position_mm=self.positions[rows])
        return items

    def __getitems__(self, indices: Sequence[int]) -> Sequence[CTBatch]:
        """What a DataLoader fetches per batch (it collates these items): from the disk cache, one gather per batch
        instead of a round of Python per slice (benchmarks/loader_throughput.py: the loader from the disk cache)."""
        if self.store is not None:
            return self._stored_items(indices)
        return self._held_items(indices) if self._source is not None else [self[i] for i in indices]


class CachedBatch(Sequence):
    """The items of one batch read whole from the disk cache: views of ``batch`` for any collate function, and the
    batch itself for `collate`, which hands it on instead of stacking the views into a second copy."""

    def __init__(self, batch: dict) -> None:
        self.batch = batch

    def __len__(self) -> int:
        return len(self.batch["index"])

    def __getitem__(self, i: int) -> dict:
        return {key: value[i] for key, value in self.batch.items()}


def collate(items: Sequence[Any]) -> Any:
    """``default_collate``, except that a batch read whole from the disk cache passes as it is."""
    return items.batch if isinstance(items, CachedBatch) else default_collate(items)
