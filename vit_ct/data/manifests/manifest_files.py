"""The files a manifest names, checked before a run: every slice and mask read by the loaders training uses, each
image file hashed (for copies of one image), and the unusable rows reported by CSV line or skipped. Verdicts are kept
in a `CheckRecord` for later runs, and the same reading fills a `SliceCache`, so that a file is read once at most.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
from rich.progress import MofNCompleteColumn

from vit_ct.data.cache.cache_folder import out_of_space_error, storage_errors
from vit_ct.data.cache.check_record import CheckRecord, FileStat, ImageEntry, MaskEntry, stat_file
from vit_ct.data.cache.slice_cache import START_SAMPLE, SliceCache, SlotInfo, SlotKey
from vit_ct.data.io.dicom import CT_MODALITIES
from vit_ct.data.io.reader import load_mask, read_ct_slice, read_modality, read_pixel_spacing
from vit_ct.data.manifests.check_workers import available_cpus, run_jobs
from vit_ct.data.manifests.duplicates import check_duplicate_images, file_digest
from vit_ct.data.manifests.labels import lesion_rows
from vit_ct.progress import Progress

__all__ = ["BadFile", "validate_manifest_files", "write_bad_files"]

_COMMIT_SECONDS = 5.0  # how often verdicts and written slots are made durable while the check runs


class BadFile(NamedTuple):
    """One unusable file found by `validate_manifest_files`."""

    line: int  # line number in the manifest CSV (header = line 1), or the 1-based row when the table has no CSV
    column: str  # "image" or "mask"
    path: str  # absolute path that was tried
    reason: str


class _Job(NamedTuple):
    """What one distinct (image, frame, mask) of the manifest needs read: its verdicts, its cache slot, or both."""

    image: str
    frame: int | None
    mask: str | None
    image_file: FileStat | None
    mask_file: FileStat | None
    check_image: bool
    check_mask: bool
    slot: int  # -1: not cached
    mask_slot: int


def _reason(e: Exception) -> str:
    return getattr(e, "reason", f"{type(e).__name__}: {e}")  # UnreadableFileError, or a decoder library's own


def _read_image(job: _Job, read: dict) -> tuple[ImageEntry, np.ndarray | None]:
    """Reads the slice with the loader training uses, so whatever it would refuse in a worker later (NaN in a
    NIfTI, values that are not HU) is found now; and hashes the file."""
    file = job.image_file or FileStat(-1, -1)
    try:
        hu, note = read_ct_slice(job.image, job.frame, **read)
        digest = file_digest(job.image)
        spacing = read_pixel_spacing(job.image, job.frame)
        modality = read_modality(job.image) if read["modalities"] != CT_MODALITIES else None
    except Exception as e:
        return ImageEntry(file, _reason(e), None, None, None, None), None
    return ImageEntry(file, None, digest, hu.shape, spacing, modality, note), hu


def _read_mask(job: _Job) -> tuple[MaskEntry, np.ndarray | None]:
    file = job.mask_file or FileStat(-1, -1)
    try:
        lesion = load_mask(job.mask, job.frame)
    except Exception as e:
        return MaskEntry(file, _reason(e), None, False), None
    return MaskEntry(file, None, lesion.shape, bool(lesion.any())), lesion


def _row_problems(
    image: str, mask: str | None, image_entry: ImageEntry, mask_entry: MaskEntry | None, positive: bool
) -> list[tuple[str, str, str]]:
    """(column, path, reason) for each problem of one manifest row, from the verdicts on its files."""
    if image_entry.reason is not None:
        return [("image", image, image_entry.reason)]
    if mask_entry is None:
        return []
    if mask_entry.reason is not None:
        return [("mask", mask, mask_entry.reason)]
    (rows, cols), (mask_rows, mask_cols) = image_entry.shape, mask_entry.shape
    if (mask_rows, mask_cols) != (rows, cols):
        return [("mask", mask, f"mask is {mask_rows}x{mask_cols} but the slice is {rows}x{cols}")]
    if positive and not mask_entry.lesion:
        # An empty mask on a lesion slice would teach the patch head "no lesion anywhere" and drop the slice's
        # localisation score without a word.
        return [("mask", mask, "mask has no lesion pixel but the slice is labelled with a lesion")]
    return []


def _read_job(
    job: _Job, read: dict, cache: SliceCache | None
) -> tuple[ImageEntry | None, MaskEntry | None, int | None]:
    """The fresh verdicts this job asked for (None where it did not) and, when its slice went into the cache, the
    slot's checksum (else None)."""
    image_entry = mask_entry = hu = lesion = None
    if job.check_image or job.slot >= 0:
        image_entry, hu = _read_image(job, read)
    if job.mask is not None and (job.check_mask or job.slot >= 0):
        mask_entry, lesion = _read_mask(job)
    usable = hu is not None and (job.mask is None or (lesion is not None and lesion.shape == hu.shape))
    checksum = cache.write(job.slot, job.mask_slot, hu, lesion) if job.slot >= 0 and usable else None
    return image_entry, mask_entry, checksum


