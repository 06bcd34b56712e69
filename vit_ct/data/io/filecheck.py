"""The checks every slice reader shares: the file is there and readable, the requested slice exists in it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


class UnreadableFileError(ValueError):
    """A slice or mask that cannot be used; `path` and `reason` are kept for reports."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path, self.reason = str(path), reason
        super().__init__(f"cannot read {self.path}: {reason}")


def check_file(path: str | os.PathLike) -> Path:
    """The path as a `Path` when it names a readable, non-empty file."""
    p = Path(path)
    if not p.exists():
        raise UnreadableFileError(p, "file not found")
    if not p.is_file():
        raise UnreadableFileError(p, "not a file (a directory?)")
    if not os.access(p, os.R_OK):
        raise UnreadableFileError(p, "no permission to read the file")
    if p.stat().st_size == 0:
        raise UnreadableFileError(p, "file is empty (0 bytes)")
    return p


def frame_index(path: Path, n: int, frame: int | None, what: str) -> int:
    """Validate `frame` against `n` slices; `frame=None` is allowed only when there is exactly one."""
    if frame is None:
        if n == 1:
            return 0
        raise UnreadableFileError(
            path, f"{what} holds {n} slices; choose one with frame= (the manifest's `slice` column), 0..{n - 1}"
        )
    if isinstance(frame, bool) or not isinstance(frame, (int, np.integer)):
        raise UnreadableFileError(path, f"frame must be an integer, got {frame!r}")
    if not 0 <= frame < n:
        raise UnreadableFileError(path, f"frame {frame} is out of range: {what} holds {n} slice(s), 0..{n - 1}")
    return int(frame)
