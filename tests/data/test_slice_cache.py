"""Preprocess once: the disk cache (`cache: disk`) gives the batches the uncached path gives, within float16's step;
it is rebuilt only where a file or the grid changes (a window change reuses it), its workers and DDP ranks read one
copy, and a preprocessing run killed mid-write resumes without a corrupt slot."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from npy_manifest import manifest_args, write_npy_manifest
from pydicom.data import get_testdata_file

from vit_ct.data.cache.check_record import CheckRecord
from vit_ct.data.cache.slice_cache import SliceCache
from vit_ct.data.io.reader import load_ct_slice
from vit_ct.data.loading import slice_dataset
from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.data.manifests.manifest import manifest_frame, read_manifest, validate_manifest_files
from vit_ct.data.transforms.model_input import HEAD_HU, apply_windows, grid_hu
from vit_ct.data.transforms.windows import parse_windows, stack_windows

TESTS = Path(__file__).resolve().parents[1]
WINDOWS = ["brain", "subdural", "bone"]


def mixed_manifest(folder: Path) -> Path:
    """npy slices with masks (40 x 40), a non-square slice with its mask (30 x 40: padded to square) and a DICOM
    with pixel spacing (CT_small, 128 x 128)."""
    manifest = write_npy_manifest(folder, train=6, val=3, test=1)
    rng = np.random.default_rng(5)
    hu = np.where(rng.random((30, 40)) < 0.7, 40.0, -1000.0) + rng.normal(0, 8, (30, 40))
    np.save(folder / "wide.npy", hu.astype(np.float32))
    np.save(folder / "wide_mask.npy", (rng.random((30, 40)) < 0.3).astype(np.uint8))
    shutil.copy(get_testdata_file("CT_small.dcm"), folder / "ct_small")
    with manifest.open("a") as f:
        f.write("wide.npy,1,p90,val,wide_mask.npy\nct_small,0,p91,val,\n")
    return manifest


def data_module(manifest: Path, cache, cache_dir: Path, **kwargs) -> CTSliceDataModule:
    kwargs = {"img_size": 32, "windows": WINDOWS, "batch_size": 64, "num_workers": 0, "augment": False, **kwargs}
    return CTSliceDataModule(str(manifest), cache=cache, cache_dir=str(cache_dir), **kwargs)


def val_batch(data: CTSliceDataModule) -> dict:
    data.setup("validate")
    batch = next(iter(data.val_dataloader()))
    return data.on_after_batch_transfer(batch, 0)


def assert_equal_within_float16(cached: dict, reference: dict, hu: torch.Tensor, windows) -> None:
    """``hu``: (B, 1, S, S) float32 HU on the model grid (the uncached path's). Windowed values differ by at most
    half a float16 step of the HU over the window's width; the head mask only within that step of its threshold."""
    half_step = torch.from_numpy(np.spacing(np.abs(hu.numpy()).astype(np.float16)).astype(np.float32)) / 2
    widths = torch.tensor([width for _, width in parse_windows(windows)])[None, :, None, None]
    assert cached["image"].shape == reference["image"].shape
    assert ((cached["image"] - reference["image"]).abs() <= half_step / widths + 1e-6).all()
    assert (half_step > 0).all()
    near = (hu - HEAD_HU).abs() <= half_step
    assert torch.equal(cached["head"][~near], reference["head"][~near])
    for key in ("mask", "has_mask", "label", "index", "valid", "source_shape"):
        assert torch.equal(cached[key], reference[key]), key
    torch.testing.assert_close(cached["pixel_spacing_mm"], reference["pixel_spacing_mm"], equal_nan=True)


def grid_reference(data: CTSliceDataModule, split: str) -> torch.Tensor:
    table = data.split_table(split)
    return torch.stack([grid_hu(load_ct_slice(row["image"], manifest_frame(row)), 32) for _, row in table.iterrows()])


def test_cached_batches_equal_the_uncached_ones_within_float16s_step(tmp_path):
    manifest = mixed_manifest(tmp_path / "data")
    cached = data_module(manifest, "disk", tmp_path / "cache")
    cached.setup("validate")
    loaded = next(iter(cached.val_dataloader()))
    assert loaded["hu"].dtype == torch.float16 and loaded["mask"].dtype == torch.uint8 and "image" not in loaded
    batch = cached.on_after_batch_transfer(loaded, 0)
    reference = val_batch(data_module(manifest, False, tmp_path / "cache"))
    hu = grid_reference(cached, "val")
    assert torch.equal(loaded["hu"], hu.half())  # the cache holds the model-grid HU, rounded once
    assert_equal_within_float16(batch, reference, hu, WINDOWS)
    assert reference["source_shape"].tolist()[-2:] == [[30, 40], [128, 128]]  # padded, and a DICOM's spacing:
    assert not torch.isnan(reference["pixel_spacing_mm"][-1]) and reference["has_mask"][-2]
    dataset = cached.datasets["val"]
    item = dataset.load(4)  # what callbacks read: windowed, like the uncached dataset's
    assert torch.equal(item["image"], batch["image"][4]) and torch.equal(item["head"], batch["head"][4])


def test_a_cache_without_masks_leaves_them_out_of_its_batches(tmp_path):
    """RSNA has no masks: the loaders' batches carry none (a third fewer bytes), and the model still gets zeros."""
    folder = tmp_path / "data"
    folder.mkdir()
    rng = np.random.default_rng(3)
    lines = ["image,label,split"]
    for i in range(6):
        np.save(folder / f"s{i}.npy", (rng.normal(30, 400, (24, 20))).astype(np.float32))
        lines.append(f"s{i}.npy,{i % 2},{'train' if i < 3 else 'val'}")
    manifest = folder / "manifest.csv"
    manifest.write_text("\n".join(lines) + "\n")
    cached = data_module(manifest, "disk", tmp_path / "cache")
    cached.setup("validate")
    loaded = next(iter(cached.val_dataloader()))
    assert "mask" not in loaded and not loaded["has_mask"].any()
    batch = cached.on_after_batch_transfer(loaded, 0)
    reference = val_batch(data_module(manifest, False, tmp_path / "cache"))
    assert_equal_within_float16(batch, reference, grid_reference(cached, "val"), WINDOWS)


def test_workers_share_the_cache_and_a_later_run_reads_nothing(tmp_path):
    manifest = mixed_manifest(tmp_path / "data")
    first = data_module(manifest, "disk", tmp_path / "cache")
    single = val_batch(first)
    assert first.slice_cache.written == 12 and first.check_record.added == 12 + 11  # slices, then masks
    later = data_module(manifest, "disk", tmp_path / "cache", num_workers=2)
    workers = val_batch(later)
    assert later.slice_cache.written == 0 and later.check_record.added == 0
    assert later.slice_cache.folder == first.slice_cache.folder
    for key in single:
        assert torch.equal(single[key], workers[key]) or torch.allclose(single[key], workers[key], equal_nan=True)


def test_the_in_memory_cache_is_filled_from_the_checks_reading_and_equals_the_files_exactly(tmp_path, monkeypatch):
    """`cache: true`: the check reads each file once and stores its float32 grid HU; the in-memory cache is filled
    from there (a later run reads no file), and its batches are the uncached path's to the bit."""
    manifest = mixed_manifest(tmp_path / "data")
    reads = []
    real = slice_dataset.load_ct_slice
    monkeypatch.setattr(slice_dataset, "load_ct_slice", lambda path, *a, **k: reads.append(path) or real(path, *a, **k))
    first = data_module(manifest, True, tmp_path / "cache")
    batch = val_batch(first)
    assert reads == [] and first.check_record.added == 12 + 11 and first.slice_cache.written == 12
    assert first.slice_cache.hu_file.name == "hu.f32" and first.datasets["val"]._held["hu"].dtype == torch.float32
    uncached = data_module(manifest, False, tmp_path / "cache")
    reference = val_batch(uncached)
    assert len(reads) == 5  # the uncached loader reads its files
    for key in reference:
        assert torch.allclose(batch[key], reference[key], rtol=0, atol=0, equal_nan=True), key
    later = data_module(manifest, True, tmp_path / "cache")
    later.setup("fit")
    assert len(reads) == 5 and later.check_record.added == 0 and later.slice_cache.written == 0
    uncached.setup("fit")
    for index in range(len(later.datasets["train"])):  # what callbacks read
        item, expected = later.datasets["train"].load(index), uncached.datasets["train"].load(index)
        assert all(torch.allclose(item[key], expected[key], rtol=0, atol=0, equal_nan=True) for key in expected), index


def test_a_window_change_reuses_the_cache(tmp_path):
    manifest = mixed_manifest(tmp_path / "data")
    val_batch(data_module(manifest, "disk", tmp_path / "cache"))
    windows = ["stroke", [100, 300]]
    other = data_module(manifest, "disk", tmp_path / "cache", windows=windows)
    batch = val_batch(other)
    assert other.slice_cache.written == 0 and batch["image"].shape[1] == 2
    reference = val_batch(data_module(manifest, False, tmp_path / "cache", windows=windows))
    assert_equal_within_float16(batch, reference, grid_reference(other, "val"), windows)


def test_a_changed_file_rebuilds_its_slot_only_and_a_new_grid_a_cache_of_its_own(tmp_path):
    manifest = mixed_manifest(tmp_path / "data")
    first = data_module(manifest, "disk", tmp_path / "cache")
    first.check("fit")
    changed = tmp_path / "data" / "s007.npy"  # a validation slice
    mtime = changed.stat().st_mtime_ns
    np.save(changed, np.load(changed) + 25)
    os.utime(changed, ns=(mtime + 10**9, mtime + 10**9))
    later = data_module(manifest, "disk", tmp_path / "cache")
    batch = val_batch(later)
    assert later.slice_cache.written == 1 and later.check_record.added == 2  # the slice and the mask its slot holds
    assert later.table["cache_slot"].tolist() == first.table["cache_slot"].tolist()  # in its own slot
    hu = grid_reference(later, "val")
    assert torch.equal(later.datasets["val"][1]["hu"], hu[1].half())  # s007 is the second val row
    assert_equal_within_float16(batch, val_batch(data_module(manifest, False, tmp_path / "cache")), hu, WINDOWS)

    larger = data_module(manifest, "disk", tmp_path / "cache", img_size=48)
    larger.check("fit")
    assert larger.slice_cache.written == 12 and larger.check_record.added == 23  # a new grid: every file once more
    assert larger.slice_cache.folder.parent == later.slice_cache.folder.parent != larger.slice_cache.folder


_KILLED_WRITER = """
import os, signal, sys
import numpy as np
from vit_ct.data.manifests import manifest_files
from vit_ct.data.loading import slice_dataset
from vit_ct.data.cache.check_record import CheckRecord
from vit_ct.data.manifests.manifest import read_manifest, validate_manifest_files
from vit_ct.data.cache.slice_cache import SliceCache

manifest_files._COMMIT_SECONDS = 0  # commit after every slice, so that the kill finds some slots done
real, writes = SliceCache.write, []

def write(self, slot, mask_slot, hu, mask):
    writes.append(slot)
    if len(writes) == 5:
        garbage = np.full((self.img_size // 2, self.img_size), 12345.0, self.hu_dtype)
        self._pwrite(self.hu_file, 2 * slot, garbage)  # half a slice of garbage, then the process dies
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, slot, mask_slot, hu, mask)

SliceCache.write = write
folder = sys.argv[2]
validate_manifest_files(read_manifest(sys.argv[1]), progress=False, record=CheckRecord(folder + "/checked.sqlite"),
                        cache=SliceCache(folder + "/grid", img_size=32), workers=1)
"""


@pytest.mark.medium
def test_a_preprocessing_run_killed_mid_write_resumes_without_corrupt_slots(tmp_path):
    manifest = mixed_manifest(tmp_path / "data")
    folder = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    killed = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(manifest), str(folder)], env=env, timeout=300)
    assert killed.returncode == -9
    cache = SliceCache(folder / "grid", img_size=32)
    assert cache.done.sum() == 4 and len(cache.done) == 12  # four committed, the fifth killed mid-write

    table = read_manifest(manifest)
    good, _ = validate_manifest_files(  # in worker processes this time
        table, progress=False, record=CheckRecord(folder / "checked.sqlite"), cache=cache, workers=2
    )
    assert cache.written == 8 and cache.done.all()
    stored = SliceCache(folder / "grid", img_size=32).batch(good["cache_slot"].to_numpy())["hu"]
    for (_, row), hu in zip(good.iterrows(), stored, strict=True):
        expected = grid_hu(load_ct_slice(row["image"], manifest_frame(row)), 32).half()
        assert torch.equal(hu, expected), row["image_ref"]


