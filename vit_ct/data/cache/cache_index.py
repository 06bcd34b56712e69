"""The index of a slice cache (``index.sqlite``): which files each slot was made from (path, size, modification
time), whether its data is on disk, the source slice's shape and pixel spacing, and the checksum of its bytes.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from vit_ct.data.cache.cache_folder import open_or_rebuild, storage_errors
from vit_ct.data.cache.check_record import FileStat

CACHE_VERSION = 3  # bump when what a slot holds changes (resizing, padding, dtype, checksum): old slots are rebuilt
_NO_FRAME = -1


class SlotKey(NamedTuple):
    """The files one cached slice is made from, as they were when it was made."""

    image: str
    frame: int | None
    image_file: FileStat
    mask: str | None
    mask_file: FileStat | None


class SlotInfo(NamedTuple):
    """What a batch needs of a slot besides its pixels, and the checksum of its pixels."""

    shape: tuple[int, int]  # rows, columns of the source slice
    spacing_mm: tuple[float, float] | None  # of the source slice
    checksum: int  # XXH3 of the slot's HU bytes and its mask's (`slice_cache.slot_checksum`)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS slots (
    slot INTEGER PRIMARY KEY, image TEXT, frame INTEGER, mask TEXT, image_size INTEGER, image_mtime_ns INTEGER,
    mask_size INTEGER, mask_mtime_ns INTEGER, mask_slot INTEGER, rows INTEGER, cols INTEGER, spacing_rows REAL,
    spacing_cols REAL, checksum INTEGER, done INTEGER, UNIQUE (image, frame, mask)
);
CREATE TABLE IF NOT EXISTS grid (img_size INTEGER, hu_dtype TEXT);
CREATE TABLE IF NOT EXISTS suspect (slot INTEGER);
"""  # suspect: slots a reader found changed; the next check then verifies every slot


def _identity(key: SlotKey) -> tuple[str, int, str]:
    return key.image, _NO_FRAME if key.frame is None else key.frame, key.mask or ""


def _stored_key(key: SlotKey) -> tuple[int, int, int, int]:
    mask = key.mask_file or FileStat(-1, -1)
    return key.image_file.size, key.image_file.mtime_ns, mask.size, mask.mtime_ns