def validate_manifest_files(
    df: pd.DataFrame,
    *,
    on_bad_file: str = "raise",
    progress: bool = True,
    modalities: Sequence[str] | None = CT_MODALITIES,
    stored_values_are_hu: bool = False,
    record: CheckRecord | None = None,
    cache: SliceCache | None = None,
    workers: int | None = None,
) -> tuple[pd.DataFrame, list[BadFile]]:
    """Check every image and mask by reading it as training will, and find copies of one image.

    Each slice is read by `load_ct_slice` and each mask by `load_mask` (in worker processes), and each image file is
    hashed once. A row is bad when its image or mask cannot be used, the mask's size differs from the slice's, or a
    row labelled with a lesion has an empty mask. With a ``record``, files whose verdict it holds (same size and
    modification time, same read options) are not read again, and new verdicts are added to it as they come.

    Args:
        df: a manifest table (`read_manifest`); uses `image`, and `mask`, `slice`, `label` (or the label columns),
            `manifest_line` when present.
        on_bad_file: "raise" to raise one error listing every bad row, or "skip" to drop those rows.
        progress: show a rich progress bar.
        modalities: DICOM Modality values accepted (`load_ct_slice`); None accepts any.
        stored_values_are_hu: accept CT DICOM without rescale tags, stored values taken as HU (`load_ct_slice`).
        record: verdicts of earlier checks to reuse and extend.
        cache: store every good row's slice on the model grid here, from the same reading (rows already cached as
            their files are now are not read; a sample of their slots is verified against its checksums, and slots
            that changed are rebuilt).
        workers: processes reading files (they die with this one); None: one per CPU this process may use.

    Returns:
        The good rows (index kept) with an `image_digest` column (the hash of the image file's bytes), and
        `cache_slot` (the row's slot) with a ``cache``, and in ``attrs["read_notes"]`` how many of their slices the
        reader corrected, by note (`read_ct_slice`); and the list of problems found, one `BadFile` per problem.

    Raises:
        ValueError: with `on_bad_file="raise"` when any file is unusable: every bad row with its CSV line, path
            and reason. Also (either way) when copies of one image have different labels or splits, and when the
            cache's or the record's disk has no room (`vit_ct.data.cache.cache_folder.out_of_space_error`).
    """
    if on_bad_file not in ("raise", "skip"):
        raise ValueError(f"on_bad_file must be 'raise' or 'skip', got {on_bad_file!r}")
    if "image" not in df.columns:
        raise ValueError("the manifest table has no 'image' column")
    has_lines = "manifest_line" in df.columns
    lines = df["manifest_line"].tolist() if has_lines else list(range(1, len(df) + 1))
    read = {
        "modalities": None if modalities is None else tuple(modalities),
        "stored_values_are_hu": stored_values_are_hu,
    }
    rows = _rows(df)
    entries, slots = _check_files(rows, read, record, cache, workers or available_cpus(), progress)
    positive = lesion_rows(df, df.attrs.get("label_columns"))
    found: dict[int, list[tuple[str, str, str]]] = {}
    for i, ((image, _, mask), (image_entry, mask_entry)) in enumerate(zip(rows, entries, strict=True)):
        problems = _row_problems(image, mask, image_entry, mask_entry, bool(positive[i]))
        if problems:
            found[i] = problems
    bad = [BadFile(int(lines[i]), *problem) for i in sorted(found) for problem in found[i]]
    if bad and on_bad_file == "raise":
        where = f"line number in {df.attrs['manifest']}" if has_lines and df.attrs.get("manifest") else "1-based row"
        word = "line" if has_lines else "row"
        listing = "\n".join(f"  {word} {b.line}: {b.column} {b.path}: {b.reason}" for b in bad)
        raise ValueError(
            f"{len(found)} of {len(df)} manifest rows name unusable files ({word} = {where}):\n{listing}\n"
            "Fix or remove these rows, or skip them (on_bad_file='skip')."
        )
    keep = np.ones(len(df), dtype=bool)
    keep[list(found)] = False
    columns = {"image_digest": [image_entry.digest for image_entry, _ in entries]}
    if cache is not None:
        columns["cache_slot"] = slots
    good = df.assign(**columns)[keep]
    # what the reader corrected, by note, over the slices kept: said once by the run (`corrections_line`)
    notes = {rows[i][:2]: entries[i][0].note for i in np.flatnonzero(keep) if entries[i][0].note}  # by slice
    good.attrs["read_notes"] = dict(Counter(notes.values()))
    where = f"manifest {df.attrs.get('manifest', '')}".rstrip()
    if read["modalities"] != CT_MODALITIES:
        _warn_other_modalities(
            [entries[i][0].modality for i in np.flatnonzero(keep)], where, read["modalities"], len(good)
        )
    check_duplicate_images(good, where)
    return good, bad


