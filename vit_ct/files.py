"""Writing files so that a crash, a kill or a reader never sees half of one: atomic writes (a hidden temporary file
renamed over the target), and what a killed process leaves behind (``.last.ckpt.<pid>.tmp`` from an atomic write,
``.<OUT>.<pid>-<token>.partial`` / ``.old`` from predict), removed by the next process that writes to the same
folder once the one that wrote them is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import threading
from collections.abc import Iterable, Iterator
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


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """A block that Ctrl-C or SIGTERM must not cut in two (two renames that swap an output folder in): a signal
    received inside takes effect when the block ends, through whatever handler was there before (Python's
    KeyboardInterrupt, vit-ct's own, the default). Outside the main thread, where handlers cannot be set, the block
    runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.signal(signum, lambda signum, frame: received.append(signum)) for signum in held}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if received:
            signal.raise_signal(received[0])


def replace_folder(source: Path, destination: Path) -> None:
    """Move the complete output ``source`` to ``destination``, replacing what is there. An empty or absent
    ``destination`` is replaced in one atomic rename; a non-empty one is first renamed aside and then deleted, so
    ``destination`` never holds a mix of both (for a moment it does not exist)."""
    if destination.is_dir() and any(destination.iterdir()):
        old = source.with_name(source.name.removesuffix(".partial") + ".old")
        with signals_held():  # a signal between the renames would leave no output at all
            os.replace(destination, old)
            os.replace(source, destination)
        shutil.rmtree(old)
    else:
        os.replace(source, destination)  # rename(2) replaces an empty folder


def staging_folder(destination: Path, token: str | None = None) -> Path:
    """The hidden folder beside ``destination`` that a command writes its output into until it is complete,
    ``.<name>.<pid>-<token>.partial`` (removed by :func:`remove_leftovers` once its process is gone)."""
    token = token or f"{os.getpid()}-{secrets.token_hex(4)}"
    return destination.parent / f".{destination.name}.{token}.partial"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------- names from outside

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")  # what a file name may not hold on some system, or may hide a folder with
NAME_LENGTH = 100  # characters of a name made safe, well under the 255 bytes of a file name


def safe_name(text: object, *, unique: bool = True, length: int = NAME_LENGTH, fallback: str = "unnamed") -> str:
    """One file or folder name from text vit-ct does not control (a manifest cell, a DICOM attribute, a server's
    answer, a reviewer's name), so that it can never decide *where* a file goes: letters, digits, ``.``, ``_`` and
    ``-`` are kept, every other character (``/``, ``\\``, a space, a byte that is not UTF-8) becomes ``_``, as does a
    leading dot (no ``..``, no hidden file), and the name is cut to ``length`` characters.

    Args:
        text: The name as it came.
        unique: Where the name had to change, append ``-`` and 8 hex digits of the original's SHA-256, so that two
            texts that differ (``a/b`` and ``a_b``) never share a file; a name that needed no change is kept as is.
        length: The most characters of the name before that suffix.
        fallback: The name of an empty text.
    """
    text = str(text)
    name = _UNSAFE.sub("_", text)
    name = ("_" + name[1:] if name.startswith(".") else name)[:length] or fallback
    if name == text or not unique:
        return name
    return f"{name}-{hashlib.sha256(text.encode('utf-8', 'surrogateescape')).hexdigest()[:8]}"


def inside(folder: str | os.PathLike, *parts: str | os.PathLike) -> Path:
    """``folder / parts``, refused with ``ValueError`` where it would lie outside ``folder`` (a ``..`` or an absolute
    part, a link that leads out): the check every writer makes after :func:`safe_name`, so a name that slipped
    through still cannot write elsewhere."""
    folder = Path(folder)
    path = folder.joinpath(*parts)
    if not path.resolve().is_relative_to(folder.resolve()):
        raise ValueError(f"{Path(*parts)} would be written outside {folder}; expected a name inside it")
    return path


