"""``vit-ct predict --dicom_out true`` on DICOM series through the real command: per scan a Parametric Map equal to
the written maps and rollout volume, a SEG equal to the half-maximum region, Secondary Captures, a Structured Report of
the scan's finding that references them, all in the source study, with the same UIDs on a rerun, and every object
valid by dciodvfy."""

from __future__ import annotations

import highdicom as hd
import nibabel as nib
import numpy as np
import pandas as pd
import pydicom
import pytest
import torch
from conftest import DEMO, MANIFEST, TINY_MODEL_ARGS, run_vit_ct, tiny_data_args
from dicom_validation import dciodvfy_findings
from pydicom.sr.codedict import codes
from test_dicom_objects import KNOWN_WARNINGS, frame_sources

from vit_ct import load_ct_slice
from vit_ct.data.transforms.model_input import HEAD_HU
from vit_ct.explain.segmentation import half_max_region


def _predict(folders, checkpoint, out, cwd, *extra):
    return run_vit_ct("predict", "--config", DEMO, "--config", MANIFEST, *TINY_MODEL_ARGS, "--data.init_args.img_size",
                   "32", "--data.init_args.scans", f"[{','.join(map(str, folders))}]", "--ckpt_path", str(checkpoint),
                   "--output_dir", str(out), "--dicom_out", "true", *extra, cwd=cwd)  # fmt: skip


@pytest.mark.slow
def test_predict_writes_dicom_objects_of_each_scan_in_its_study(synthetic_set, tiny_checkpoint, tmp_path):  # noqa: F811
    folders = sorted((synthetic_set.parent / "images").iterdir())[:2]  # two patients' series
    out = tmp_path / "out"
    threshold = 0.3
    _predict(folders, tiny_checkpoint, out, tmp_path, "--decision_threshold", str(threshold))

    predictions = pd.read_csv(out / "predictions.csv", dtype={"scan": str})
    scans = pd.read_csv(out / "scans.csv", dtype={"scan": str}).set_index("scan")
    objects = pd.read_csv(out / "dicom" / "objects.csv", dtype={"scan": str})
    assert sorted(objects["scan"].unique()) == sorted(scans.index)
    for scan_id, listed in objects.groupby("scan"):
        kinds = listed.set_index("kind")["file"]
        assert list(listed["kind"]) == ["pm", "seg", "sc", "sc", "sc", "sc", "sr"]
        assert list(kinds[["pm", "seg", "sr"]]) == [f"dicom/{scan_id}/{k}.dcm" for k in ("pm", "seg", "sr")]
        rows = predictions[predictions["scan"] == scan_id]
        sources = {}
        for image, rollout, prob in zip(rows["image"], rows["rollout"], rows["prob"], strict=True):
            source = pydicom.dcmread(image)
            sources[source.SOPInstanceUID] = (source, np.load(out / rollout), load_ct_slice(image), prob)
        first = next(iter(sources.values()))[0]
        summary = scans.loc[scan_id]
        peak_source = pydicom.dcmread(rows["image"].iloc[int(summary["peak_slice"])])  # the scan's rows in scan order

        pm = pydicom.dcmread(out / kinds["pm"])
        assert sorted(frame_sources(pm)) == sorted(sources)  # every source slice referenced, no other
        volume = nib.load(out / summary["rollout"]).get_fdata(dtype=np.float32)  # (rows, cols, k), scan order
        order = {pydicom.dcmread(image).SOPInstanceUID: k for k, image in enumerate(rows["image"])}
        for frame, uid in zip(pm.pixel_array, frame_sources(pm), strict=True):
            _, heat, _, _ = sources[uid]
            assert frame.shape == heat.shape == (first.Rows, first.Columns)  # the source grid
            assert np.abs(frame - heat).max() == 0  # float32 stored as the .npy holds it: exact
            assert np.abs(frame - volume[:, :, order[uid]]).max() == 0
        assert pm.StudyInstanceUID == first.StudyInstanceUID and pm.FrameOfReferenceUID == first.FrameOfReferenceUID
        described = f"P(lesion) {summary['prob']:.3f}, peak image {peak_source.InstanceNumber}"
        assert pm.SeriesDescription == f"vit-ct rollout; {described}"

        seg = hd.seg.segread(out / kinds["seg"])
        uids = list(sources)
        pixels = seg.get_pixels_by_source_instance(source_sop_instance_uids=uids, segment_numbers=[1])[..., 0]
        heat = torch.from_numpy(np.stack([sources[u][1] for u in uids]))
        head = torch.from_numpy(np.stack([sources[u][2] for u in uids]) > HEAD_HU)
        np.testing.assert_array_equal(pixels.astype(bool), half_max_region(heat, head).numpy())
        assert seg.SeriesDescription == f"vit-ct half-max; {described}"

        sr = hd.sr.srread(out / kinds["sr"])  # the scan's finding as the report and the decision say it
        (finding,) = sr.content.get_image_measurement_groups()  # a binary model: intracranial haemorrhage only
        assert (
            finding.finding_type == codes.SCT.IntracranialHemorrhage and sr.StudyInstanceUID == first.StudyInstanceUID
        )
        (probability,) = finding.get_measurements(name=codes.DCM.Probability)
        assert probability.value == pytest.approx(summary["prob"])
        assert finding.get_measurements(name=codes.DCM.ThresholdValue)[0].value == threshold
        decision = finding.get_qualitative_evaluations(name=codes.DCM.PresenceOfProperty)[0].value
        assert decision == (codes.SCT.Present if summary["prob"] >= threshold else codes.SCT.Absent)
        assert finding.source_images[0].referenced_sop_instance_uid == peak_source.SOPInstanceUID
        (region,) = sr.content.get_volumetric_roi_measurement_groups()
        assert region.referenced_segment.referenced_sop_instance_uid == seg.SOPInstanceUID
        (peak,) = region.get_measurements(name=codes.DCM.Saliency)
        assert peak.referenced_images[0].referenced_sop_instance_uid == pm.SOPInstanceUID

        for path in listed.loc[listed["kind"] == "sc", "file"]:
            sc = pydicom.dcmread(out / path)
            source = sources[sc.SourceImageSequence[0].ReferencedSOPInstanceUID][0]
            assert sc.BurnedInAnnotation == "YES" and sc.StudyInstanceUID == source.StudyInstanceUID
        for path in listed["file"]:
            errors, warnings = dciodvfy_findings(out / path)
            assert errors == [], f"{path}: {errors}"
            assert set(warnings) <= set(KNOWN_WARNINGS), f"{path}: {warnings}"

    rerun = tmp_path / "rerun"
    _predict(folders, tiny_checkpoint, rerun, tmp_path, "--decision_threshold", str(threshold))
    again = pd.read_csv(rerun / "dicom" / "objects.csv", dtype={"scan": str})
    pd.testing.assert_frame_equal(again, objects)  # the same files, series and instance UIDs


