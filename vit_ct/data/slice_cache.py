"""Slices on the model grid in HU (float16) and their lesion masks, preprocessed once into memory-mapped files that
every DataLoader worker and DDP rank reads through the one page cache instead of holding its own copy. A slot is used
only while the files it was made from keep their size and modification time, and only once its data is on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from vit_ct.data.check_record import FileStat
from vit_ct.data.model_input import grid_hu, grid_mask

CACHE_VERSION = 1  # bump when what a slot holds changes (resizing, padding, dtype), so that old slots are rebuilt
HU_DTYPE = np.float16  # steps of 0.03 HU at brain values (32-64 HU), 0.5 HU near 1000 (bone): below any window's use
_NO_FRAME = -1


class SlotKey(NamedTuple):
    """The files one cached slice is made from, as they were when it was made."""

    image: str
    frame: int | None
    image_file: FileStat
    mask: str | None
    mask_file: FileStat | None


class SlotInfo(NamedTuple):
    """What a batch needs of a slot besides its pixels."""

    shape: tuple[int, int]  # rows, columns of the source slice
    spacing_mm: tuple[float, float] | None  # of the source slice


_SCHEMA = """
CREATE TABLE IF NOT EXISTS slots (
    slot INTEGER PRIMARY KEY, image TEXT, frame INTEGER, mask TEXT, image_size INTEGER, image_mtime_ns INTEGER,
    mask_size INTEGER, mask_mtime_ns INTEGER, mask_slot INTEGER, rows INTEGER, cols INTEGER, spacing_rows REAL,
    spacing_cols REAL, done INTEGER, UNIQUE (image, frame, mask)
);
CREATE TABLE IF NOT EXISTS grid (img_size INTEGER);
"""


def cache_folder(cache_dir: str | os.PathLike | None, manifest: str | os.PathLike) -> Path:
    """Where one manifest's check record and disk caches live: ``cache_dir`` (None: ``$VIT_CT_CACHE_DIR``, else
    ``~/.cache/vit-ct``, since a data folder may be read-only), then the manifest's name and a hash of its absolute
    path."""
    root = cache_dir or os.environ.get("VIT_CT_CACHE_DIR") or "~/.cache/vit-ct"
    manifest = Path(manifest).resolve()
    return (
        Path(root).expanduser()
        / f"{manifest.stem}-{hashlib.blake2b(str(manifest).encode(), digest_size=6).hexdigest()}"
    )


def _identity(key: SlotKey) -> tuple[str, int, str]:
    return key.image, _NO_FRAME if key.frame is None else key.frame, key.mask or ""


def _stored_key(key: SlotKey) -> tuple[int, int, int, int]:
    mask = key.mask_file or FileStat(-1, -1)
    return key.image_file.size, key.image_file.mtime_ns, mask.size, mask.mtime_ns


class SliceCache:
    """The slices of one manifest on one model grid, in ``folder``: ``index.sqlite`` (which files each slot holds),
    ``hu.f16`` (slots x S x S float16 HU) and ``mask.u8`` (mask slots x S x S, 0/1).

    Writers (the manifest check's worker processes) fill slots `allocate` handed out; `commit` makes them usable once
    their data is on disk, so a killed build leaves unfinished slots that the next build writes again. Readers see
    the slots committed when they opened the cache.

    Args:
        folder: The cache's folder (created when missing).
        img_size: Side of the model grid.
    """

    def __init__(self, folder: str | os.PathLike, *, img_size: int) -> None:
        self.folder = Path(folder)
        self.img_size = img_size
        self.folder.mkdir(parents=True, exist_ok=True)
        self.written = 0  # slots this object committed: slices preprocessed by this process
        self._db: sqlite3.Connection | None = None
        self._maps: tuple[np.memmap | None, np.memmap | None] | None = None
        self._maps_writable = False
        db = self._index()
        if db.execute("PRAGMA user_version").fetchone()[0] != CACHE_VERSION or db.execute(
            "SELECT img_size FROM grid"
        ).fetchone() not in (None, (img_size,)):
            db.executescript("DROP TABLE IF EXISTS slots; DROP TABLE IF EXISTS grid;")
            for name in ("hu.f16", "mask.u8"):
                (self.folder / name).unlink(missing_ok=True)
        db.executescript(_SCHEMA)
        with db:
            db.execute(f"PRAGMA user_version = {CACHE_VERSION}")
            if db.execute("SELECT img_size FROM grid").fetchone() is None:
                db.execute("INSERT INTO grid VALUES (?)", (img_size,))
        self._load_slots()

    @classmethod
    def for_grid(cls, folder: str | os.PathLike, *, img_size: int, read_options: dict) -> SliceCache:
        """The cache in a manifest's ``folder`` (`cache_folder`) for this grid and these read options."""
        options = hashlib.blake2b(json.dumps(read_options, sort_keys=True).encode(), digest_size=4).hexdigest()
        return cls(Path(folder) / f"grid{img_size}-{options}", img_size=img_size)

    # ------------------------------------------------------------------------------------------------ index

    def _index(self) -> sqlite3.Connection:
        if self._db is None:
            self._db = sqlite3.connect(self.folder / "index.sqlite")
        return self._db

    def _load_slots(self) -> None:
        """Slot table as arrays indexed by slot: done, mask slot, source shape and spacing; and slots by identity."""
        columns = (
            "slot, image, frame, mask, image_size, image_mtime_ns, mask_size, mask_mtime_ns, mask_slot, rows, cols,"
            " spacing_rows, spacing_cols, done"
        )
        rows = self._index().execute(f"SELECT {columns} FROM slots").fetchall()
        n = max((row[0] for row in rows), default=-1) + 1
        self.done = np.zeros(n, dtype=bool)
        self.mask_slots = np.full(n, -1, dtype=np.int64)
        self.shapes = np.zeros((n, 2), dtype=np.int64)
        self.spacings = np.full((n, 2), np.nan)
        self._by_identity: dict[tuple[str, int, str], tuple[int, tuple[int, int, int, int]]] = {}
        for slot, image, frame, mask, *stored, mask_slot, r, c, sr, sc, done in rows:
            self._by_identity[(image, frame, mask)] = (slot, tuple(stored))
            self.done[slot], self.mask_slots[slot] = bool(done), mask_slot
            self.shapes[slot] = (r or 0, c or 0)
            self.spacings[slot] = (np.nan if sr is None else sr, np.nan if sc is None else sc)
        self.n_mask_slots = int(self.mask_slots.max(initial=-1)) + 1

    def lookup(self, keys: Sequence[SlotKey]) -> np.ndarray:
        """The committed slot holding each key's slice as its files are now; -1 where there is none."""
        slots = np.full(len(keys), -1, dtype=np.int64)
        for i, key in enumerate(keys):
            if key.image_file is None or (key.mask is not None and key.mask_file is None):
                continue  # a file is missing or unreadable: nothing of it can be cached
            found = self._by_identity.get(_identity(key))
            if found is not None and found[1] == _stored_key(key) and self.done[found[0]]:
                slots[i] = found[0]
        return slots

    def allocate(self, keys: Sequence[SlotKey]) -> tuple[np.ndarray, np.ndarray]:
        """Slots (and mask slots, -1 without a mask) to write these keys' slices into, marked unfinished until
        `commit`: a key's own slot when its files changed, else a new one at the end (the files grow)."""
        slots = np.empty(len(keys), dtype=np.int64)
        mask_slots = np.full(len(keys), -1, dtype=np.int64)
        if not keys:
            return slots, mask_slots
        n_slots, n_masks = len(self.done), self.n_mask_slots
        rows = []
        for i, key in enumerate(keys):
            identity = _identity(key)
            found = self._by_identity.get(identity)
            if found is None:
                slot, n_slots = n_slots, n_slots + 1
                mask_slot = -1
            else:
                slot = found[0]
                mask_slot = int(self.mask_slots[slot]) if slot < len(self.mask_slots) else -1
            if key.mask is not None and mask_slot < 0:
                mask_slot, n_masks = n_masks, n_masks + 1
            slots[i], mask_slots[i] = slot, mask_slot if key.mask is not None else -1
            self._by_identity[identity] = (slot, _stored_key(key))
            rows.append((slot, *identity, *_stored_key(key), int(mask_slots[i])))
        with self._index() as db:  # unfinished before any writer touches the slot's bytes
            db.executemany(
                "INSERT OR REPLACE INTO slots (slot, image, frame, mask, image_size, image_mtime_ns, mask_size,"
                " mask_mtime_ns, mask_slot, done) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
                rows,
            )
        self._grow(n_slots, n_masks)
        self._load_slots()
        return slots, mask_slots

    def commit(self, written: Sequence[tuple[int, SlotInfo]]) -> None:
        """Mark written slots usable, after flushing the data files to disk (workers wrote through shared maps)."""
        if not written:
            return
        for name in ("hu.f16", "mask.u8"):
            path = self.folder / name
            if path.exists():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        with self._index() as db:
            db.executemany(
                "UPDATE slots SET rows = ?, cols = ?, spacing_rows = ?, spacing_cols = ?, done = 1 WHERE slot = ?",
                [(*info.shape, *(info.spacing_mm or (None, None)), slot) for slot, info in written],
            )
        self.written += len(written)
        for slot, info in written:
            self.done[slot] = True
            self.shapes[slot] = info.shape
            self.spacings[slot] = info.spacing_mm or (np.nan, np.nan)

    # ------------------------------------------------------------------------------------------------ pixels

    @property
    def _slot_shape(self) -> tuple[int, int]:
        return self.img_size, self.img_size

    def _grow(self, n_slots: int, n_masks: int) -> None:
        """Extend the data files to hold ``n_slots`` and ``n_masks`` (sparse: unwritten slots take no disk)."""
        self._maps = None
        side = self.img_size * self.img_size
        for name, count, itemsize in (("hu.f16", n_slots, 2), ("mask.u8", n_masks, 1)):
            path = self.folder / name
            size = count * side * itemsize
            if not path.exists() or path.stat().st_size < size:
                with open(path, "ab") as f:
                    f.truncate(size)

    def _open(self, *, writable: bool) -> tuple[np.memmap | None, np.memmap | None]:
        if self._maps is None or (writable and not self._maps_writable):
            mode = "r+" if writable else "r"
            maps = []
            for name, dtype in (("hu.f16", HU_DTYPE), ("mask.u8", np.uint8)):
                path = self.folder / name
                count = path.stat().st_size // (self.img_size**2 * np.dtype(dtype).itemsize) if path.exists() else 0
                shape = (count, *self._slot_shape)
                maps.append(np.memmap(path, dtype=dtype, mode=mode, shape=shape) if count else None)
            self._maps, self._maps_writable = tuple(maps), writable
        return self._maps

    def write(self, slot: int, mask_slot: int, hu: np.ndarray, mask: np.ndarray | None) -> None:
        """Store one slice ``(rows, cols)`` in HU and its lesion mask (or None) on the model grid (worker side)."""
        hu_map, mask_map = self._open(writable=True)
        hu_map[slot] = grid_hu(hu, self.img_size)[0].numpy().astype(HU_DTYPE)
        if mask is not None:
            mask_map[mask_slot] = grid_mask(mask, self.img_size)[0].numpy()

    def batch(self, slots: np.ndarray) -> dict:
        """Slots as a batch before windowing (`vit_ct.data.model_input.apply_windows`), in one gather from the maps:
        ``hu`` ``(B, 1, S, S)`` float16, ``mask`` ``(B, 1, S, S)`` uint8 (zeros without a mask; left out when the
        cache holds no mask at all, as for RSNA: zeros are made where the batch lands), ``has_mask``,
        ``source_shape`` ``(B, 2)`` and ``pixel_spacing_mm`` ``(B,)`` of the model grid (NaN where unknown)."""
        hu_map, mask_map = self._open(writable=False)
        mask_slots = self.mask_slots[slots]
        has_mask = mask_slots >= 0
        shapes = self.shapes[slots]
        # the mean of row and column spacing, scaled from the padded square to the model grid (model_grid_spacing)
        spacing = self.spacings[slots].mean(axis=1) * shapes.max(axis=1) / self.img_size
        batch = {
            "hu": torch.from_numpy(hu_map[slots])[:, None],  # a gather: a copy, the map stays read-only
            "has_mask": torch.from_numpy(has_mask),
            "source_shape": torch.from_numpy(shapes),
            "pixel_spacing_mm": torch.from_numpy(spacing.astype(np.float32)),
        }
        if mask_map is not None:
            masks = np.zeros((len(slots), *self._slot_shape), dtype=np.uint8)
            masks[has_mask] = mask_map[mask_slots[has_mask]]
            batch["mask"] = torch.from_numpy(masks)[:, None]
        return batch

    def __getstate__(self) -> dict:
        # Sent to worker processes without the index connection and maps; each reopens its own maps when it reads.
        return {**self.__dict__, "_db": None, "_maps": None}

    def close(self) -> None:
        self._maps = None
        if self._db is not None:
            self._db.close()
            self._db = None
