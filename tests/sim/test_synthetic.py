"""The on-disk synthetic set: DICOM round trip through pydicom, masks, manifest, splits, reproducibility."""

import csv
import hashlib
import json

import numpy as np
import pydicom
import pytest
from PIL import Image

from vit_ct.sim.phantom import PhantomConfig
from vit_ct.sim.synthetic import MANIFEST_COLUMNS, PIXEL_PADDING_VALUE, build_synthetic_dataset, simulate_patient

CONFIG = PhantomConfig(size=64, pixel_spacing_mm=3.6)
ARGS = {"n_patients": 4, "slices_per_patient": 3, "seed": 5, "config": CONFIG, "split_fractions": (0.5, 0.25, 0.25)}


def _rows(manifest):
    with manifest.open(newline="") as f:
        return list(csv.DictReader(f))


def _hashes(root):
    return {p.relative_to(root): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic") / "set"
    return root, build_synthetic_dataset(root, progress=False, **ARGS)


def test_manifest(dataset):
    root, manifest = dataset
    assert manifest == root / "manifest.csv"
    rows = _rows(manifest)
    assert tuple(rows[0]) == MANIFEST_COLUMNS and len(rows) == 12
    for row in rows:
        assert (root / row["image"]).is_file() and (root / row["mask"]).is_file()
        assert row["label"] == str(int(row["bleed_type"] != "none"))
    splits = {}
    for row in rows:
        splits.setdefault(row["patient_id"], set()).add(row["split"])
    assert all(len(s) == 1 for s in splits.values())  # no patient in two splits
    for split in ("train", "val", "test"):
        assert {row["label"] for row in rows if row["split"] == split} == {"0", "1"}


def test_dicom_round_trip_gives_the_generated_hu_and_mask(dataset):
    root, manifest = dataset
    # Regenerate patient 0 in memory and compare with what pydicom reads back.
    expected = simulate_patient(ARGS["seed"], 0, 3, CONFIG)
    rows = [row for row in _rows(manifest) if row["patient_id"] == "synth-0000"]
    uids = set()
    for k, (row, simulated) in enumerate(zip(rows, expected, strict=True)):
        ds = pydicom.dcmread(root / row["image"])
        assert ds.SOPClassUID == pydicom.uid.CTImageStorage
        assert ds.file_meta.TransferSyntaxUID == pydicom.uid.ExplicitVRLittleEndian
        assert (ds.Rows, ds.Columns) == (64, 64) and [float(v) for v in ds.PixelSpacing] == [3.6, 3.6]
        assert ds.PatientID == "synth-0000" and ds.InstanceNumber == k + 1
        stored = ds.pixel_array
        assert stored.dtype == np.int16
        hu = stored * float(ds.RescaleSlope) + float(ds.RescaleIntercept)
        inside = stored != ds.PixelPaddingValue
        np.testing.assert_array_equal(inside, simulated.field_of_view)
        assert ds.PixelPaddingValue == PIXEL_PADDING_VALUE
        assert np.abs(hu[inside] - np.clip(simulated.hu[inside], -1024, 3071)).max() <= 0.5
        mask = np.asarray(Image.open(root / row["mask"]))
        assert mask.dtype == np.uint8 and mask.shape == (64, 64) and set(np.unique(mask)) <= {0, 255}
        np.testing.assert_array_equal(mask == 255, simulated.mask)
        assert int(row["label"]) == simulated.label and row["bleed_type"] == simulated.bleed_type
        uids.add(ds.SOPInstanceUID)
        assert ds.StudyInstanceUID == pydicom.dcmread(root / rows[0]["image"]).StudyInstanceUID
    assert len(uids) == 3


def test_same_seed_same_bytes_and_no_regeneration(dataset, tmp_path):
    root, manifest = dataset
    other = build_synthetic_dataset(tmp_path / "again", progress=False, **ARGS)
    assert _hashes(root) == _hashes(other.parent)
    before = manifest.stat().st_mtime_ns
    assert build_synthetic_dataset(root, progress=False, **ARGS) == manifest
    assert manifest.stat().st_mtime_ns == before
    assert json.loads((root / "generator.json").read_text())["seed"] == ARGS["seed"]
    assert not list(root.parent.glob(".*partial*"))  # the temporary folder is gone


@pytest.mark.slow
def test_worker_processes_write_the_same_bytes(dataset, tmp_path):
    root, _ = dataset
    parallel = build_synthetic_dataset(tmp_path / "parallel", progress=False, num_workers=2, **ARGS)
    assert _hashes(root) == _hashes(parallel.parent)


def test_other_arguments_raise_unless_overwrite(tmp_path):
    root = tmp_path / "set"
    build_synthetic_dataset(root, progress=False, **ARGS)
    with pytest.raises(ValueError, match="overwrite"):
        build_synthetic_dataset(root, progress=False, **{**ARGS, "seed": 6})
    build_synthetic_dataset(root, progress=False, overwrite=True, **{**ARGS, "seed": 6})
    assert json.loads((root / "generator.json").read_text())["seed"] == 6


def test_unrelated_folder_is_not_touched(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="another root"):
        build_synthetic_dataset(tmp_path, progress=False, **ARGS)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_building_in_process_leaves_the_callers_threads(tmp_path):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:  # the demo builds its set in the CLI's process, then trains there: it must keep every thread
        build_synthetic_dataset(tmp_path / "set", progress=False, num_workers=1, **ARGS)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
