"""The pre-run check's verdict on each file, kept in one small SQLite file per manifest, so that a later run, a resume
and the other DDP ranks reuse it instead of reading every file again. An entry holds while the file keeps the size and
modification time it was read with (and, for slices, the read options); anything else is read again.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from vit_ct.data.cache.cache_folder import open_or_rebuild, storage_errors

RECORD_VERSION = 2  # bump when what the check accepts changes, so that older verdicts are not trusted
# 2: slices carry the reader's note (RSNA's wrapped 12-bit values, read unwrapped since)
_NO_FRAME = -1  # `frame=None` (a single-slice file) as stored


class FileStat(NamedTuple):
    """What a file is recognised by between runs."""

    size: int  # bytes
    mtime_ns: int


def stat_file(path: str) -> FileStat | None:
    """The file's size and modification time, or None when it cannot be trusted to a record: missing, not a regular
    file, empty or unreadable (the check reads such files again each run, which fails at once with the reason)."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(found.st_mode) or found.st_size == 0 or not os.access(path, os.R_OK):
        return None
    return FileStat(found.st_size, found.st_mtime_ns)


class ImageEntry(NamedTuple):
    """The check's reading of one slice (`load_ct_slice`) and its file."""

    file: FileStat
    reason: str | None  # why the slice cannot be used; None when it can
    digest: str | None  # BLAKE2b of the file's bytes (copies of one image)
    shape: tuple[int, int] | None  # rows, columns
    spacing_mm: tuple[float, float] | None  # row, column spacing from the header; None when it gives none
    modality: str | None  # DICOM Modality ("" when none); None for NIfTI and .npy
    note: str = ""  # what the reader corrected (`read_ct_slice`), "" for nothing


class MaskEntry(NamedTuple):
    """The check's reading of one lesion mask (`load_mask`)."""

    file: FileStat
    reason: str | None
    shape: tuple[int, int] | None
    lesion: bool  # any lesion pixel


_SCHEMA = """
CREATE TABLE IF NOT EXISTS images (
    path TEXT, frame INTEGER, options TEXT, size INTEGER, mtime_ns INTEGER, reason TEXT, digest TEXT,
    rows INTEGER, cols INTEGER, spacing_rows REAL, spacing_cols REAL, modality TEXT, note TEXT,
    PRIMARY KEY (path, frame, options)
);
CREATE TABLE IF NOT EXISTS masks (
    path TEXT, frame INTEGER, size INTEGER, mtime_ns INTEGER, reason TEXT, rows INTEGER, cols INTEGER,
    lesion INTEGER, PRIMARY KEY (path, frame)
);
"""


def _frame(frame: int | None) -> int:
    return _NO_FRAME if frame is None else frame


def _options(read_options: dict) -> str:
    return json.dumps(read_options, sort_keys=True, default=list)


def _pair(a, b) -> tuple | None:
    return None if a is None or (isinstance(a, float) and math.isnan(a)) else (a, b)


class CheckRecord:
    """Verdicts of the manifest check, by file, in ``path`` (an SQLite file, created when missing).

    A slice's verdict holds only for the read options (`load_ct_slice`'s keyword arguments) it was reached with.

    Args:
        path: The record file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.added = 0  # verdicts this object added: files read by this process's check
        self._db: sqlite3.Connection | None = None
        try:
            with storage_errors(self.path.parent):
                self.path.parent.mkdir(parents=True, exist_ok=True)
                rebuilt = "it is rebuilt, so every file of the manifest is read again"
                open_or_rebuild(self.path, self._open, self.close, rebuilt, stacklevel=2)
        except (OSError, sqlite3.Error) as e:
            raise ValueError(
                f"cannot keep the check record {self.path} ({type(e).__name__}: {e}); choose a writable folder with"
                " --data.init_args.cache_dir (or VIT_CT_CACHE_DIR)"
            ) from None

    def _open(self) -> None:
        self._db = sqlite3.connect(self.path)
        if self._db.execute("PRAGMA user_version").fetchone()[0] != RECORD_VERSION:
            self._db.executescript(f"DROP TABLE IF EXISTS images; DROP TABLE IF EXISTS masks;{_SCHEMA}")
            self._db.execute(f"PRAGMA user_version = {RECORD_VERSION}")
            self._db.commit()

    def images(self, read_options: dict) -> dict[tuple[str, int | None], ImageEntry]:
        """Every slice verdict reached with these read options, by (path, frame)."""
        rows = self._db.execute(
            "SELECT path, frame, size, mtime_ns, reason, digest, rows, cols, spacing_rows, spacing_cols, modality,"
            " note FROM images WHERE options = ?",
            (_options(read_options),),
        )
        return {
            (path, None if frame == _NO_FRAME else frame): ImageEntry(
                FileStat(size, mtime), reason, digest, _pair(r, c), _pair(sr, sc), modality, note or ""
            )
            for path, frame, size, mtime, reason, digest, r, c, sr, sc, modality, note in rows
        }

    def masks(self) -> dict[tuple[str, int | None], MaskEntry]:
        """Every mask verdict, by (path, frame)."""
        rows = self._db.execute("SELECT path, frame, size, mtime_ns, reason, rows, cols, lesion FROM masks")
        return {
            (path, None if frame == _NO_FRAME else frame): MaskEntry(
                FileStat(size, mtime), reason, _pair(r, c), bool(lesion)
            )
            for path, frame, size, mtime, reason, r, c, lesion in rows
        }

    def add(
        self,
        read_options: dict,
        images: Iterable[tuple[str, int | None, ImageEntry]],
        masks: Iterable[tuple[str, int | None, MaskEntry]] = (),
    ) -> None:
        """Keep these verdicts (slices read with ``read_options``), replacing older ones of the same files, in one
        transaction."""
        options = _options(read_options)
        images, masks = list(images), list(masks)
        self.added += len(images) + len(masks)
        with storage_errors(self.path.parent), self._db:
            self._db.executemany(
                "INSERT OR REPLACE INTO images VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (path, _frame(frame), options, *e.file, e.reason, e.digest, *(e.shape or (None, None)),
                     *(e.spacing_mm or (None, None)), e.modality, e.note)
                    for path, frame, e in images
                ],
            )  # fmt: skip
            self._db.executemany(
                "INSERT OR REPLACE INTO masks VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(path, _frame(frame), *e.file, e.reason, *(e.shape or (None, None)), int(e.lesion))
                 for path, frame, e in masks],
            )  # fmt: skip

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
