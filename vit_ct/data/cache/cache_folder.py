"""The folder of a manifest's derived files (the check record, the slice caches): where it is, and how its files fail
(a full disk, a database file that holds other bytes) as errors and lines that name the file and say what to do.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import sqlite3
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

# SQLite's primary result codes (the low byte of an extended code)
_SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_NOTADB = 11, 13, 26
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no room left: disk, quota, or the largest file allowed
_ADVICE = (
    "free space there, or choose another folder with --data.init_args.cache_dir (or VIT_CT_CACHE_DIR; `cache: false`"
    " needs no cache space, but reads every file every epoch)"
)


def cache_folder(cache_dir: str | os.PathLike | None, manifest: str | os.PathLike) -> Path:
    """Where one manifest's check record and caches live: ``cache_dir`` (None: ``$VIT_CT_CACHE_DIR``, else
    ``~/.cache/vit-ct``, since a data folder may be read-only), then the manifest's name and a hash of its absolute
    path."""
    root = cache_dir or os.environ.get("VIT_CT_CACHE_DIR") or "~/.cache/vit-ct"
    manifest = Path(manifest).resolve()
    return (
        Path(root).expanduser()
        / f"{manifest.stem}-{hashlib.blake2b(str(manifest).encode(), digest_size=6).hexdigest()}"
    )


def _sqlite_code(error: BaseException) -> int | None:
    code = getattr(error, "sqlite_errorcode", None)  # Python 3.11+
    return None if code is None else code & 0xFF


def is_unreadable_database(error: BaseException) -> bool:
    """Whether an SQLite error means the file holds something else than an intact database (other bytes, a torn
    page): not a lock, a full disk or a permission, which rebuilding would not cure."""
    if not isinstance(error, sqlite3.DatabaseError):
        return False
    code = _sqlite_code(error)
    if code is not None:
        return code in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    text = str(error)
    return "file is not a database" in text or "malformed" in text


def is_out_of_space(error: BaseException) -> bool:
    """Whether an error (SQLite's or the OS's) means the disk, a quota or the file size limit left no room."""
    if isinstance(error, sqlite3.Error):
        return _sqlite_code(error) == _SQLITE_FULL or "database or disk is full" in str(error)
    return isinstance(error, OSError) and error.errno in _NO_SPACE


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 1e8 else f"{n_bytes / 1e6:.1f} MB"


def out_of_space_error(
    folder: str | os.PathLike, error: BaseException | None, *, needed: int | None = None
) -> ValueError:
    """The error to raise when the cache folder has no room: names the folder and the disk's free space, says what
    was kept and what to do."""
    try:
        disk = os.statvfs(folder)
        free = f"{_size(disk.f_bavail * disk.f_frsize)} free"
    except OSError:
        free = "free space unknown"
    need = f"the slices to cache need {_size(needed)}, " if needed is not None else ""
    cause = f" ({type(error).__name__}: {error})" if error is not None else ""
    return ValueError(
        f"the cache folder {folder} is out of space ({need}{free}){cause}. What was already checked and cached is"
        f" kept, and a later run resumes from it; {_ADVICE}"
    )


@contextlib.contextmanager
def storage_errors(folder: str | os.PathLike) -> Iterator[None]:
    """Turns running out of space inside the block (SQLite's "database or disk is full", ENOSPC, a quota, the file
    size limit) into `out_of_space_error`; other errors pass as they are."""
    try:
        yield
    except (OSError, sqlite3.Error) as e:
        if is_out_of_space(e):
            raise out_of_space_error(folder, e) from None
        raise


def remove_database(path: str | os.PathLike) -> None:
    """Delete an SQLite file and the journal files beside it."""
    for suffix in ("", "-journal", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def open_or_rebuild(
    path: Path,
    open_: Callable[[], None],
    close: Callable[[], None],
    rebuilt: str,
    *,
    what: str = "file",
    stacklevel: int,
) -> None:
    """``open_()`` an SQLite file of derived data; where it holds other bytes (truncated, overwritten), warn ``{path}
    is not a readable SQLite {what} ({error}): {rebuilt}``, delete it and open a new one: reading the files again gives
    its contents back. Any other database error is raised."""
    try:
        open_()
    except sqlite3.DatabaseError as e:
        if not is_unreadable_database(e):
            raise
        warnings.warn(
            f"{path} is not a readable SQLite {what} ({e}): {rebuilt}", UserWarning, stacklevel=stacklevel + 1
        )
        close()
        remove_database(path)
        open_()
