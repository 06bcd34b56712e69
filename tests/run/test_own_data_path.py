"""The README's "Your own data" path walked as a newcomer walks it, on a messy hospital export rather than a tidy
folder: series in ``PATIENT/StudyDate/SeriesDescription/`` folders, files without extensions, a DICOMDIR, pydicom-data's
real CQ500 head slice (no FrameOfReferenceUID, which a Parametric Map and a SEG need) and pydicom's ``CT_small.dcm``
(a vertebra, not a head). Every command of the README's block exits 0; every good scan gets all of its outputs and
objects; what is left out or flagged is listed with its reason."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from test_readme import BLOCKS, runnable

from vit_ct.sim.phantom import PhantomConfig
from vit_ct.sim.synthetic import simulate_patient, write_slices

CQ500_SLICE, VERTEBRA = "693_UNCI.dcm", "CT_small.dcm"
# The README's own-data block: the one that lists a DICOM archive
OWN_DATA = next(block for block in BLOCKS if any(c.argv[:3] == ["vit-ct", "manifest", "DICOM_DIR"] for c in block))
# Its commands on other inputs (CQ500's layout, a NIfTI volume) are run by test_readme.py
OTHER_INPUTS = ("--dataset", "cq500.csv", "VOLUME.nii.gz")


def messy_export(folder: Path, patients: int = 6) -> dict[str, int]:
    """A hospital export under ``folder``; returns each slice file's label by its path relative to ``folder``'s parent
    (as the manifest names it). Synthetic heads at 128 x 128 (1.8 mm pixels), four slices each."""
    from pydicom.data import get_testdata_file

    labels = {}
    for index in range(patients):
        slices = simulate_patient(11, index, 4, PhantomConfig(size=128, pixel_spacing_mm=1.8))
        written = folder.parent / "written" / f"P{index}"
        rows = write_slices(slices, seed=11, pid=f"HOSP{index:03d}", images=written, masks=written / "masks")
        series = folder / f"HOSP{index:03d}" / "20240102" / "CT HEAD 5mm"
        series.mkdir(parents=True)
        for k, row in enumerate(rows, start=1):
            target = series / f"IM{k:04d}"  # no extension, as many PACS exports write them
            shutil.move(written / Path(row["image"]).name, target)
            labels[target.relative_to(folder.parent).as_posix()] = int(row["label"])
    shutil.rmtree(folder.parent / "written")
    for name, series in ((CQ500_SLICE, "CQ500-CT-1/20100101/CT PLAIN THIN"), (VERTEBRA, "SPINE/20040119/CT")):
        target = folder / series / "IM0001"
        target.parent.mkdir(parents=True)
        shutil.copy(get_testdata_file(name), target)
        labels[target.relative_to(folder.parent).as_posix()] = 0
    shutil.copy(get_testdata_file("DICOMDIR"), folder / "DICOMDIR")  # the export's index, a real one
    return labels


@pytest.mark.slow
def test_the_readme_own_data_path_on_a_messy_export(tmp_path, synthetic_set):
    labels = messy_export(tmp_path / "dicom")  # the README's DICOM_DIR
    assert set(labels.values()) == {0, 1}, "the export has slices with and without a bleed"
    (tmp_path / "configs").symlink_to(Path(__file__).resolve().parents[2] / "configs")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    env.pop("WANDB_SERVICE", None)

    def run(argv: list[str]) -> str:
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, f"{argv} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        return result.stdout + result.stderr

    said = {}
    commands = [c for c in OWN_DATA if not any(word in arg for word in OTHER_INPUTS for arg in c.argv)]
    assert [c.argv[1] for c in commands] == ["manifest", "fit", "predict", "report", "predict"], commands
    for command in commands:
        said[command.argv[1], len(said)] = run(runnable(command, synthetic_set))
        if command.argv[1] == "manifest":  # the user fills in the labels (my.csv) and lists new slices (new.csv)
            archive = pd.read_csv(tmp_path / "archive.csv")
            assert sorted(archive["image"]) == sorted(labels)  # every slice, extensionless or not; nothing else
            archive["label"] = archive["image"].map(labels)
            archive.to_csv(tmp_path / "my.csv", index=False)
            archive[["image", "patient_id", "scan"]].to_csv(tmp_path / "new.csv", index=False)
            skipped = pd.read_csv(tmp_path / "archive.skipped.csv")
            assert list(skipped["path"]) == [str(tmp_path / "dicom" / "DICOMDIR")]
            assert skipped["reason"].str.contains("a DICOMDIR").all()
    manifest, fit, predict, report, scans = said.values()
    assert "archive.skipped.csv" in manifest and "DICOMDIR" in manifest

    # predict on the listed slices: every slice, the vertebra flagged, by its file, with the reason
    out = pd.read_csv(tmp_path / "out" / "predictions.csv", keep_default_na=False)
    assert len(out) == len(labels) and all((tmp_path / "out" / png).is_file() for png in out["overlay"])
    flagged = out.loc[out["outside_domain"] != "", "image"]
    assert [Path(image).parts[1] for image in flagged] == ["SPINE"], out[["image", "outside_domain"]]
    assert "1 of 26 slices do not look like an axial head CT" in predict and "SPINE" in predict
    assert f"vit-ct predict wrote {tmp_path / 'out'}: 26 slices" in predict
    assert (tmp_path / "out" / "report" / "report.html").is_file() and "report written" in report

    # whole scans with --dicom_out: every scan's objects, but the CQ500 slice's Parametric Map and SEG, each said
    objects = pd.read_csv(tmp_path / "scans_out" / "dicom" / "objects.csv", keep_default_na=False)
    predictions = pd.read_csv(tmp_path / "scans_out" / "predictions.csv")
    scan_of = predictions.set_index("image")["scan"]
    cq500 = scan_of[str(tmp_path / "dicom" / "CQ500-CT-1" / "20100101" / "CT PLAIN THIN" / "IM0001")]
    assert sorted(objects["scan"].unique()) == sorted(scan_of.unique()) and len(scan_of.unique()) == 8
    for scan, listed in objects.groupby("scan"):
        made = listed[listed["file"] != ""]
        assert all((tmp_path / "scans_out" / file).is_file() for file in made["file"])
        assert (made["kind"] == "sc").sum() == (scan_of == scan).sum()  # a Secondary Capture per slice
        if scan == cq500:
            refused = listed[listed["file"] == ""]
            assert (
                sorted(refused["kind"]) == ["pm", "seg", "sr"]
                and refused["reason"].str.contains("Frame Of Reference").all()
            )
        else:
            assert {"pm", "seg", "sr"} <= set(made["kind"]) and (listed["reason"] == "").all()
    assert "3 object(s) of 1 scan(s) could not be written" in scans and "objects.csv" in scans
    assert "DICOMDIR" in (tmp_path / "scans_out" / "skipped.csv").read_text()

    # the headless review the README names, on the user's checkpoint, manifest and predict output: says what it read
    checkpoint = (tmp_path / "runs" / "latest" / "checkpoints" / "last.ckpt").resolve()
    review = run([sys.executable, "-m", "vit_ct.review", "--ckpt_path", str(checkpoint), "--manifest", "my.csv",
                  "--predict_output", "out"])  # fmt: skip
    assert f"reviewing {checkpoint} on {tmp_path / 'my.csv'}" in review and f"scans of {tmp_path / 'out'}" in review
    assert (tmp_path / "outputs" / "review" / "review.csv").is_file()