def _rows(df: pd.DataFrame) -> list[tuple[str, int | None, str | None]]:
    """(image, frame, mask) of each row."""
    frames = df["slice"].tolist() if "slice" in df.columns else [None] * len(df)
    masks = df["mask"].tolist() if "mask" in df.columns else [None] * len(df)
    return [
        (str(image), None if pd.isna(frame) else int(frame), None if mask is None or pd.isna(mask) else str(mask))
        for image, frame, mask in zip(df["image"], frames, masks, strict=True)
    ]


def _check_files(
    rows: list[tuple[str, int | None, str | None]],
    read: dict,
    record: CheckRecord | None,
    cache: SliceCache | None,
    workers: int,
    progress: bool,
) -> tuple[list[tuple[ImageEntry, MaskEntry | None]], np.ndarray]:
    """The verdicts on each row's files and each row's cache slot (-1 when not cached): from the record and the
    cache where they hold for the files as they are now, else read now (once per distinct image, frame and mask)."""
    stats = {path: stat_file(path) for path in {p for image, _, mask in rows for p in (image, mask) if p is not None}}
    known_images = record.images(read) if record is not None else {}
    known_masks = record.masks() if record is not None else {}

    def known(table: dict, path: str | None, frame: int | None):
        entry = table.get((path, frame))
        return entry if entry is not None and stats.get(path) is not None and entry.file == stats[path] else None

    distinct = list(dict.fromkeys(rows))
    images = {(image, frame): known(known_images, image, frame) for image, frame, _ in distinct}
    masks = {(mask, frame): known(known_masks, mask, frame) for _, frame, mask in distinct if mask is not None}
    slot_of = {row: -1 for row in distinct}
    jobs: dict[tuple, _Job] = {}
    to_cache = []
    if cache is not None:
        keys = [SlotKey(image, frame, stats[image], mask, stats.get(mask)) for image, frame, mask in distinct]
        for row, key, slot in zip(distinct, keys, _cached_slots(cache, keys), strict=True):
            slot_of[row] = int(slot)
            if slot < 0 and _may_cache(key, images[row[:2]], masks.get((row[2], row[1]))):
                to_cache.append((row, key))
        _check_space(cache, [key for _, key in to_cache])
        new_slots, mask_slots = cache.allocate([key for _, key in to_cache])
        for (row, _), slot, mask_slot in zip(to_cache, new_slots, mask_slots, strict=True):
            jobs[row] = _job(row, stats, images, masks, int(slot), int(mask_slot))
    for row in distinct:
        if row not in jobs and (images[row[:2]] is None or (row[2] is not None and masks[(row[2], row[1])] is None)):
            jobs[row] = _job(row, stats, images, masks, -1, -1)

    written: list[tuple[int, SlotInfo]] = []
    fresh_images, fresh_masks = [], []

    def commit() -> None:  # what is committed survives a crash or a kill of this check
        if cache is not None:
            cache.commit(written)
        if record is not None:
            record.add(read, fresh_images, fresh_masks)
        for done in (written, fresh_images, fresh_masks):
            done.clear()

    description = "Checking manifest files" + (" and caching slices" if to_cache else "")
    folder = cache.folder if cache is not None else record.path.parent if record is not None else Path.cwd()
    with (
        Progress(*Progress.get_default_columns(), MofNCompleteColumn(), disable=not progress or not jobs) as bar,
        storage_errors(folder),  # a worker's write or a commit that finds the disk full
    ):
        task = bar.add_task(description, total=len(jobs))
        last = time.monotonic()
        try:
            for job, (image_entry, mask_entry, checksum) in run_jobs(
                list(jobs.values()), _read_job, (read, cache), workers
            ):
                row = (job.image, job.frame, job.mask)
                if image_entry is not None:
                    images[row[:2]] = image_entry
                    if job.image_file is not None:
                        fresh_images.append((job.image, job.frame, image_entry))
                if mask_entry is not None:
                    masks[(job.mask, job.frame)] = mask_entry
                    if job.mask_file is not None:
                        fresh_masks.append((job.mask, job.frame, mask_entry))
                if checksum is not None:
                    slot_of[row] = job.slot
                    written.append((job.slot, SlotInfo(image_entry.shape, image_entry.spacing_mm, checksum)))
                bar.advance(task)
                if time.monotonic() - last > _COMMIT_SECONDS:
                    commit()
                    last = time.monotonic()
        except BaseException:
            with contextlib.suppress(Exception):  # keep what is done; the first error is the one to report
                commit()
            raise
        commit()
    entries = [(images[(image, frame)], None if mask is None else masks[(mask, frame)]) for image, frame, mask in rows]
    return entries, np.array([slot_of[row] for row in rows], dtype=np.int64)


