"""Slices on the model grid in HU and their lesion masks, preprocessed once into memory-mapped files that every
DataLoader worker and DDP rank reads through the one page cache instead of holding its own copy. A slot is used only
while the files it was made from keep their size and modification time, only once its data is on disk, and only
while its bytes match the checksum (XXH3) written with them.

Where the integrity checks run. A slot at 256 px is 128 KiB (float16), so RSNA's 750,000 are 98 GB: reading them all
at every start would cost minutes where a later run should start in seconds. Instead:
- opening the cache (in the pre-run check, under its lock) compares each data file's size with the slots committed
  into it: slots past the end of a truncated or deleted file are marked unfinished, so the check rebuilds them; an
  index that is not a database is rebuilt (`vit_ct.data.cache.cache_index`);
- the check verifies a random sample of 64 of the manifest's slots (8 MiB): a data file overwritten as a whole fails
  it, and then every slot is verified and the changed ones rebuilt; every slot is verified after a reader found one;
- every batch verifies the slots it gathers, so a changed byte is never trained on: the batch raises `CacheSlotError`
  naming the slot's source image, and marks it for the next check to rebuild. XXH3 hashes about as fast as the
  gather copies (`benchmarks/startup_cache.py` times a batch verified and gathered); zlib's CRC-32 was far slower.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import xxhash

from vit_ct.data.cache.cache_folder import cache_folder, storage_errors
from vit_ct.data.cache.cache_index import SlotIndex, SlotInfo, SlotKey
from vit_ct.data.io.reader import READER_VERSION
from vit_ct.data.transforms.model_input import grid_hu, grid_mask

__all__ = ["CacheSlotError", "SliceCache", "SlotInfo", "SlotKey", "cache_folder"]

HU_DTYPE = np.float16  # steps of 0.03 HU at brain values (32-64 HU), 0.5 HU near 1000 (bone): below any window's use
START_SAMPLE = 64  # slots each pre-run check verifies
_DATA_FILES = ("hu.f16", "hu.f32", "mask.u8")


class CacheSlotError(ValueError):
    """Cached slots whose bytes are not those written into them, or that a data file no longer holds."""


def slot_checksum(hu: np.ndarray, mask: np.ndarray | None) -> int:
    """XXH3 of a slot's HU bytes, seeding that of its mask's (None: the slot has no mask), in 63 bits (an SQLite
    integer)."""
    checksum = xxhash.xxh3_64_intdigest(np.ascontiguousarray(hu))
    if mask is not None:
        checksum = xxhash.xxh3_64_intdigest(np.ascontiguousarray(mask), seed=checksum)
    return checksum & 0x7FFF_FFFF_FFFF_FFFF


class SliceCache:
    """The slices of one manifest on one model grid, in ``folder``: ``index.sqlite`` (which files each slot holds,
    and its checksum), ``hu.f16`` or ``hu.f32`` (slots x S x S HU) and ``mask.u8`` (mask slots x S x S, 0/1).

    Writers (the manifest check's worker processes) fill slots `allocate` handed out; `commit` makes them usable once
    their data is on disk, so a killed build leaves unfinished slots that the next build writes again. Readers see
    the slots committed when they opened the cache.

    Args:
        folder: The cache's folder (created when missing).
        img_size: Side of the model grid.
        hu_dtype: How HU are stored: float16 (the disk cache, windowed per batch) or float32 (exactly the grid's
            values: what the in-memory cache is filled from).
    """

    def __init__(self, folder: str | os.PathLike, *, img_size: int, hu_dtype=HU_DTYPE) -> None:
        self.folder = Path(folder)
        self.img_size = img_size
        self.hu_dtype = np.dtype(hu_dtype)
        self.hu_file = self.folder / f"hu.f{self.hu_dtype.itemsize * 8}"
        self.mask_file = self.folder / "mask.u8"
        self.written = 0  # slots this object committed: slices preprocessed by this process
        self.lost = 0  # committed slots a data file no longer held when this object opened the cache
        self._maps: tuple[np.ndarray | None, np.ndarray | None] | None = None
        self._fds: dict[Path, int] = {}
        with storage_errors(self.folder):
            self.folder.mkdir(parents=True, exist_ok=True)
        self.index = SlotIndex(
            self.folder / "index.sqlite", grid=(img_size, self.hu_dtype.name), on_empty=self._remove_data
        )
        self._drop_lost_slots()

    @classmethod
    def for_grid(cls, folder: str | os.PathLike, *, img_size: int, read_options: dict, hu_dtype=HU_DTYPE) -> SliceCache:
        """The cache in a manifest's ``folder`` (`cache_folder`) for this grid, these read options and this dtype."""
        key = {**read_options, "reader": READER_VERSION}  # a slice an older reader cached is read again
        options = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=4).hexdigest()
        suffix = "" if np.dtype(hu_dtype) == np.float16 else f"-{np.dtype(hu_dtype).name}"
        return cls(Path(folder) / f"grid{img_size}-{options}{suffix}", img_size=img_size, hu_dtype=hu_dtype)

    # The index's arrays, by slot
    done = property(lambda self: self.index.done)
    mask_slots = property(lambda self: self.index.mask_slots)
    shapes = property(lambda self: self.index.shapes)
    spacings = property(lambda self: self.index.spacings)
    checksums = property(lambda self: self.index.checksums)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot's HU."""
        return self.img_size**2 * self.hu_dtype.itemsize

    @property
    def mask_slot_bytes(self) -> int:
        """Bytes of one mask slot."""
        return self.img_size**2

    def _remove_data(self) -> None:
        self.close_files()
        for name in _DATA_FILES:
            (self.folder / name).unlink(missing_ok=True)

    def _held(self, path: Path, itemsize: int) -> int:
        """Slots the data file holds now."""
        try:
            return os.stat(path).st_size // (self.img_size**2 * itemsize)
        except FileNotFoundError:
            return 0

    def _drop_lost_slots(self) -> None:
        """Mark unfinished the committed slots that lie past the end of a data file (truncated or deleted)."""
        lost = np.zeros(len(self.done), dtype=bool)
        short = []
        for path, slots, itemsize in (
            (self.hu_file, np.arange(len(self.done)), self.hu_dtype.itemsize),
            (self.mask_file, self.mask_slots, 1),
        ):
            past = self.done & (slots >= self._held(path, itemsize))
            if past.any():
                short.append(path.name)
                lost |= past
        if lost.any():
            self.lost = int(lost.sum())
            warnings.warn(
                f"{self.folder}: {self.lost} of {int(self.done.sum())} cached slices lie past the end of"
                f" {' and '.join(short)} (truncated or deleted after they were written); the check rebuilds those"
                " its manifest uses from their source files",
                UserWarning,
                stacklevel=3,
            )
            self.index.invalidate(np.flatnonzero(lost))

    # ------------------------------------------------------------------------------------------------ writers

    def lookup(self, keys: Sequence[SlotKey]) -> np.ndarray:
        """The committed slot holding each key's slice as its files are now; -1 where there is none."""
        return self.index.lookup(keys)

    def allocate(self, keys: Sequence[SlotKey]) -> tuple[np.ndarray, np.ndarray]:
        """Slots (and mask slots, -1 without a mask) to write these keys' slices into, marked unfinished until
        `commit`: a key's own slot when its files changed, else a new one at the end (the files grow)."""
        if not keys:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        slots, mask_slots = self.index.allocate(keys)  # unfinished before any writer touches the bytes
        self._maps = None
        with storage_errors(self.folder):  # sparse: unwritten slots take no disk
            for path, count, size in ((self.hu_file, len(self.done), self.slot_bytes),
                                      (self.mask_file, self.index.n_mask_slots, self.mask_slot_bytes)):  # fmt: skip
                if not path.exists() or path.stat().st_size < count * size:
                    with open(path, "ab") as f:
                        f.truncate(count * size)
        return slots, mask_slots

    def write(self, slot: int, mask_slot: int, hu: np.ndarray, mask: np.ndarray | None) -> int:
        """Store one slice ``(rows, cols)`` in HU and its lesion mask (or None) on the model grid (worker side);
        returns the slot's checksum. Plain writes, not the map: a full disk is then an error, not a SIGBUS."""
        pixels = grid_hu(hu, self.img_size)[0].numpy().astype(self.hu_dtype)
        lesion = None if mask is None else grid_mask(mask, self.img_size)[0].numpy().astype(np.uint8)
        self._pwrite(self.hu_file, slot, pixels)
        if lesion is not None:
            self._pwrite(self.mask_file, mask_slot, lesion)
        return slot_checksum(pixels, lesion)

    def _pwrite(self, path: Path, slot: int, data: np.ndarray) -> None:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_WRONLY)
        view = memoryview(np.ascontiguousarray(data)).cast("B")
        offset = slot * len(view)
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written

    def commit(self, written: Sequence[tuple[int, SlotInfo]]) -> None:
        """Mark written slots usable, after flushing the data files to disk (workers wrote them)."""
        if not written:
            return
        with storage_errors(self.folder):
            for path in (self.hu_file, self.mask_file):
                if path.exists():
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
        self.index.commit(written)
        self.written += len(written)

    def invalidate(self, slots: Sequence[int], *, suspect: bool = False) -> None:
        """Mark slots for the next check to rebuild (`SlotIndex.invalidate`)."""
        self.index.invalidate(slots, suspect=suspect)

    def verify(self, slots: np.ndarray, *, sample: int | None = START_SAMPLE) -> np.ndarray:
        """The committed ``slots`` (-1s ignored) whose bytes no longer match their checksum: of a random
        ``sample`` of them, and of all of them when the sample finds one, when ``sample`` is None, or when a reader
        found a changed slot since the last check."""
        used = np.unique(slots[slots >= 0])
        suspects = self.index.suspects()
        sampled = sample is not None and not suspects and len(used) > sample
        if sampled and not len(self._mismatched(np.random.default_rng().choice(used, sample, replace=False))):
            return np.empty(0, dtype=np.int64)
        bad = self._mismatched(used)
        if suspects:
            self.index.clear_suspects()
        return bad

    def _mismatched(self, slots: np.ndarray) -> np.ndarray:
        hu_map, mask_map = self._open()
        bad = []
        for slot in slots:
            mask_slot = self.mask_slots[slot]
            held = hu_map is not None and slot < len(hu_map)
            held &= mask_slot < 0 or (mask_map is not None and mask_slot < len(mask_map))
            mask = None if mask_slot < 0 or not held else mask_map[mask_slot]
            if not held or slot_checksum(hu_map[slot], mask) != self.checksums[slot]:
                bad.append(slot)
        return np.array(bad, dtype=np.int64)

    # ------------------------------------------------------------------------------------------------ readers

    def _open(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Read-only arrays over the data files (None for a missing or empty one)."""
        if self._maps is None:
            maps = []
            for path, dtype in ((self.hu_file, self.hu_dtype), (self.mask_file, np.dtype(np.uint8))):
                count = self._held(path, dtype.itemsize)
                if not count:
                    maps.append(None)
                    continue
                with open(path, "rb") as f:
                    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                pixels = np.frombuffer(mapped, dtype=dtype, count=count * self.img_size**2)
                maps.append(pixels.reshape(count, self.img_size, self.img_size))
            self._maps = tuple(maps)
        return self._maps

    @property
    def has_masks(self) -> bool:
        """Whether any slot holds a lesion mask (the batches then carry ``mask``)."""
        return self._open()[1] is not None

    def batch(self, slots: np.ndarray, *, out: np.ndarray | None = None, out_mask: np.ndarray | None = None) -> dict:
        """Slots as a batch before windowing (`vit_ct.data.transforms.model_input.apply_windows`), in one gather from
        the maps, each slot verified against its checksum: ``hu`` ``(B, 1, S, S)`` in the cache's dtype, ``mask``
        ``(B, 1, S, S)`` uint8 (zeros without a mask; left out when the cache holds no mask at all, as for RSNA:
        zeros are made where the batch lands), ``has_mask``, ``source_shape`` ``(B, 2)`` and ``pixel_spacing_mm``
        ``(B,)`` of the model grid (NaN where unknown). ``out``, ``out_mask``: ``(B, S, S)`` arrays (the cache's dtype;
        uint8, zeros) to gather into, which ``hu`` and ``mask`` then view (the in-memory cache's blocks).

        Raises:
            CacheSlotError: naming the slots' source images, when a slot's bytes are not those written into it or
                its data file was cut short after the check.
        """
        mask_slots = self.mask_slots[slots]
        has_mask = mask_slots >= 0
        self._check_held(slots, mask_slots[has_mask])
        hu_map, mask_map = self._open()
        # a gather: a copy, the map stays read-only ("clip": bounds checked above, and "raise" would gather `out`
        # through a temporary buffer, whose fresh pages cost more than the copy)
        hu = hu_map.take(slots, axis=0, out=out, mode="clip")
        masks = None
        if mask_map is not None:
            masks = out_mask if out_mask is not None else np.zeros((len(slots), self.img_size, self.img_size), np.uint8)
            masks[has_mask] = mask_map[mask_slots[has_mask]]
        changed = [
            slot
            for i, slot in enumerate(slots)
            if slot_checksum(hu[i], masks[i] if has_mask[i] else None) != self.checksums[slot]
        ]
        if changed:
            self._refuse(np.unique(changed))
        shapes = self.shapes[slots]
        # the mean of row and column spacing, scaled from the padded square to the model grid (model_grid_spacing)
        spacing = self.spacings[slots].mean(axis=1) * shapes.max(axis=1) / self.img_size
        batch = {
            "hu": torch.from_numpy(hu)[:, None],
            "has_mask": torch.from_numpy(has_mask),
            "source_shape": torch.from_numpy(shapes),
            "pixel_spacing_mm": torch.from_numpy(spacing.astype(np.float32)),
        }
        if masks is not None:
            batch["mask"] = torch.from_numpy(masks)[:, None]
        return batch

    def _check_held(self, slots: np.ndarray, mask_slots: np.ndarray) -> None:
        """A data file cut short while mapped would kill the reader with SIGBUS: refuse by name instead (a stat:
        microseconds a batch)."""
        for path, wanted, itemsize in ((self.hu_file, slots, self.hu_dtype.itemsize), (self.mask_file, mask_slots, 1)):
            held = self._held(path, itemsize)
            if len(wanted) and wanted.max() >= held:
                raise CacheSlotError(
                    f"{path} holds {held} cached slices but this batch needs slot {wanted.max()}: it was cut short or"
                    " deleted after the check. Nothing of it was used; run the command again (its check rebuilds the"
                    f" lost slices from their source files), or delete {self.folder}"
                )

    def _refuse(self, slots: np.ndarray) -> None:
        listing = ", ".join(
            f"slot {slot} (from {source})" for slot, source in zip(slots, self.index.sources(slots[:3]), strict=False)
        )
        listing += f" and {len(slots) - 3} more" if len(slots) > 3 else ""
        try:
            self.index.invalidate(slots, suspect=True)
            todo = "they are marked: run the command again and its check rebuilds them from their source files"
        except Exception:  # noqa: BLE001 -- the refusal matters more than the mark; then the advice changes
            todo = f"delete {self.folder} and run the command again: it is rebuilt from the source files"
        raise CacheSlotError(
            f"{self.hu_file} does not hold what was written into it: {listing} no longer match their checksum (the"
            f" cache's files were changed after the check). They were not used; {todo}"
        )

    def __getstate__(self) -> dict:
        # Sent to worker processes without maps and files; each opens its own (and its own index connection).
        return {**self.__dict__, "_maps": None, "_fds": {}}

    def close_files(self) -> None:
        self._maps = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def close(self) -> None:
        self.close_files()
        self.index.close()
