"""The on-disk caches under faults: a data file overwritten, cut short or deleted, an index or check record that is
not a database, and a full disk. Each is rebuilt from the source files (with one line saying so) or refused by name,
never trained on; what a rebuilt cache gives is what a fresh one gives, byte for byte."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from npy_manifest import write_npy_manifest

from vit_ct.data.cache.check_record import CheckRecord
from vit_ct.data.cache.slice_cache import CacheSlotError, SliceCache
from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.data.manifests import manifest_files
from vit_ct.data.manifests.manifest import read_manifest, validate_manifest_files

MODES = {"disk": "hu.f16", True: "hu.f32"}  # cache option: its data file


def data_module(manifest: Path, cache, cache_dir: Path) -> CTSliceDataModule:
    return CTSliceDataModule(
        str(manifest), cache=cache, cache_dir=str(cache_dir), img_size=32, windows=["brain", "subdural"],
        batch_size=64, num_workers=0, augment=False,
    )  # fmt: skip


def val_batch(data: CTSliceDataModule) -> dict:
    data.setup("validate")
    return data.on_after_batch_transfer(next(iter(data.val_dataloader())), 0)


def assert_same_batch(batch: dict, reference: dict) -> None:
    assert batch.keys() == reference.keys()
    for key in batch:
        assert torch.equal(batch[key], reference[key]) or torch.allclose(batch[key], reference[key], equal_nan=True)


def grid_folder(data: CTSliceDataModule) -> Path:
    return data.slice_cache.folder


def warning_lines(record) -> str:
    return "\n".join(str(w.message) for w in record)


@pytest.fixture
def built(tmp_path):
    """A manifest (7 val slices of 11, masks on every other), its cache built in both modes, and the batches a fresh
    cache gives."""
    manifest = write_npy_manifest(tmp_path / "data", train=3, val=7, test=1)
    fresh = {mode: val_batch(data_module(manifest, mode, tmp_path / f"fresh-{mode}")) for mode in MODES}
    return manifest, fresh


@pytest.mark.parametrize("mode", list(MODES))
def test_a_data_file_overwritten_with_other_bytes_is_rebuilt_before_the_run(built, tmp_path, mode):
    """The probe's case: `grid*/hu.f16` overwritten whole ("0 files read", NaN losses, a NaN last.ckpt, exit 0)."""
    manifest, fresh = built
    first = data_module(manifest, mode, tmp_path / "cache")
    first.check("fit")
    path = grid_folder(first) / MODES[mode]
    path.write_bytes(np.random.default_rng(0).bytes(path.stat().st_size))  # NaNs and huge values, as float16
    later = data_module(manifest, mode, tmp_path / "cache")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = val_batch(later)
    assert "11 cached slices no longer match their checksums" in warning_lines(caught)
    assert later.slice_cache.written == 11 and later.check_record.added == 22  # every slice and mask read again
    assert_same_batch(batch, fresh[mode])


@pytest.mark.parametrize("mode", list(MODES))
def test_a_slot_changed_after_the_check_is_refused_by_name_and_rebuilt_by_the_next_check(built, tmp_path, mode):
    manifest, fresh = built
    data = data_module(manifest, mode, tmp_path / "cache")
    data.check("fit")  # checked; the slices are read from the cache afterwards
    cache = data.slice_cache
    row = data.split_table("val").iloc[2]
    slot = int(row["cache_slot"])
    with open(cache.hu_file, "r+b") as f:  # one pixel of one slot
        f.seek(slot * cache.slot_bytes + 100)
        f.write(b"\x7f\x7f")
    with pytest.raises(CacheSlotError) as refused:
        val_batch(data)  # disk: the batch's gather; memory: the fill before the first epoch
    message = str(refused.value)
    assert f"slot {slot} (from {row['image']})" in message and str(cache.hu_file) in message
    assert "run the command again and its check rebuilds them" in message

    later = data_module(manifest, mode, tmp_path / "cache")
    assert_same_batch(val_batch(later), fresh[mode])
    assert later.slice_cache.written == 1  # that slot only, found because a reader marked it