def test_batch_windows_equal_stack_windows():
    """Both paths window through `apply_windows`, in place; its values are `stack_windows`' own."""
    hu = torch.randn(5, 1, 24, 24) * 800
    windows = parse_windows(["brain", "subdural", "bone", "stroke", [0, 1]])
    batch = apply_windows({"hu": hu.half(), "mask": torch.zeros(5, 1, 24, 24, dtype=torch.uint8)}, windows)
    expected = torch.stack([stack_windows(h[0].half().float(), windows) for h in hu])
    assert torch.equal(batch["image"], expected) and batch["image"].dtype == torch.float32
    assert torch.equal(batch["head"], (hu.half().float() > HEAD_HU).float()) and batch["mask"].dtype == torch.float32
    assert torch.equal(apply_windows({"hu": hu[0], "mask": torch.zeros(1, 24, 24)}, windows)["image"],
                       stack_windows(hu[0, 0], windows))  # one item: (C, S, S)  # fmt: skip


def test_cache_option_keeps_the_meaning_of_saved_configs(tmp_path):
    manifest = write_npy_manifest(tmp_path, train=2, val=1)
    assert CTSliceDataModule(str(manifest), cache=True).cache == "memory"  # `cache: true` of saved configs
    assert CTSliceDataModule(str(manifest), cache="memory").cache == "memory"
    assert CTSliceDataModule(str(manifest), cache=False).cache is False
    with pytest.raises(ValueError, match="data.cache must be true, false, 'memory' or 'disk', got 'ssd'"):
        CTSliceDataModule(str(manifest), cache="ssd")