def _cached_slots(cache: SliceCache, keys: list[SlotKey]) -> np.ndarray:
    """`SliceCache.lookup`, after verifying a sample of the slots found (`SliceCache.verify`): slots whose bytes
    changed are marked unfinished, so that this check rebuilds them."""
    slots = cache.lookup(keys)
    changed = cache.verify(slots, sample=START_SAMPLE)
    if len(changed):
        warnings.warn(
            f"{cache.folder}: {len(changed)} cached slices no longer match their checksums (the cache's files were"
            " changed after they were written); they are rebuilt from their source files",
            UserWarning,
            stacklevel=4,
        )
        cache.invalidate(changed)
        slots = cache.lookup(keys)
    return slots


def _check_space(cache: SliceCache, keys: list[SlotKey]) -> None:
    """Refuse before any file is read when the slices to cache cannot fit on the cache's disk."""
    needed = sum(cache.slot_bytes + (cache.mask_slot_bytes if key.mask is not None else 0) for key in keys)
    if needed and needed > shutil.disk_usage(cache.folder).free:
        raise out_of_space_error(cache.folder, None, needed=needed)


def _may_cache(key: SlotKey, image_entry: ImageEntry | None, mask_entry: MaskEntry | None) -> bool:
    """Whether a row's slice is worth a slot: its files are there, and the verdicts known so far allow it."""
    if key.image_file is None or (key.mask is not None and key.mask_file is None):
        return False
    if image_entry is not None and image_entry.reason is not None:
        return False
    if mask_entry is None:
        return True
    return mask_entry.reason is None and (image_entry is None or mask_entry.shape == image_entry.shape)


def _job(row: tuple, stats: dict, images: dict, masks: dict, slot: int, mask_slot: int) -> _Job:
    image, frame, mask = row
    return _Job(
        image,
        frame,
        mask,
        stats.get(image),
        stats.get(mask),
        check_image=images[(image, frame)] is None,
        check_mask=mask is not None and masks[(mask, frame)] is None,
        slot=slot,
        mask_slot=mask_slot,
    )


def _warn_other_modalities(
    modalities_found: list[str | None], where: str, modalities: tuple[str, ...] | None, n_rows: int
) -> None:
    """Accepted non-CT slices are counted once per manifest, so their share is never a surprise."""
    found = pd.Series(modalities_found, dtype=object).dropna()
    other = found[found != "CT"].replace("", "no Modality").value_counts()
    if other.empty:
        return
    counts = ", ".join(f"{name} {count}" for name, count in other.items())
    warnings.warn(
        f"{where}: {other.sum()} of {n_rows} slices are not CT ({counts}), accepted by modalities={modalities}:"
        " their values are used as if they were Hounsfield units",
        UserWarning,
        stacklevel=3,
    )


def write_bad_files(bad: Sequence[BadFile], path: str | os.PathLike) -> Path:
    """Write the rows `validate_manifest_files` skipped as a CSV (line, column, path, reason) and return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(list(bad), columns=list(BadFile._fields)).to_csv(path, index=False)
    return path