@pytest.mark.medium
def test_a_loader_worker_refuses_a_changed_slot_by_name_and_marks_it(built, tmp_path):
    """In a forked DataLoader worker, which opens its own connection to the index to mark the slot."""
    manifest, fresh = built
    data = data_module(manifest, "disk", tmp_path / "cache")
    data.num_workers = 1
    data.setup("validate")
    slot = int(data.split_table("val").iloc[0]["cache_slot"])
    with open(data.slice_cache.hu_file, "r+b") as f:
        f.seek(slot * data.slice_cache.slot_bytes)
        f.write(b"\x00\x7c" * 8)  # float16 infinities
    with pytest.raises(CacheSlotError, match=rf"slot {slot} \(from .*s003.npy\)"):
        next(iter(data.val_dataloader()))
    later = data_module(manifest, "disk", tmp_path / "cache")
    assert_same_batch(val_batch(later), fresh["disk"])
    assert later.slice_cache.written == 1


def test_after_a_reader_found_a_changed_slot_the_next_check_verifies_every_slot(built, tmp_path):
    manifest, _ = built
    data = data_module(manifest, "disk", tmp_path / "cache")
    data.check("fit")
    cache = data.slice_cache
    slots = data.table["cache_slot"].to_numpy()
    for slot in slots[:2]:
        with open(cache.hu_file, "r+b") as f:
            f.seek(int(slot) * cache.slot_bytes)
            f.write(b"\xff" * 64)
    with pytest.raises(CacheSlotError):
        cache.batch(slots[:1])  # a reader finds the first
    assert list(cache.verify(slots, sample=1)) == list(slots[:2])  # every slot now, whatever the sample
    assert list(cache.verify(slots, sample=0)) == []  # until the next reader finds one: a sample of none


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("how", ["truncated", "deleted"])
def test_a_cut_short_or_deleted_data_file_is_rebuilt_before_the_run(built, tmp_path, mode, how):
    """Today: an IndexError after training started (truncated), `TypeError: 'NoneType'...` (deleted)."""
    manifest, fresh = built
    first = data_module(manifest, mode, tmp_path / "cache")
    first.check("fit")
    path = grid_folder(first) / MODES[mode]
    if how == "deleted":
        path.unlink()
    else:
        os.truncate(path, 5 * first.slice_cache.slot_bytes + 7)  # 5 slots and a bit of the 6th
    later = data_module(manifest, mode, tmp_path / "cache")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = val_batch(later)
    lost = 11 if how == "deleted" else 6
    assert f"{lost} of 11 cached slices lie past the end of {MODES[mode]}" in warning_lines(caught)
    assert later.slice_cache.written == lost
    assert_same_batch(batch, fresh[mode])


def test_a_data_file_cut_short_while_a_run_reads_it_is_refused_by_name(built, tmp_path):
    manifest, _ = built
    data = data_module(manifest, "disk", tmp_path / "cache")
    data.setup("validate")
    loader = iter(data.val_dataloader())
    os.truncate(data.slice_cache.hu_file, data.slice_cache.slot_bytes)
    with pytest.raises(CacheSlotError, match=f"{data.slice_cache.hu_file} holds 1 cached slices but .* cut short"):
        next(loader)  # no SIGBUS, no IndexError


def test_an_index_that_is_not_a_database_is_rebuilt_with_a_line_naming_it(built, tmp_path):
    manifest, fresh = built
    first = data_module(manifest, "disk", tmp_path / "cache")
    first.check("fit")
    index = grid_folder(first) / "index.sqlite"
    index.write_bytes(b"these are not the bytes of an SQLite database" * 100)
    later = data_module(manifest, "disk", tmp_path / "cache")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = val_batch(later)
    assert f"{index} is not a readable SQLite index (file is not a database)" in warning_lines(caught)
    assert later.slice_cache.written == 11
    assert_same_batch(batch, fresh["disk"])


