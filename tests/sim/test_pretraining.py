"""The pretraining set on disk: DICOM and masks against the simulation and pydicom, the manifest and its scanner
columns, the same bytes with any number of workers, resuming after a SIGKILL, refusing what it must not touch."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pydicom
import pytest
from PIL import Image

from vit_ct.data.io.reader import load_ct_slice
from vit_ct.sim.cohort import CohortConfig, simulate_cohort_patient
from vit_ct.sim.contact_sheet import choose_slices, contact_sheet
from vit_ct.sim.pretraining import PROGRESS, SCANNER_COLUMNS, main, patient_id, write_pretraining_set
from vit_ct.sim.synthetic import MANIFEST_COLUMNS

CONFIG = CohortConfig(size=64)  # coarse (~3.4 mm pixels: the head sets the field of view), but fast
ARGS = {"n_patients": 6, "slices_per_patient": 3, "seed": 2, "config": CONFIG, "split_fractions": (0.5, 0.25, 0.25)}


def _hashes(root: Path) -> dict:
    files = [p for p in root.rglob("*") if p.is_file()]
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretraining") / "set"
    return root, write_pretraining_set(root, progress=False, **ARGS)


def test_manifest_lists_every_slice_with_its_scanner_split_by_patient(written):
    root, manifest = written
    table = pd.read_csv(manifest)
    assert tuple(table.columns) == (*MANIFEST_COLUMNS, *SCANNER_COLUMNS) and len(table) == 18
    assert table.groupby("patient_id")["split"].nunique().eq(1).all()
    assert set(table["split"]) == {"train", "val", "test"}
    assert table.groupby("patient_id")["kernel"].nunique().eq(1).all()  # one scanner per patient
    assert table["patient_id"].iloc[0] == patient_id(0) == "cohort-00000"
    assert not list(root.rglob("*.tmp*"))


def test_dicom_and_masks_are_the_simulated_slices(written):
    root, manifest = written
    table = pd.read_csv(manifest)
    expected = simulate_cohort_patient(ARGS["seed"], 1, 3, CONFIG)
    rows = table[table["patient_id"] == patient_id(1)]
    uids = set()
    for (_, row), simulated in zip(rows.iterrows(), expected, strict=True):
        ds = pydicom.dcmread(root / row["image"])
        assert ds.pixel_array.dtype == np.int16 and ds.RescaleIntercept == -1024 and ds.RescaleSlope == 1
        assert [float(v) for v in ds.PixelSpacing] == [simulated.pixel_spacing_mm] * 2
        assert float(ds.PixelSpacing[0]) == pytest.approx(row["pixel_spacing_mm"], abs=1e-4)
        assert float(ds.SliceThickness) == simulated.slice_thickness_mm == row["slice_thickness_mm"]
        assert ds.ConvolutionKernel == simulated.kernel == row["kernel"]
        hu = load_ct_slice(root / row["image"])  # vit-ct's reader: rescale and padding applied
        inside = simulated.field_of_view
        assert np.abs(hu[inside] - np.clip(simulated.hu[inside], -1024, 3071)).max() <= 0.5
        mask = np.asarray(Image.open(root / row["mask"])) == 255
        np.testing.assert_array_equal(mask, simulated.mask)
        assert row["label"] == int(mask.any()) and row["bleed_type"] == simulated.bleed_type
        uids.add(ds.SOPInstanceUID)
    assert len(uids) == 3


def test_an_interrupted_patient_is_removed_and_written_again(written, tmp_path):
    root, _ = written
    copy = tmp_path / "set"
    write_pretraining_set(copy, progress=False, **ARGS)
    assert _hashes(copy) == _hashes(root)  # the same arguments: the same bytes
    pid = patient_id(2)
    (copy / PROGRESS / f"{pid}.json").unlink()  # killed after renaming its folders, before marking it done ...
    (copy / "images" / pid / "001.dcm").write_bytes(b"half")  # ... or while they were still being written
    (copy / "masks" / f".{patient_id(3)}.tmp-12345678").mkdir()
    (copy / "manifest.csv").unlink()
    write_pretraining_set(copy, progress=False, **ARGS)
    assert _hashes(copy) == _hashes(root)


def test_refuses_other_arguments_and_foreign_folders(written, tmp_path):
    root, manifest = written
    before = manifest.read_bytes()
    with pytest.raises(ValueError, match="seed differ"):
        write_pretraining_set(root, progress=False, **{**ARGS, "seed": 3})
    assert manifest.read_bytes() == before
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="other files"):
        write_pretraining_set(tmp_path, progress=False, **ARGS)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="n_patients"):
        write_pretraining_set(tmp_path / "new", progress=False, **{**ARGS, "n_patients": 0})


def test_command_line_help_and_errors(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    usage = capsys.readouterr().out
    assert all(option in usage for option in ("--patients", "--slices_per_patient", "--seed", "--num_workers"))
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "set"), "--patients", "0", "--quiet"])
    assert exit_.value.code == 2 and "n_patients" in capsys.readouterr().err


def test_contact_sheet_spreads_over_bleed_types_and_reads_the_written_files(written, tmp_path):
    table = pd.DataFrame(
        {"image": [f"{i:02d}" for i in range(30)], "bleed_type": ["none"] * 20 + ["subdural"] * 8 + ["epidural"] * 2,
         "photons_per_ray": np.arange(30.0)}
    )  # fmt: skip
    counts = choose_slices(table, 9)["bleed_type"].value_counts().to_dict()
    assert counts == {"none": 4, "subdural": 3, "epidural": 2}  # round robin, as far as each type goes
    _, manifest = written
    out = contact_sheet(manifest, tmp_path / "sheet.png", n=6, columns=3, dpi=40)
    image = Image.open(out)
    assert image.mode == "P" and image.size == (round(3 * 1.6 * 40), round(2 * (1.6 + 0.45) * 40))


@pytest.mark.slow
def test_a_run_killed_with_sigkill_resumes_to_the_files_of_an_uninterrupted_run(tmp_path):
    """Killed (command and workers) while 2 workers write, resumed in 1 process: the bytes of one uninterrupted run,
    whatever the number of workers."""
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    command = [sys.executable, "-m", "vit_ct.sim.pretraining", str(killed), "--patients", "16",
               "--slices_per_patient", "2", "--seed", "4", "--size", "64", "--quiet"]  # fmt: skip
    run = subprocess.Popen([*command, "--num_workers", "2"], start_new_session=True)
    markers = killed / PROGRESS
    deadline = time.monotonic() + 300
    while not (markers.is_dir() and len(list(markers.glob("*.json"))) >= 3) and time.monotonic() < deadline:
        assert run.poll() is None, "the run ended before it could be killed"
        time.sleep(0.02)
    os.killpg(run.pid, signal.SIGKILL)  # the command and its workers, mid-run
    run.wait()
    done = len(list(markers.glob("*.json")))
    assert 3 <= done < 16 and not (killed / "manifest.csv").exists()
    subprocess.run(command, check=True)
    write_pretraining_set(whole, n_patients=16, slices_per_patient=2, seed=4, config=CONFIG, progress=False)
    assert _hashes(killed) == _hashes(whole)
    with (killed / "manifest.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 32
    assert json.loads((killed / "generator.json").read_text())["n_patients"] == 16