@pytest.mark.slow
def test_a_manifest_of_dicom_slices_gets_the_objects_of_each_scan(synthetic_set, tiny_checkpoint, tmp_path):  # noqa: F811
    """The other input: slices listed in a manifest (the demo's synthetic set, scans by patient), not series folders;
    each scan's Parametric Map holds its slices' maps as predictions.csv lists them."""
    out = tmp_path / "out"
    run_vit_ct("predict", "--config", DEMO, *tiny_data_args(synthetic_set), *TINY_MODEL_ARGS, "--ckpt_path",
            str(tiny_checkpoint), "--data.init_args.predict_split", "test", "--output_dir", str(out), "--dicom_out",
            "true", cwd=tmp_path)  # fmt: skip
    predictions = pd.read_csv(out / "predictions.csv", dtype={"scan": str})
    objects = pd.read_csv(out / "dicom" / "objects.csv", dtype={"scan": str})
    assert sorted(objects["scan"].unique()) == sorted(predictions["scan"].unique())
    for scan_id, rows in predictions.groupby("scan"):
        listed = objects[objects["scan"] == scan_id].set_index("kind")
        assert (listed.index == "sc").sum() == len(rows)  # an overlay per slice
        pm = pydicom.dcmread(out / listed.loc["pm", "file"])
        maps = {pydicom.dcmread(synthetic_set.parent / image).SOPInstanceUID: np.load(out / rollout)
                for image, rollout in zip(rows["image"], rows["rollout"], strict=True)}  # fmt: skip
        assert sorted(frame_sources(pm)) == sorted(maps)
        for frame, uid in zip(pm.pixel_array.reshape(-1, *pm.pixel_array.shape[-2:]), frame_sources(pm), strict=True):
            assert np.abs(frame - maps[uid]).max() == 0
        for kind in ("pm", "seg"):
            errors, _ = dciodvfy_findings(out / listed.loc[kind, "file"])
            assert errors == [], f"{scan_id} {kind}: {errors}"


