"""What a killed vit-ct process leaves behind: temporary files and folders named with its process id
(``.last.ckpt.<pid>.tmp`` from an atomic write, ``.<OUT>.<pid>-<token>.partial`` / ``.old`` from predict). The next
process that writes to the same folder removes those whose process is gone; a live process's are never touched.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

# `.<name>.<pid>.tmp` (vit_ct.data.filecheck.atomic_write), `.<name>.<pid>-<token>.partial|old` (vit_ct.prediction)
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
