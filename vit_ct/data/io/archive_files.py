"""The files of an archive folder as a scan search reads them: in path order, hidden files left out, links followed
and each file read once, a loop of links refused by name."""

from __future__ import annotations

import os
from pathlib import Path


def _identity(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_dev, stat.st_ino  # one file or folder, whatever the path (links, mount aliases) it is reached by


def archive_files(root: Path, seen: set[tuple[int, int]]) -> tuple[list[Path], list[tuple[str, str]]]:
    """The files under ``root`` (``root`` itself when it is a file), in path order, hidden files left out, and the
    paths not read with why.

    Links to folders and files are followed (an archive assembled from links to its series is still read), each file
    once: one reached again through another link, or under another root of the same search, is not listed again
    (``seen``, updated here, holds the files listed so far). A link to a folder that holds it (a loop) is not
    followed, and a link to nothing is not read: each is returned with its reason, as is a folder that cannot be read.
    Paths keep the links they were reached through (a manifest names the files as the user sees them).
    """
    problems: list[tuple[str, str]] = []
    if not root.is_dir():
        identity = _identity(root.stat())
        if identity in seen:
            return [], problems
        seen.add(identity)
        return [root], problems
    found: list[Path] = []
    walked: set[tuple[int, int]] = set()  # a folder reached twice through links is walked once

    def walk(folder: Path, above: frozenset[tuple[int, int]]) -> None:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)  # name order: the order of sorted paths
        except OSError as err:
            problems.append((str(folder), f"cannot read this folder ({type(err).__name__}: {err.strerror})"))
            return
        for entry in entries:
            path = folder / entry.name
            try:
                identity = _identity(entry.stat())  # follows links
            except OSError:
                if entry.is_symlink():
                    problems.append((str(path), f"a link to {os.readlink(path)}, which does not exist"))
                continue
            if entry.is_dir():
                if identity in above:
                    problems.append((str(path), f"a link to {os.path.realpath(path)}, a folder that holds it: not"
                                                " followed (it would loop)"))  # fmt: skip
                elif identity not in walked:
                    walked.add(identity)
                    walk(path, above | {identity})
            elif entry.is_file() and not entry.name.startswith(".") and identity not in seen:
                seen.add(identity)
                found.append(path)

    identity = _identity(root.stat())
    walked.add(identity)
    walk(root, frozenset({identity}))
    return found, problems