@pytest.mark.slow
def test_a_scan_without_frame_of_reference_keeps_no_other_object_from_being_written(
    synthetic_set,
    tiny_checkpoint,  # noqa: F811
    tmp_path,
):
    """pydicom-data's CQ500 slice has no FrameOfReferenceUID, which a Parametric Map and a SEG need: that scan's
    objects that can be made (the Secondary Captures) are, the others are listed with highdicom's reason, and every
    other scan gets all of its objects; predict's own outputs are all written."""
    good, source = sorted((synthetic_set.parent / "images").iterdir())[:2]
    bad = tmp_path / "no_frame_of_reference"
    bad.mkdir()
    for path in sorted(source.iterdir()):
        dataset = pydicom.dcmread(path)
        del dataset.FrameOfReferenceUID
        dataset.PatientName = "ANONYMOUS"  # one component, as anonymised exports have it
        dataset.save_as(bad / path.name)
    out = tmp_path / "out"
    run = _predict([good, bad], tiny_checkpoint, out, tmp_path)
    predictions = pd.read_csv(out / "predictions.csv", dtype={"scan": str})
    assert len(predictions) == len(list(good.iterdir())) + len(list(bad.iterdir()))
    objects = pd.read_csv(out / "dicom" / "objects.csv", dtype={"scan": str})
    bad_scan = predictions.loc[predictions["image"].str.contains("no_frame_of_reference"), "scan"].iloc[0]
    written = objects.dropna(subset=["file"])
    assert set(written.loc[written["scan"] != bad_scan, "kind"]) == {"pm", "seg", "sc", "sr"}
    assert set(written.loc[written["scan"] == bad_scan, "kind"]) == {"sc"}
    refused = objects[objects["file"].isna()].set_index("kind")
    assert set(refused.index) == {"pm", "seg", "sr"} and set(refused["scan"]) == {bad_scan}
    assert refused.loc["sr", "reason"].startswith("ValueError: the SR references the Parametric Map and the SEG")
    assert refused["reason"].str.contains("Frame Of Reference").all()
    assert "could not be written, each listed with its reason in" in run.stdout + run.stderr
    assert str(out / "dicom" / "objects.csv") in run.stdout + run.stderr  # OUT as the user named it
    assert "unlikely to represent the intended person name" not in run.stderr  # highdicom's, about the source's name


@pytest.mark.parametrize(
    ("threshold", "dicom_out", "expected"),
    [
        (1.5, True, r"--decision_threshold 1.5: expected a probability between 0 and 1"),
        (float("nan"), True, r"--decision_threshold nan: expected a probability between 0 and 1"),
        (0.2, False, r"--decision_threshold is where --dicom_out's Structured Report calls .* add --dicom_out true"),
    ],
)
def test_a_decision_threshold_that_cannot_apply_is_refused_before_anything_is_written(
    tmp_path, threshold, dicom_out, expected
):
    from vit_ct.cli import _prediction_writers

    out = tmp_path / "out"
    with pytest.raises(ValueError, match=expected):
        _prediction_writers(str(out), False, [], dicom_out, decision_threshold=threshold)
    assert not out.exists()
    (writer, *_, objects) = _prediction_writers(str(out), False, [], True, decision_threshold=0.0)
    assert objects.threshold == 0.0  # 0 and 1 are thresholds too (every scan present; only P = 1)


@pytest.mark.parametrize(
    ("task", "names", "expected"),
    [
        ("binary", ["lesion"], []),
        (
            "multiclass",
            ["normal", "epidural", "subdural"],
            [("epidural", "prob_epidural"), ("subdural", "prob_subdural")],
        ),
        ("multilabel", ["epidural", "any", "subdural"], [("epidural", "prob_epidural"), ("subdural", "prob_subdural")]),
    ],
)
def test_the_report_names_haemorrhage_then_each_subtype_the_model_has(task, names, expected):
    """P(lesion) first (1 - P(normal), the ``any`` label, or the binary output), then a multi-class model's classes
    but the first and a multi-label model's labels but ``any``, each from its probability column."""
    from vit_ct.predict.dicom_scan import findings_of

    assert findings_of({"task": task, "class_names": names}) == [(None, "p_lesion"), *expected]
