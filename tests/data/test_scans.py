"""Whole scans without a manifest: DICOM series found, grouped and ordered by geometry, non-CT objects listed, the
volume affine against nibabel's, and `vit-ct predict` on a folder of scans writing per-scan results and NIfTI maps."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pydicom
import pytest
from conftest import MANIFEST, TINY_MODEL_ARGS
from nibabel.nicom.dicomwrappers import wrapper_from_data
from pydicom.data import get_testdata_file
from pydicom.uid import generate_uid

from vit_ct import load_ct_slice
from vit_ct.cli import main
from vit_ct.data.io.reader import from_display
from vit_ct.data.io.scans import LPS_TO_RAS, find_scans

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs" / "demo.yaml")


@pytest.fixture(scope="module")
def archive(synthetic_set, tmp_path_factory) -> Path:
    """A DICOM tree as an archive holds it: two synthetic patients' series, a real JPEG 2000 CT slice, a three-slice
    series made from a real CT slice whose InstanceNumbers run against its positions, an MR image, an RT plan and a
    text file; every file under a shuffled name."""
    root = tmp_path_factory.mktemp("archive")
    files = []
    for patient in sorted((synthetic_set.parent / "images").iterdir())[:2]:
        files += sorted(patient.glob("*.dcm"))
    files += [Path(get_testdata_file(name)) for name in ("693_J2KR.dcm", "MR_small.dcm", "rtplan.dcm")]
    rng = random.Random(0)
    names = [f"IM{n:05d}" for n in rng.sample(range(100000), len(files) + 3)]
    for source, name in zip(files, names, strict=False):
        folder = root / "study" / f"series{rng.randrange(3)}"  # folders do not follow the series either
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, folder / name)
    ct = pydicom.dcmread(get_testdata_file("CT_small.dcm"))
    ct.SeriesInstanceUID = generate_uid(entropy_srcs=["vit-ct test series"])
    for k, name in enumerate(names[len(files) :]):
        ct.ImagePositionPatient = [-158.135803, -179.035797, -75.7 + 5.0 * k]
        ct.InstanceNumber = 3 - k
        ct.SOPInstanceUID = generate_uid(entropy_srcs=["vit-ct test slice", str(k)])
        ct.save_as(root / "study" / "series0" / name)
    (root / "study" / "README.txt").write_text("not a DICOM file")
    return root


def test_series_are_grouped_and_ordered_along_the_normal(archive):
    scans, skipped = find_scans(archive)
    assert len(scans) == 4  # two synthetic patients, the real slice, the made series
    reasons = {Path(s.path).name: s.reason for s in skipped}
    assert any("Modality is MR" in r for r in reasons.values())
    assert any("no pixel data" in r for r in reasons.values())  # the RT plan
    assert reasons["README.txt"].startswith("not a DICOM file")
    for scan in scans:
        headers = [pydicom.dcmread(p, stop_before_pixels=True) for p in scan.images]
        assert len({h.SeriesInstanceUID for h in headers}) == 1
        z = [float(h.ImagePositionPatient[2]) for h in headers]  # axial: the normal is +z
        assert z == sorted(z) and scan.positions_mm == pytest.approx(z)
    made = next(s for s in scans if len(s.images) == 3)
    instances = [int(pydicom.dcmread(p, stop_before_pixels=True).InstanceNumber) for p in made.images]
    assert instances == [3, 2, 1]  # ordered by position, not by InstanceNumber nor by file name


def test_affine_is_the_dicom_geometry_nibabel_reads(archive):
    scans, _ = find_scans(archive)
    for scan in scans:
        first = pydicom.dcmread(scan.images[0])
        nibabel_lps = wrapper_from_data(first).affine  # voxel (row, column, slice) -> LPS mm, in-plane exact
        np.testing.assert_allclose(scan.affine[:, [0, 1, 3]], (LPS_TO_RAS @ nibabel_lps)[:, [0, 1, 3]], atol=1e-4)
        for k, path in enumerate(scan.images):  # every slice's ImagePositionPatient is voxel (0, 0, k)
            position = np.array([float(v) for v in pydicom.dcmread(path, stop_before_pixels=True).ImagePositionPatient])
            np.testing.assert_allclose((scan.affine @ [0, 0, k, 1])[:3], (LPS_TO_RAS[:3, :3] @ position), atol=1e-3)


def test_manifest_command_lists_every_slice_with_blank_labels(archive, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "labels" / "manifest.csv"
    main(["manifest", str(archive), "--output", str(out)])
    table = pd.read_csv(out)
    scans, skipped = find_scans(archive)
    assert len(table) == sum(len(s.images) for s in scans)
    assert table["label"].isna().all()
    assert {"image", "slice", "patient_id", "study_uid", "series_uid", "scan", "scan_slice", "position_mm"} <= set(
        table.columns
    )
    for _, row in table.iterrows():  # paths relative to the manifest's folder, as the manifest format reads them
        assert (out.parent / row["image"]).is_file()
    assert len(pd.read_csv(out.with_name("manifest.skipped.csv"))) == len(skipped)
    printed = capsys.readouterr().out
    assert str(out) in printed and "label" in printed
    with pytest.raises(ValueError, match="label"):  # unlabelled: training refuses it, naming the lines
        main(["fit", "--config", DEMO, "--config", MANIFEST, "--data.manifest", str(out), *TINY_MODEL_ARGS,
              "--trainer.logger", "false"])  # fmt: skip
    table.assign(label=1).to_csv(out, index=False)  # labels filled in are never overwritten
    labelled = out.read_text()
    with pytest.raises(SystemExit) as refused:
        main(["manifest", str(archive), "--output", str(out)])
    assert refused.value.code == 2 and "--overwrite" in capsys.readouterr().err and out.read_text() == labelled
    with pytest.raises(SystemExit) as missing:
        main(["manifest", str(archive / "nope"), "--output", str(tmp_path / "other.csv")])
    assert missing.value.code == 2 and str(archive / "nope") in capsys.readouterr().err


def test_linked_series_are_followed_once_and_loops_are_named(archive, tmp_path, capsys, monkeypatch):
    """An archive assembled from links (its study folder linked in twice, one of its files linked beside it) is read as
    its real files, each once, under the first path that reaches it; a link back to a folder above it and a link to
    nothing are listed with their reason, in the printed summary and the skipped CSV."""
    linked = tmp_path / "linked"
    (linked / "sub").mkdir(parents=True)
    (linked / "a").symlink_to(archive / "study", target_is_directory=True)
    (linked / "b").symlink_to(archive / "study", target_is_directory=True)  # the same folder through another link
    (linked / "c").symlink_to(sorted((archive / "study" / "series0").iterdir())[0])  # a file already under a/
    (linked / "gone").symlink_to(tmp_path / "nothing")
    (linked / "sub" / "up").symlink_to(linked, target_is_directory=True)  # a loop
    scans, skipped = find_scans(linked)
    real_scans, real_skipped = find_scans(archive)
    assert [[os.path.realpath(p) for p in s.images] for s in scans] == [s.images for s in real_scans]
    assert all(Path(p).is_relative_to(linked / "a") for s in scans for p in s.images)  # paths as the user sees them
    reasons = {s.path: s.reason for s in skipped}
    assert reasons.pop(str(linked / "sub" / "up")) == f"a link to {linked}, a folder that holds it: not followed (it" \
        " would loop)"  # fmt: skip
    assert reasons.pop(str(linked / "gone")) == f"a link to {tmp_path / 'nothing'}, which does not exist"
    assert sorted((os.path.realpath(p), r) for p, r in reasons.items()) == sorted(
        (s.path, s.reason) for s in real_skipped
    )  # the archive's own non-CT files, each once

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "linked.csv"
    main(["manifest", str(linked / "sub" / ".."), str(archive / "study" / "series0"), "--output", str(out)])
    assert len(pd.read_csv(out)) == sum(len(s.images) for s in real_scans)  # the second path adds no file twice
    listed = pd.read_csv(out.with_name("linked.skipped.csv"))
    assert str(linked / "sub" / "up") in set(listed["path"]) and "it would loop" in capsys.readouterr().out


def test_scans_refuse_training(archive, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="vit-ct manifest"):
        main(["fit", "--config", DEMO, "--config", MANIFEST, "--data.init_args.scans", str(archive),
              *TINY_MODEL_ARGS, "--trainer.logger", "false"])  # fmt: skip


@pytest.mark.slow
def test_predict_on_scans_writes_scan_results_and_aligned_nifti(archive, tiny_checkpoint, tmp_path):
    from conftest import run_vit_ct

    # A NIfTI volume too, stored left-right flipped and with its own grid, to check maps land on the file's voxels.
    volume_scan = next(s for s in find_scans(archive)[0] if len(s.images) == 4)
    hu = np.stack([load_ct_slice(p) for p in volume_scan.images], axis=-1)  # (rows, cols, k) display orientation
    affine = np.diag([-0.9, -0.9, 5.0, 1.0])  # voxel axis 0 runs to the left, axis 1 to posterior: LPS storage
    nifti = tmp_path / "volume.nii.gz"
    nib.save(nib.Nifti1Image(hu[:, ::-1].transpose(1, 0, 2).astype(np.int16), affine), nifti)

    out = tmp_path / "out"
    relative = os.path.relpath(archive, tmp_path)  # as a user types it, from the working folder
    run_vit_ct("predict", "--config", DEMO, "--config", MANIFEST, *TINY_MODEL_ARGS, "--data.init_args.img_size", "32",
            "--data.init_args.windows", "[brain,subdural]", "--data.init_args.scans", f"[{relative},{nifti}]",
            "--ckpt_path", str(tiny_checkpoint), "--output_dir", str(out), cwd=tmp_path)  # fmt: skip
    assert not (tmp_path / "runs" / "wandb").exists()  # predict opens no W&B run

    predictions = pd.read_csv(out / "predictions.csv")
    scans = pd.read_csv(out / "scans.csv")
    found, skipped = find_scans([archive, nifti])
    assert len(predictions) == sum(len(s.images) for s in found)
    assert sorted(scans["scan"]) == sorted(s.scan_id for s in found)
    assert len(pd.read_csv(out / "skipped.csv")) == len(skipped) == 3
    for scan in found:
        row = scans.set_index("scan").loc[scan.scan_id]
        rows = predictions[predictions["image"].isin(set(scan.images))]
        if scan.kind == "nifti":
            rows = predictions[predictions["image"] == str(nifti)]
        else:  # in scan order
            rows = rows.set_index("image").loc[scan.images].reset_index()
        probs = rows["prob"].to_numpy()
        assert row["prob"] == pytest.approx(probs.max()) and row["peak_slice"] == int(np.argmax(probs))
        assert [float(p) for p in row["slice_probs"].split(";")] == pytest.approx(probs, abs=1e-4)

        ct, rollout = nib.load(out / row["ct"]), nib.load(out / row["rollout"])
        np.testing.assert_allclose(rollout.affine, scan.affine, atol=1e-4)
        np.testing.assert_allclose(ct.affine, scan.affine, atol=1e-4)
        volume, ct_volume = rollout.get_fdata(), ct.get_fdata()
        assert volume.shape[2] == len(scan.images)
        for k, (image, frame) in enumerate(zip(scan.images, scan.frames, strict=True)):
            heat = np.load(out / rows["rollout"].iloc[k])  # slice k's map on its own rows x columns
            source = load_ct_slice(image, frame)
            if scan.kind == "nifti":
                heat, source = from_display(heat, scan.affine), from_display(source, scan.affine)
            np.testing.assert_allclose(volume[:, :, k], heat, rtol=1e-6)
            np.testing.assert_array_equal(ct_volume[:, :, k], source)
        assert (out / row["views"]).is_file()
    # the NIfTI input comes back on its own voxels: the written CT is the input
    nifti_row = scans.set_index("scan").loc["volume"]
    np.testing.assert_array_equal(nib.load(out / nifti_row["ct"]).get_fdata(), nib.load(nifti).get_fdata())


@pytest.mark.medium
def test_scan_auroc_in_vit_ct_test_is_the_auroc_of_each_scans_maximum(
    synthetic_set, tiny_checkpoint, tmp_path, monkeypatch
):
    from sklearn.metrics import roc_auc_score

    monkeypatch.chdir(tmp_path)  # `test` without a logger writes its config.yaml into the working folder

    # Every slice in the test split, two slices to a scan, so that both classes of scans occur.
    table = pd.read_csv(synthetic_set)
    table["image"] = [str(synthetic_set.parent / p) for p in table["image"]]
    table["mask"] = [str(synthetic_set.parent / p) for p in table["mask"]]
    table["split"] = "test"
    within = table.groupby("patient_id").cumcount()
    table["scan"] = [f"{p}-{k // 2}" for p, k in zip(table["patient_id"], within, strict=True)]
    manifest = tmp_path / "scans.csv"
    table.to_csv(manifest, index=False)
    args = ["--config", DEMO, "--config", MANIFEST, "--data.manifest", str(manifest), *TINY_MODEL_ARGS,
            "--data.init_args.img_size", "32", "--data.init_args.windows", "[brain,subdural]",
            "--data.init_args.num_workers", "0", "--trainer.precision", "32-true"]  # fmt: skip
    cli = main(["test", *args, "--ckpt_path", str(tiny_checkpoint), "--trainer.logger", "false"])
    logged = float(cli.trainer.callback_metrics["test/scan_auroc"])

    out = tmp_path / "out"
    main(["predict", *args, "--ckpt_path", str(tiny_checkpoint), "--output_dir", str(out)])
    slices = pd.read_csv(out / "predictions.csv").assign(scan=table["scan"])
    per_scan = slices.groupby("scan").agg(prob=("prob", "max"), label=("label", "max"))
    assert per_scan["label"].nunique() == 2
    assert logged == pytest.approx(roc_auc_score(per_scan["label"], per_scan["prob"]), abs=1e-5)
    scans = pd.read_csv(out / "scans.csv").set_index("scan").loc[per_scan.index]  # predict groups the same way
    np.testing.assert_allclose(scans["prob"], per_scan["prob"], atol=1e-6)
    assert (scans["label"] == per_scan["label"]).all()


def test_review_scores_scans_by_their_most_suspicious_slice():
    from vit_ct import review

    table = pd.DataFrame(
        {
            "image": [f"s{i}.dcm" for i in range(6)],
            "scan": ["A", "A", "B", "B", "C", "D"],
            "prob": [0.2, 0.9, 0.95, 0.1, 0.3, 0.05],
            "label": pd.array([0, 1, 0, 0, 1, 0], dtype="Int64"),
        }
    )
    scans = review.scan_results(table).set_index("scan")
    assert list(scans["prob"]) == [0.9, 0.95, 0.3, 0.05] and list(scans["label"]) == [1, 0, 1, 0]
    assert list(scans["peak_slice"]) == [1, 0, 0, 0]
    metrics = review.summary_metrics(table)
    # scans: positives 0.9, 0.3 against negatives 0.95, 0.05: 2 of 4 pairs ranked right
    assert metrics["scans"] == 4 and metrics["positive_scans"] == 2 and metrics["scan_auroc"] == 0.5


def test_enhanced_ct_frames_are_placed_from_their_functional_groups():
    path = get_testdata_file("eCT_Supplemental.dcm")  # two frames, positions per frame, orientation shared
    (scan,), skipped = find_scans(path)
    assert not skipped and len(scan.images) == 2 and set(scan.images) == {path}
    ds = pydicom.dcmread(path)
    orientation = np.array(ds.SharedFunctionalGroupsSequence[0].PlaneOrientationSequence[0].ImageOrientationPatient)
    normal = np.cross(orientation[:3], orientation[3:])
    for k, frame in enumerate(scan.frames):
        position = np.array(ds.PerFrameFunctionalGroupsSequence[frame].PlanePositionSequence[0].ImagePositionPatient)
        np.testing.assert_allclose((scan.affine @ [0, 0, k, 1])[:3], LPS_TO_RAS[:3, :3] @ position, atol=1e-4)
        assert scan.positions_mm[k] == pytest.approx(float(position @ normal))
    assert scan.positions_mm[0] < scan.positions_mm[1]  # ascending along the normal, whatever the frame order


def test_scan_paths_without_ct_are_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=str(tmp_path / "nowhere")):
        find_scans(tmp_path / "nowhere")
    shutil.copy(get_testdata_file("MR_small.dcm"), tmp_path / "mr")
    with pytest.raises(ValueError, match=r"no CT scan found(.|\n)*mr: Modality is MR, not CT"):
        find_scans(tmp_path)
    with pytest.raises(ValueError, match="data.manifest or data.scans"):
        main(["predict", "--config", MANIFEST, "--data.manifest", "m.csv", "--data.init_args.scans", f"[{tmp_path}]",
              "--output_dir", str(tmp_path / "out")])  # fmt: skip
