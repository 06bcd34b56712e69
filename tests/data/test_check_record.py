"""Check once: the manifest check's verdicts kept per file (path, size, modification time, read options), so that a
later check reads only what changed, gives the same verdicts and digests, and a record made elsewhere is refused."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pandas as pd
import pytest
from npy_manifest import write_npy_manifest
from pydicom.data import get_testdata_file

from vit_ct.data.cache.check_record import CheckRecord, FileStat, stat_file
from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.data.manifests import manifest_files
from vit_ct.data.manifests.manifest import read_manifest, validate_manifest_files


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The paths the check's loaders open (in this process: the tests pass workers=1)."""
    opened: list[str] = []
    for name in ("read_ct_slice", "load_mask"):
        real = getattr(manifest_files, name)

        def spy(path, *args, _real=real, **kwargs):
            opened.append(os.path.basename(path))
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(manifest_files, name, spy)
    return opened


def manifest_with_bad_rows(folder):
    """6 good rows (3 with masks), a NaN slice, a missing file and a lesion row whose mask is empty."""
    manifest = write_npy_manifest(folder, train=4, val=2, test=0)
    nan = np.full((40, 40), np.nan, np.float32)
    np.save(folder / "nan.npy", nan)
    np.save(folder / "empty_mask.npy", np.zeros((40, 40), np.uint8))
    shutil.copy(get_testdata_file("CT_small.dcm"), folder / "ct_small")
    with manifest.open("a") as f:
        f.write(
            "nan.npy,0,p90,train,\nmissing.npy,0,p91,train,\ns000.npy,1,p92,val,empty_mask.npy\nct_small,0,p93,val,\n"
        )
    return read_manifest(manifest)


def test_a_later_check_reads_no_file_and_gives_the_same_verdicts(tmp_path, reads):
    table = manifest_with_bad_rows(tmp_path)
    record = CheckRecord(tmp_path / "record.sqlite")
    first = validate_manifest_files(table, on_bad_file="skip", progress=False, record=record, workers=1)
    slices = {f"s{i:03d}.npy" for i in range(6)} | {"nan.npy", "missing.npy", "ct_small"}
    assert set(reads) == slices | {f"m{i:03d}.npy" for i in range(6)} | {"empty_mask.npy"}
    assert record.added == len(reads) - 1  # a verdict per file read, but none for a file that is not there
    reads.clear()

    again = CheckRecord(tmp_path / "record.sqlite")
    second = validate_manifest_files(table, on_bad_file="skip", progress=False, record=again, workers=1)
    assert reads == ["missing.npy"] and again.added == 0  # tried again: it may have come since
    pd.testing.assert_frame_equal(first[0], second[0])  # same rows, same digests
    assert first[1] == second[1] and [b.line for b in second[1]] == [8, 9, 10]
    assert "NaN" in second[1][0].reason and "file not found" in second[1][1].reason
    assert "no lesion pixel" in second[1][2].reason  # a row's rule, from the verdicts on its two files
    assert second[0].set_index("image_ref").loc["ct_small", "image_digest"] == manifest_files.file_digest(
        tmp_path / "ct_small"
    )


def test_a_changed_file_or_read_option_is_read_again(tmp_path, reads):
    table = manifest_with_bad_rows(tmp_path)
    record = CheckRecord(tmp_path / "record.sqlite")
    before, _ = validate_manifest_files(table, on_bad_file="skip", progress=False, record=record, workers=1)
    reads.clear()

    changed = tmp_path / "s001.npy"
    mtime = changed.stat().st_mtime_ns
    np.save(changed, np.load(changed) + 1)  # same size, new content
    os.utime(changed, ns=(mtime + 10**9, mtime + 10**9))  # a second later, whatever the clock's resolution
    after, _ = validate_manifest_files(table, on_bad_file="skip", progress=False, record=record, workers=1)
    assert reads == ["s001.npy", "missing.npy"]  # not its mask, which did not change
    digests = pd.concat([before["image_digest"], after["image_digest"]], axis=1, keys=["before", "after"])
    differs = digests[digests["before"] != digests["after"]]
    assert list(table.loc[differs.index, "image_ref"]) == ["s001.npy"]
    reads.clear()

    validate_manifest_files(table, on_bad_file="skip", progress=False, record=record, workers=1, modalities=None)
    slices = {f"s{i:03d}.npy" for i in range(6)} | {"nan.npy", "missing.npy", "ct_small"}
    assert set(reads) == slices  # slices only: masks do not depend on the read options


def test_an_unreadable_file_is_never_trusted_to_the_record(tmp_path):
    path = tmp_path / "s.npy"
    np.save(path, np.zeros((4, 5), np.float32))
    assert stat_file(str(path)) == FileStat(path.stat().st_size, path.stat().st_mtime_ns)
    assert stat_file(str(tmp_path / "missing.npy")) is None and stat_file(str(tmp_path)) is None
    (tmp_path / "empty.npy").write_bytes(b"")
    assert stat_file(str(tmp_path / "empty.npy")) is None
    if os.geteuid() != 0:  # root reads any file
        path.chmod(0)
        assert stat_file(str(path)) is None


def test_the_data_module_reuses_the_record_on_a_later_run(tmp_path):
    manifest = write_npy_manifest(tmp_path / "data", train=6, val=3)
    data = CTSliceDataModule(str(manifest), img_size=16, num_workers=0, cache=False, cache_dir=str(tmp_path / "c"))
    data.check("fit")
    assert data.check_record.added == 11 + 11  # every slice and mask (test split included)
    assert data.check_record.path.parent.parent == tmp_path / "c"
    later = CTSliceDataModule(str(manifest), img_size=32, num_workers=0, cache=False, cache_dir=str(tmp_path / "c"))
    later.check("fit")
    assert later.check_record.added == 0
    pd.testing.assert_frame_equal(data.table, later.table)
    other = CTSliceDataModule(str(manifest), img_size=16, num_workers=0, cache=False, cache_dir=str(tmp_path / "d"))
    other.check("fit")
    assert other.check_record.added == 22  # another cache folder: a record of its own


def test_an_unwritable_cache_folder_is_named(tmp_path):
    manifest = write_npy_manifest(tmp_path / "data", train=2, val=1)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    data = CTSliceDataModule(str(manifest), num_workers=0, cache_dir=str(blocker))
    with pytest.raises(ValueError, match=f"cannot use the cache folder {blocker}.*--data.init_args.cache_dir"):
        data.check("fit")


_CHECK = """
import sys
from vit_ct.data.loading.datamodule import CTSliceDataModule
data = CTSliceDataModule(sys.argv[1], img_size=16, num_workers=0, cache="disk", cache_dir=sys.argv[2])
data.check("fit")
print("read, cached:", data.check_record.added, data.slice_cache.written)
"""


@pytest.mark.slow
def test_processes_checking_one_manifest_at_once_read_its_files_once(tmp_path):
    """As torchrun or SLURM start DDP ranks: together. One checks and caches; the other waits, then reads nothing."""
    import subprocess
    import sys

    manifest = write_npy_manifest(tmp_path / "data", train=30, val=5)
    command = [sys.executable, "-c", _CHECK, str(manifest), str(tmp_path / "cache")]
    ranks = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [rank.communicate(timeout=600) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    lines = [next(line for line in out.splitlines() if line.startswith("read, cached:")) for out, _ in outputs]
    counts = sorted(tuple(int(v) for v in line.split()[2:]) for line in lines)
    assert counts == [(0, 0), (37 + 37, 37)]  # every slice and mask read once, by one of them