class SlotIndex:
    """The slots of one cache, as arrays indexed by slot (``done``, ``mask_slots``, ``shapes``, ``spacings``,
    ``checksums``), kept in an SQLite file.

    Args:
        path: The index file (created when missing).
        grid: ``(img_size, hu dtype name)``: an index made for another grid or dtype is emptied.
        on_empty: Called when the index starts empty over old data (another grid, a version bump, a file that is not
            a database): deletes the data files, whose bytes mean nothing without it.
    """

    def __init__(self, path: str | os.PathLike, *, grid: tuple[int, str], on_empty: Callable[[], None]) -> None:
        self.path = Path(path)
        self.grid = grid
        self._on_empty = on_empty
        self._db: sqlite3.Connection | None = None
        self._pid = os.getpid()
        with storage_errors(self.path.parent):
            rebuilt = f"the cache in {self.path.parent} is rebuilt from the source files"
            open_or_rebuild(self.path, self._open, self.close, rebuilt, what="index", stacklevel=3)

    def _connect(self) -> sqlite3.Connection:
        if self._db is None or self._pid != os.getpid():  # a connection must not cross a fork (DataLoader workers)
            self._db, self._pid = sqlite3.connect(self.path), os.getpid()
        return self._db

    def _open(self) -> None:
        db = self._connect()
        same = db.execute("PRAGMA user_version").fetchone()[0] == CACHE_VERSION
        if not same or db.execute("SELECT img_size, hu_dtype FROM grid").fetchone() not in (None, self.grid):
            db.executescript("DROP TABLE IF EXISTS slots; DROP TABLE IF EXISTS grid; DROP TABLE IF EXISTS suspect;")
            self._on_empty()
        db.executescript(_SCHEMA)
        with db:
            db.execute(f"PRAGMA user_version = {CACHE_VERSION}")
            if db.execute("SELECT img_size FROM grid").fetchone() is None:
                db.execute("INSERT INTO grid VALUES (?, ?)", self.grid)
        self.load()

    def load(self) -> None:
        """Read the slot table into the arrays, and the slots by identity."""
        columns = (
            "slot, image, frame, mask, image_size, image_mtime_ns, mask_size, mask_mtime_ns, mask_slot, rows, cols,"
            " spacing_rows, spacing_cols, checksum, done"
        )
        rows = self._connect().execute(f"SELECT {columns} FROM slots").fetchall()
        n = max((row[0] for row in rows), default=-1) + 1
        self.done = np.zeros(n, dtype=bool)
        self.mask_slots = np.full(n, -1, dtype=np.int64)
        self.shapes = np.zeros((n, 2), dtype=np.int64)
        self.spacings = np.full((n, 2), np.nan)
        self.checksums = np.full(n, -1, dtype=np.int64)
        self._by_identity: dict[tuple[str, int, str], tuple[int, tuple[int, int, int, int]]] = {}
        if rows:  # by column, in numpy: a Python loop that set each slot's entries cost ~10 us a slot, every run
            slot, image, frame, mask, *stored, mask_slot, r, c, sr, sc, checksum, done = zip(*rows, strict=True)
            identities = zip(image, frame, mask, strict=True)
            self._by_identity = dict(zip(identities, zip(slot, zip(*stored, strict=True), strict=True), strict=True))
            slot = np.array(slot, dtype=np.int64)
            self.done[slot] = np.array(done, dtype=bool)
            self.mask_slots[slot] = np.array(mask_slot, dtype=np.int64)
            self.shapes[slot] = np.nan_to_num(np.array([r, c], dtype=float).T).astype(np.int64)  # None: unfinished
            self.spacings[slot] = np.array([sr, sc], dtype=float).T  # None: NaN
            self.checksums[slot] = [-1 if value is None else value for value in checksum]  # 63 bits: not via float
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
        """Slots (and mask slots, -1 without a mask) for these keys' slices, recorded unfinished: a key's own slot
        when its files changed, else a new one after the last."""
        slots = np.empty(len(keys), dtype=np.int64)
        mask_slots = np.full(len(keys), -1, dtype=np.int64)
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
        with storage_errors(self.path.parent), self._connect() as db:
            db.executemany(
                "INSERT OR REPLACE INTO slots (slot, image, frame, mask, image_size, image_mtime_ns, mask_size,"
                " mask_mtime_ns, mask_slot, done) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
                rows,
            )
        self.load()
        return slots, mask_slots

    def commit(self, written: Sequence[tuple[int, SlotInfo]]) -> None:
        """Mark slots finished, with what a batch needs of them."""
        with storage_errors(self.path.parent), self._connect() as db:
            db.executemany(
                "UPDATE slots SET rows = ?, cols = ?, spacing_rows = ?, spacing_cols = ?, checksum = ?, done = 1"
                " WHERE slot = ?",
                [(*info.shape, *(info.spacing_mm or (None, None)), info.checksum, slot) for slot, info in written],
            )
        for slot, info in written:
            self.done[slot] = True
            self.shapes[slot] = info.shape
            self.spacings[slot] = info.spacing_mm or (np.nan, np.nan)
            self.checksums[slot] = info.checksum

    def invalidate(self, slots: Sequence[int], *, suspect: bool = False) -> None:
        """Mark slots unfinished, so that the next check rebuilds them; ``suspect``: also have it verify every slot
        (a reader found these changed, so others may be)."""
        slots = [int(slot) for slot in slots]
        with storage_errors(self.path.parent), self._connect() as db:
            db.executemany("UPDATE slots SET done = 0 WHERE slot = ?", [(slot,) for slot in slots])
            if suspect:
                db.executemany("INSERT INTO suspect VALUES (?)", [(slot,) for slot in slots])
        self.done[slots] = False

    def suspects(self) -> bool:
        """Whether a reader found changed slots since the last `clear_suspects`."""
        return self._connect().execute("SELECT COUNT(*) FROM suspect").fetchone()[0] > 0

    def clear_suspects(self) -> None:
        with storage_errors(self.path.parent), self._connect() as db:
            db.execute("DELETE FROM suspect")

    def sources(self, slots: Sequence[int]) -> list[str]:
        """The image (and frame) each slot was made from, for messages."""
        found = []
        for slot in slots:
            row = self._connect().execute("SELECT image, frame FROM slots WHERE slot = ?", (int(slot),)).fetchone()
            found.append("?" if row is None else row[0] + ("" if row[1] == _NO_FRAME else f" (slice {row[1]})"))
        return found

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_db": None}  # each process connects on its own

    def close(self) -> None:
        if self._db is not None and self._pid == os.getpid():
            self._db.close()
        self._db = None