def test_a_check_record_that_is_not_a_database_is_rebuilt_with_a_line_naming_it(built, tmp_path):
    """Today: "cannot keep the check record ...; choose a writable folder": the wrong advice."""
    manifest, fresh = built
    first = data_module(manifest, "disk", tmp_path / "cache")
    first.check("fit")
    first.check_record.path.write_bytes(b"\x00garbage" * 1000)
    later = data_module(manifest, "disk", tmp_path / "cache")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = val_batch(later)
    assert f"{first.check_record.path} is not a readable SQLite file" in warning_lines(caught)
    assert "writable" not in warning_lines(caught)
    assert later.check_record.added == 11 + 11 and later.slice_cache.written == 0  # verdicts again; slots held
    assert_same_batch(batch, fresh["disk"])


# ---------------------------------------------------------------------------------------------------- full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (a real file system that fills up), mounted for the test; needs root and mount rights."""
    folder = tmp_path / "small_disk"
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(folder: Path, *, leave: int) -> Path:
    """Fill the disk of ``folder`` up to ``leave`` bytes free."""
    filler = folder / "filler"
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    with open(filler, "ab") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


def test_a_cache_that_cannot_fit_is_refused_before_any_file_is_read(tmp_path, small_disk):
    manifest = write_npy_manifest(tmp_path / "data", train=30, val=10, test=0, size=40)
    fill(small_disk, leave=300_000)  # the record fits; 40 slots of 64 x 64 float16 and their masks (0.5 MB) do not
    data = CTSliceDataModule(str(manifest), cache="disk", cache_dir=str(small_disk), img_size=64, num_workers=0)
    with pytest.raises(ValueError, match=r"the cache folder .*grid64-\w+ is out of space \(the slices to cache need "
                       r"0.5 MB, 0.[23] MB free\)") as refused:  # fmt: skip
        data.check("fit")
    assert "--data.init_args.cache_dir" in str(refused.value) and "free space" in str(refused.value)
    assert data.check_record.added == 0


def test_a_disk_that_fills_during_the_check_is_named_and_what_was_written_is_kept(tmp_path, small_disk, monkeypatch):
    """Another writer fills the disk after the third slice: the check stops with a named error (not `OperationalError:
    database or disk is full`, not a SIGBUS in a worker); freeing space, the next check resumes and the cache equals a
    fresh one."""
    manifest = write_npy_manifest(tmp_path / "data", train=10, val=6, test=0)
    table = read_manifest(manifest)
    real, writes, filler = SliceCache.write, [], []

    def write(self, slot, mask_slot, hu, mask):
        writes.append(slot)
        if len(writes) == 4:
            filler.append(fill(small_disk, leave=0))
        return real(self, slot, mask_slot, hu, mask)

    monkeypatch.setattr(SliceCache, "write", write)
    monkeypatch.setattr(manifest_files, "_COMMIT_SECONDS", 0)  # commit after every slice
    cache = SliceCache(small_disk / "grid", img_size=32)
    record = CheckRecord(small_disk / "checked.sqlite")
    with pytest.raises(ValueError, match=f"the cache folder {small_disk / 'grid'} is out of space") as refused:
        validate_manifest_files(table, progress=False, record=record, cache=cache, workers=1)
    assert "No space left on device" in str(refused.value) or "disk is full" in str(refused.value)
    assert "--data.init_args.cache_dir" in str(refused.value)
    kept = cache.done.sum()
    assert 1 <= kept <= 3  # the slices written before the disk filled, committed
    cache.close(), record.close()

    filler[0].unlink()
    monkeypatch.setattr(SliceCache, "write", real)
    for path in (small_disk / "checked.sqlite", small_disk / "grid" / "index.sqlite"):
        assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchone() == ("ok",)
    again = SliceCache(small_disk / "grid", img_size=32)
    good, _ = validate_manifest_files(table, progress=False, record=CheckRecord(small_disk / "checked.sqlite"),
                                      cache=again, workers=1)  # fmt: skip
    assert again.written == 16 - kept
    fresh = SliceCache(tmp_path / "fresh", img_size=32)
    reference, _ = validate_manifest_files(table, progress=False, cache=fresh, workers=1)
    resumed = again.batch(good["cache_slot"].to_numpy())
    for key, value in fresh.batch(reference["cache_slot"].to_numpy()).items():
        assert torch.equal(resumed[key], value) or torch.allclose(resumed[key], value, equal_nan=True), key
