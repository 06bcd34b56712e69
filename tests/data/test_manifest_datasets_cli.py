"""``vit-ct manifest --dataset NAME ROOT --output M.csv`` through the real command, on the dataset tests' own fixtures:
the files it writes equal what `write_dataset_manifest` writes for the same input and options, it prints the summary
and the converter's notes, an earlier manifest is kept without ``--overwrite`` and replaced with it, and a bad name,
option or ROOT is refused in one line (exit status 2) with nothing written. ``--help`` lists the form, every dataset
and every option, and its copy of the datasets' names and options is the converters' own. A truncated NIfTI volume is
refused by name, or left out and listed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pytest
import test_datasets_ctich
import test_datasets_instance
import test_datasets_rsna
from cq500_layout import SERIES, write_reads

from vit_ct.data.datasets import ALIASES, DATASETS, write_dataset_manifest
from vit_ct.data.datasets.volumes import incomplete_data
from vit_ct.run.manifest_command import DATASET_NAMES, DATASET_OPTIONS

VIT_CT = str(Path(sys.executable).with_name("vit-ct"))
# The dataset tests' fixtures, used as they are (pytest finds a fixture by its name in the test's module; cq500_root
# is every folder's, from cq500_layout)
ctich_root = test_datasets_ctich.ctich_root
instance_root, kaggle_root = test_datasets_instance.instance_root, test_datasets_rsna.kaggle_root


def manifest(*args, cwd: Path) -> subprocess.CompletedProcess:
    """``vit-ct manifest ARGS`` as a user runs it (tests/conftest.py's run_vit_ct, keeping the output and status)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [VIT_CT, "manifest", *map(str, args)]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def succeeded(run: subprocess.CompletedProcess) -> list[str]:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout.splitlines()


def refused(run: subprocess.CompletedProcess) -> str:
    """The one line of a refusal: exit status 2, nothing on stdout."""
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and run.stdout == "" and len(lines) == 1, (run.returncode, run.stdout, run.stderr)
    assert lines[0].startswith("vit-ct manifest: "), lines[0]
    return lines[0].removeprefix("vit-ct manifest: ")


def assert_same_masks(folder: Path, reference: Path) -> None:
    """Mask volumes alike voxel for voxel and affine (gzip headers carry a time, so the bytes may differ)."""
    names = sorted(p.name for p in folder.glob("*.nii.gz"))  # the masks (beside them, the folder's output record)
    assert names == sorted(p.name for p in reference.glob("*.nii.gz")) and names
    for name in names:
        ours, theirs = nib.load(folder / name), nib.load(reference / name)
        assert np.array_equal(np.asarray(ours.dataobj), np.asarray(theirs.dataobj)), name
        assert np.array_equal(ours.affine, theirs.affine) and ours.get_data_dtype() == theirs.get_data_dtype(), name


def test_help_lists_the_form_every_dataset_and_every_option_as_the_converters_have_them():
    run = manifest("--help", cwd=Path.cwd())
    text = re.sub(r"\s+", " ", run.stdout)
    assert run.returncode == 0 and "vit-ct manifest --dataset NAME ROOT --output M.csv [--overwrite]" in text
    assert {name: tuple(a for a, n in ALIASES.items() if n == name) for name in DATASETS} == DATASET_NAMES
    for name in [*DATASETS, *ALIASES]:
        assert re.search(rf"[ (]{name}[,). ]", text), name
    defaults = {(name, o): default for name, info in DATASETS.items() for o, default in info.options().items()}
    assert set(DATASET_OPTIONS) == {option for _, option in defaults}
    usual = {option: Counter(d for (_, o), d in defaults.items() if o == option).most_common(1)[0][0]
             for _, option in defaults}  # fmt: skip
    for (name, option), default in defaults.items():
        takers, settings = DATASET_OPTIONS[option]
        assert takers == tuple(n for n, info in DATASETS.items() if option in info.options()), option
        assert f"--{option}" in text
        if isinstance(default, bool):  # a switch that turns on what the default leaves off
            assert default is False and settings["action"] == "store_true", option
        else:  # the usual default, and a dataset's own where it differs
            assert f"(default {usual[option]}" in settings["help"] and settings.get("type", str) is type(default)
            assert default == usual[option] or f"{name}: {default}" in settings["help"], (name, option)


@pytest.mark.medium
def test_a_volume_set_through_the_command_equals_the_library_and_overwrite_is_asked_for(ctich_root, tmp_path):
    out, reference = tmp_path / "cli" / "ctich.csv", tmp_path / "api" / "ctich.csv"
    printed = succeeded(manifest("--dataset", "ctich", ctich_root, "--output", out, cwd=tmp_path))
    written = write_dataset_manifest("ctich", ctich_root, reference, progress=False)
    assert out.read_bytes() == reference.read_bytes()
    assert_same_masks(tmp_path / "cli" / "ctich_masks", tmp_path / "api" / "ctich_masks")
    # 12 slices of 3 patients, 5 labelled with a bleed (test_datasets_ctich.DIAGNOSIS, worked out by hand)
    assert printed[:3] == [
        f"wrote {out}: 12 slices of 3 scans, 5 slices with a bleed (PhysioNet CT-ICH v1.3.1, licence: PhysioNet"
        " Restricted Health Data License 1.5.0)",
        f"  and {out.parent / 'ctich_masks'}/",
        "notes on the data:",
    ]
    assert printed[3:] == [f"  {note}" for note in written.notes] and len(written.notes) >= 4

    before = out.read_bytes()
    message = refused(manifest("--dataset", "ctich", ctich_root, "--output", out, "--scan_labels", cwd=tmp_path))
    assert str(out) in message and "already exist" in message and "--overwrite" in message
    assert out.read_bytes() == before

    succeeded(
        manifest("--dataset", "ct-ich", ctich_root, "--output", out, "--scan_labels", "--overwrite", cwd=tmp_path)
    )
    write_dataset_manifest("ctich", ctich_root, reference, progress=False, scan_labels=True, overwrite=True)
    assert out.read_bytes() == reference.read_bytes() != before
    assert "scan_label" in pd.read_csv(out).columns
    assert_same_masks(tmp_path / "cli" / "ctich_masks", tmp_path / "api" / "ctich_masks")


@pytest.mark.medium
def test_cq500_end_to_end_with_its_options(cq500_root, tmp_path):
    write_reads(cq500_root / "reads.csv", [*SERIES, 4])  # a study read but not in the archive
    out, reference = tmp_path / "cli" / "cq500.csv", tmp_path / "api" / "cq500.csv"
    message = refused(
        manifest("--dataset", "cq500", cq500_root, "--output", out, "--on_missing", "raise", cwd=tmp_path)
    )
    assert "CQ500-CT-4 (no folder CQ500CT4 CQ500CT4)" in message and "skip" in message
    assert not out.parent.exists() or not list(out.parent.iterdir())

    options = ["--min_thickness_mm", "0.5"]  # on_missing skip: cq500's default
    printed = succeeded(manifest("--dataset", "CQ500", cq500_root, "--output", out, *options, cwd=tmp_path))
    written = write_dataset_manifest("cq500", cq500_root, reference, progress=False, on_missing="skip",
                                     min_thickness_mm=0.5)  # fmt: skip
    assert out.read_bytes() == reference.read_bytes()
    series = tmp_path / "cli" / "cq500.series.csv"
    assert series.read_bytes() == (tmp_path / "api" / "cq500.series.csv").read_bytes()
    # the thinnest series of each study at 0.5 mm (cq500_layout, by hand): 16 + 14 + 20 + 13 slices; ICH by
    # two of three readers in studies 0, 2 and 3
    first = pd.read_csv(out).groupby("scan", sort=False)["image"].first()
    assert [Path(p).parent.name for p in first] == ["CT PLAIN THIN", "CT 2.55mm", "CT Thin Plain", "CT 5mm-2"]
    assert printed[:3] == [
        f"wrote {out}: 63 slices of 4 scans, 3 scans with a bleed (CQ500 (qure.ai), licence: CC BY-NC-SA 4.0)",
        f"  and {series}",
        f"  and {tmp_path / 'cli' / 'cq500.left_out.csv'}",
    ]
    assert printed[3:] == ["notes on the data:", *(f"  {n}" for n in written.notes)]
    assert any("CQ500-CT-4" in note for note in written.notes)


@pytest.mark.medium
def test_rsna_options_name_another_stage(kaggle_root, tmp_path):
    (kaggle_root / "stage_2_train.csv").rename(kaggle_root / "stage_1_train.csv")
    (kaggle_root / "stage_2_train").rename(kaggle_root / "stage_1_train_images")
    options = {"labels_csv": "stage_1_train.csv", "images": "stage_1_train_images", "workers": 1}
    out, reference = tmp_path / "cli" / "rsna.csv", tmp_path / "api" / "rsna.csv"
    flags = [str(a) for k, v in options.items() for a in (f"--{k}", v)]
    printed = succeeded(manifest("--dataset", "rsna2019", kaggle_root, "--output", out, *flags, cwd=tmp_path))
    write_dataset_manifest("rsna", kaggle_root, reference, progress=False, **options)
    assert out.read_bytes() == reference.read_bytes() and list(pd.read_csv(out)["label"]) == [1, 0, 1]
    assert printed == [f"wrote {out}: 3 slices, 2 slices with a bleed (RSNA 2019 Intracranial Hemorrhage Detection,"
                       " licence: Kaggle competition terms (non-commercial))"]  # fmt: skip


@pytest.mark.medium
def test_a_bad_name_or_option_is_refused_in_one_line_and_nothing_is_written(instance_root, tmp_path):
    out = tmp_path / "out" / "m.csv"
    given = ["--output", out]
    thickness = ["--min_thickness_mm", "3"]
    assert refused(manifest("--dataset", "INSTANCE2022", instance_root, *given, *thickness, cwd=tmp_path)) == (
        "--min_thickness_mm is not an option of instance (only of cq500); instance's: --on_missing, --scan_labels"
    )
    assert refused(manifest("--dataset", "rsna", instance_root, *given, "--scan_labels", cwd=tmp_path)) == (
        "--scan_labels is not an option of rsna (only of ctich, instance, bhsd); rsna's: --labels_csv, --images,"
        " --workers"
    )
    assert refused(manifest("--dataset", "cq-5000", instance_root, *given, cwd=tmp_path)) == (
        "unknown dataset 'cq-5000'; expected one of cq500, ctich, instance, bhsd, rsna (or ct-ich, physionet,"
        " instance2022, rsna2019)"
    )
    assert refused(manifest(instance_root, *given, "--scan_labels", "--on_missing", "skip", cwd=tmp_path)) == (
        "--on_missing, --scan_labels are options of the --dataset NAME ROOT form; without --dataset, SCANS are DICOM"
        " folders and NIfTI volumes"
    )
    assert not out.parent.exists()


@pytest.mark.medium
def test_a_missing_or_wrong_root_is_refused_in_one_line_and_nothing_is_written(instance_root, tmp_path):
    out = tmp_path / "out" / "m.csv"
    given = ["--output", out]
    missing = refused(manifest("--dataset", "ctich", tmp_path / "nowhere", *given, cwd=tmp_path))
    assert missing.startswith(f"PhysioNet CT-ICH v1.3.1 folder {tmp_path / 'nowhere'} not found; expected a folder")
    archive = tmp_path / "ct-ich.zip"
    archive.write_bytes(b"PK")
    assert refused(manifest("--dataset", "ctich", archive, *given, cwd=tmp_path)) == (
        f"ROOT {archive} is a file; expected the dataset's folder (unpack an archive first)"
    )
    assert refused(manifest("--dataset", "instance", instance_root, tmp_path, *given, cwd=tmp_path)) == (
        f"--dataset instance takes one ROOT folder, got 2: {instance_root} {tmp_path}"
    )
    (tmp_path / "empty").mkdir()
    assert "lacks data, label" in refused(manifest("--dataset", "instance", tmp_path / "empty", *given, cwd=tmp_path))
    assert not out.parent.exists() or not list(out.parent.iterdir())


# --- A truncated NIfTI volume of a public dataset ---------------------------------------------------------------------


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.medium
def test_a_truncated_nifti_gz_is_refused_by_name_or_left_out_and_listed(instance_root, tmp_path):
    volume = instance_root / "train_2" / "data" / "002.nii.gz"
    _truncate(volume)
    with pytest.raises(ValueError, match=rf"{volume} is truncated: its gzip stream is cut after [\d,]+ of the [\d,]+"
                       r" bytes its header needs; .*on_missing='skip' leaves its case out"):  # fmt: skip
        write_dataset_manifest("instance", instance_root, tmp_path / "m.csv", progress=False)
    assert not (tmp_path / "m.csv").exists()

    run = manifest("--dataset", "instance", instance_root, "--output", "m.csv", "--on_missing", "skip", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    notes = run.stdout.split("notes on the data:\n")[1].splitlines()
    left = [note for note in notes if "incomplete voxel data" in note]
    assert left == ["  1 volume(s) with incomplete voxel data, their scans left out: 002.nii.gz (truncated) (each with"
                    " its reason in m.left_out.csv beside the manifest)"]  # fmt: skip
    assert f"  and {tmp_path / 'm.left_out.csv'}" in run.stdout.splitlines()
    assert set(pd.read_csv(tmp_path / "m.csv")["scan"]) == {"INSTANCE-001", "INSTANCE-017"}
    listed = pd.read_csv(tmp_path / "m.left_out.csv")
    assert listed["file"].tolist() == [str(volume)] and listed["reason"][0].startswith("truncated: its gzip stream")


def test_a_truncated_nii_is_found_by_its_size_and_complete_ones_cost_little(ctich_root, tmp_path):
    volumes = sorted(ctich_root.rglob("*.nii"))
    started = time.perf_counter()
    assert [incomplete_data(v) for v in volumes] == [None] * len(volumes)
    assert time.perf_counter() - started < 1.0  # headers and sizes only: ~1 ms a volume
    mask = ctich_root / "masks" / "066.nii"
    _truncate(mask)
    with pytest.raises(ValueError, match=rf"CT-ICH: {mask} is truncated: [\d,]+ of the [\d,]+ bytes its header"):
        write_dataset_manifest("ctich", ctich_root, tmp_path / "m.csv", progress=False)
    written = write_dataset_manifest("ctich", ctich_root, tmp_path / "m.csv", progress=False, on_missing="skip")
    assert set(written.table["scan"]) == {"CT-ICH-049", "CT-ICH-050"}
    assert pd.read_csv(tmp_path / "m.left_out.csv")["file"].tolist() == [str(mask)]