@pytest.mark.slow
@pytest.mark.ddp
def test_two_ddp_ranks_read_one_cache_and_no_file_twice(tmp_path):
    manifest = write_npy_manifest(tmp_path / "data", train=8, val=3)
    cache_dir = tmp_path / "cache"
    command = [
        str(Path(sys.executable).with_name("vit-ct")), "fit", *manifest_args(manifest, batch_size=2),
        "--data.init_args.cache", "disk", "--data.init_args.cache_dir", str(cache_dir),
        "--data.init_args.augment", "false", "--trainer.max_epochs", "1", "--trainer.logger", "false",
        "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp",
        "--trainer.callbacks+=probes.CacheProbe", "--trainer.callbacks.folder", str(tmp_path / "rec"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get(
        "PYTHONPATH", "")])}  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    ranks = [json.loads((tmp_path / "rec" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["read"] for r in ranks] == [13 + 13, 0]  # rank 0 read every slice and mask; rank 1 none
    assert [r["cached"] for r in ranks] == [13, 0] and ranks[0]["cache"] == ranks[1]["cache"]
    seen = {int(i): s for r in ranks for i, s in r["sums"].items()}
    assert sorted(seen) == list(range(8)) and not set(ranks[0]["sums"]) & set(ranks[1]["sums"])

    reference = data_module(manifest, False, cache_dir, windows=["brain"])  # read from the files
    reference.setup("fit")
    for index, total in seen.items():
        expected = float(reference.datasets["train"].load(index)["image"].double().sum())
        assert total == pytest.approx(expected, abs=32 * 32 * 2e-4)  # float16 HU: < 2e-4 a pixel at the brain window