# ------------------------------------------------------------------------- a command's own output

OUTPUT_RECORD = ".vit-ct-output.json"  # in a command's output folder: which command wrote it, and every file


def file_times(folder: str | os.PathLike) -> dict[str, int]:
    """Every file in ``folder`` (relative) with its modification time (ns): taken before a run that writes into a
    folder holding files of others, it tells which files the run wrote (:func:`record_output`'s ``since``)."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    return {p.relative_to(folder).as_posix(): p.stat().st_mtime_ns for p in folder.rglob("*") if not p.is_dir()}


def record_output(folder: str | os.PathLike, command: str, *, since: dict[str, int] | None = None) -> None:
    """Write into ``folder`` that ``command`` wrote it, listing every file in it: what a later ``--overwrite`` may
    replace (:func:`check_replaceable`). Call it once the output is complete. ``since``: the folder's
    :func:`file_times` before the run: then only the files the run wrote or changed are listed, with those of an
    earlier record of ``command`` still there (a reviewer's files written between runs are not)."""
    folder = Path(folder)
    now = file_times(folder)
    if since is None:
        files = sorted(now)
    else:
        earlier = recorded_files(folder, command)
        files = sorted(f for f, t in now.items() if since.get(f) != t or f in earlier)
    files = [f for f in files if f != OUTPUT_RECORD]
    with atomic_write(folder / OUTPUT_RECORD) as tmp:
        tmp.write_text(json.dumps({"command": command, "files": files}, indent=0) + "\n")


def recorded_files(folder: str | os.PathLike, command: str) -> set[str]:
    """The files (relative) an earlier ``command`` recorded writing into ``folder``, its record included; none where
    the folder holds no readable record of ``command`` (:func:`record_output`)."""
    try:
        record = json.loads((Path(folder) / OUTPUT_RECORD).read_text())
        return set(record["files"]) | {OUTPUT_RECORD} if record["command"] == command else set()
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def foreign_files(folder: str | os.PathLike, command: str) -> list[str]:
    """The files in ``folder`` (relative, sorted) that an earlier ``command`` did not write: all of them where the
    folder holds no record of ``command``."""
    folder = Path(folder)
    present = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir())
    written = recorded_files(folder, command)
    return [f for f in present if f not in written]


def check_replaceable(
    folder: str | os.PathLike,
    command: str,
    *,
    overwrite: bool,
    inputs: Iterable[str | os.PathLike] = (),
    option: str = "--output_dir",
    how: str = "--overwrite",
) -> bool:
    """Refuse an output folder that a run of ``vit-ct command`` may not write into; returns whether it holds an
    earlier output of it, to be replaced once the new one is complete.

    A folder that is absent or empty is taken; one holding an earlier output of ``command`` (its record, and no other
    file) only with ``overwrite``; one holding a file that ``command`` did not write never, with or without
    ``overwrite``, since replacing the folder would delete what the user had; nor one holding ``inputs``, files the
    run reads. ``option`` and ``how`` name the folder's option and the way to ask for the overwrite in messages.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{option} {folder} is a file; expected a folder (absent or empty)")
    if not folder.is_dir() or not any(folder.iterdir()):
        return False
    for path in map(Path, inputs if overwrite else ()):
        if path.resolve().is_relative_to(folder.resolve()):
            raise ValueError(
                f"--overwrite would delete {path}, which lies in {option} {folder}; choose another {option}"
            )
    foreign = foreign_files(folder, command)
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ValueError(
            f"{option} {folder} is not empty and holds {len(foreign)} file(s) that vit-ct {command} did not write"
            f" ({shown}); it replaces only its own earlier output, so never deletes them. Choose a new {option}, or"
            " move those files away"
        )
    if not overwrite:
        raise ValueError(
            f"{option} {folder} is not empty: it holds an earlier output of vit-ct {command}. Choose a new {option},"
            f" or pass {how} to replace it (once the new output is complete; none of its files are kept)"
        )
    return True
