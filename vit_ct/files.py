"""Writing files so that a crash, a kill or a reader never sees half of one: atomic writes (a hidden temporary file
renamed over the target), and what a killed process leaves behind (``.last.ckpt.<pid>.tmp`` from an atomic write,
``.<OUT>.<pid>-<token>.partial`` / ``.old`` from predict), removed by the next process that writes to the same
folder once the one that wrote them is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

# `.<name>.<pid>.tmp` (atomic_write), `.<name>.<pid>-<token>.partial|old` (vit_ct.predict.writer)
_LEFTOVER = re.compile(r"^\..+\.(?P<pid>\d+)(?:-[0-9a-f]+\.(?:partial|old)|\.tmp)$")


def pid_is_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers(folder: str | Path) -> list[Path]:
    """Remove the temporary files and folders in ``folder`` whose writing process no longer exists; returns them."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for path in folder.iterdir():
        match = _LEFTOVER.match(path.name)
        if match is None or int(match["pid"]) == os.getpid() or pid_is_alive(int(match["pid"])):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, *, durable: bool = False) -> Iterator[Path]:
    """Yields a hidden temporary path beside ``path`` to write to; when the block succeeds, renames it over ``path``
    (``os.replace`` is atomic on POSIX and Windows), so a reader or a crash never sees a half-written file, and a
    failure leaves the old file and no temporary one.

    Args:
        path: The file to write.
        durable: Also flush the file and the rename to disk (``fsync``), for files that must survive a power loss.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        if durable:
            _fsync(tmp)
        os.replace(tmp, path)
        if durable and os.name == "posix":
            _fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
