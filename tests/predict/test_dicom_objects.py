"""The DICOM objects of a scan's results (vit_ct.predict.dicom_objects) built on a synthetic patient's real CT series
and read back with pydicom and highdicom: values, grid, referenced slices, study and patient, UIDs, and dciodvfy."""

from __future__ import annotations

import copy
from dataclasses import replace

import highdicom as hd
import numpy as np
import pydicom
import pytest
from dicom_validation import dciodvfy_findings
from PIL import Image
from pydicom.sr.codedict import codes
from pydicom.uid import ParametricMapStorage

from vit_ct.explain.overlay import add_caption, render_overlay
from vit_ct.predict.dicom_objects import (
    NOT_FOR_DIAGNOSIS,
    PRIVATE_SCHEME,
    Finding,
    Provenance,
    finding_code,
    parametric_map,
    patient_orientation,
    secondary_captures,
    segmentation,
    structured_report,
)

PROVENANCE = Provenance("vit_tiny_patch16_224", "ab" * 32, "attention rollout (head fusion mean)", "0.1.0")
# dciodvfy (dicom3tools 2022) does not know QUANTITY, the Derived Pixel Contrast (Image Type value 4) that PS3.3
# C.8.32 gives a Parametric Map of a quantity (highdicom's default); defined terms may be extended, so it only warns.
KNOWN_WARNINGS = (
    "Warning - Unrecognized defined term <QUANTITY> for value 4 of attribute <Image Type>",
    "Warning - Unrecognized defined term <QUANTITY> for value 4 of attribute <Frame Type>",
    # a private coding scheme (PS3.3 8.2: designators beginning "99"), declared in the SR's Coding Scheme
    # Identification; dciodvfy knows only the standard ones
    f"Warning - Unrecognized defined term <{PRIVATE_SCHEME}> for value 1 of attribute <Coding Scheme Designator>",
)


@pytest.fixture(scope="module")
def series(synthetic_set):
    """One synthetic patient's 4 CT slices (pydicom datasets, scan order) and hand-made float32 maps on their grid."""
    files = sorted((synthetic_set.parent / "images").glob("*/*.dcm"))[:4]
    sources = [pydicom.dcmread(f) for f in files]
    assert len({s.SeriesInstanceUID for s in sources}) == 1
    maps = np.random.default_rng(0).random((4, 64, 64)).astype(np.float32) * np.float32(0.02)
    maps[2] = 0  # a slice whose map points nowhere: its SEG frame is empty, and kept
    return sources, maps


def frame_sources(ds) -> list[str]:
    """The source SOPInstanceUID each frame of a multi-frame object derives from, in frame order."""
    groups = ds.PerFrameFunctionalGroupsSequence
    return [g.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID for g in groups]


def assert_in_source_study(ds, source, *, frame_of_reference: bool = True, body_part: bool = True):
    for keyword in ("StudyInstanceUID", "PatientID", "PatientName", "PatientBirthDate", "PatientSex", "StudyDate"):
        assert ds[keyword].value == source[keyword].value, keyword
    if frame_of_reference:
        assert ds.FrameOfReferenceUID == source.FrameOfReferenceUID
    assert ds.SeriesInstanceUID != source.SeriesInstanceUID
    assert ds.Manufacturer == "vit-ct" and (
        ds.BodyPartExamined == "HEAD" if body_part else "BodyPartExamined" not in ds
    )


def assert_valid(path):
    errors, warnings = dciodvfy_findings(path)
    assert errors == [], errors
    assert set(warnings) <= set(KNOWN_WARNINGS), warnings


def test_parametric_map_holds_the_maps_exactly_on_the_source_grid(series, tmp_path):
    sources, maps = series
    path = tmp_path / "pm.dcm"
    parametric_map(sources, maps, PROVENANCE, description="vit-ct rollout; P(lesion) 0.5").save_as(path)
    pm = pydicom.dcmread(path)
    assert pm.SOPClassUID == ParametricMapStorage
    assert pm.pixel_array.dtype == np.float32 and pm.pixel_array.shape == maps.shape
    by_uid = {s.SOPInstanceUID: (s, m) for s, m in zip(sources, maps, strict=True)}
    assert sorted(frame_sources(pm)) == sorted(by_uid)
    for frame, uid, group in zip(pm.pixel_array, frame_sources(pm), pm.PerFrameFunctionalGroupsSequence, strict=True):
        source, expected = by_uid[uid]
        np.testing.assert_array_equal(frame, expected)  # float32 stored as it is: exact
        assert [float(v) for v in group.PlanePositionSequence[0].ImagePositionPatient] == pytest.approx(
            [float(v) for v in source.ImagePositionPatient]
        )
    shared = pm.SharedFunctionalGroupsSequence[0]
    assert [float(v) for v in shared.PixelMeasuresSequence[0].PixelSpacing] == [
        float(v) for v in sources[0].PixelSpacing
    ]
    mapping = shared.RealWorldValueMappingSequence[0]
    assert (mapping.RealWorldValueSlope, mapping.RealWorldValueIntercept, mapping.LUTLabel) == (1.0, 0.0, "rollout")
    assert mapping.MeasurementUnitsCodeSequence[0].CodeValue == "1"  # UCUM: no unit
    assert pm.SeriesDescription == "vit-ct rollout; P(lesion) 0.5"
    assert_in_source_study(pm, sources[0])
    assert_valid(path)


def test_segmentation_is_the_region_pixel_for_pixel_and_names_the_algorithm(series, tmp_path):
    sources, maps = series
    region = maps > 0.01
    path = tmp_path / "seg.dcm"
    segmentation(sources, region, PROVENANCE, description="vit-ct half-max").save_as(path)
    seg = hd.seg.segread(path)
    assert seg.SegmentationType == "BINARY" and len(seg.SegmentSequence) == 1
    uids = [s.SOPInstanceUID for s in sources]
    assert sorted(frame_sources(seg)) == sorted(uids)  # every slice has its frame, the empty one too
    pixels = seg.get_pixels_by_source_instance(source_sop_instance_uids=uids, segment_numbers=[1])[..., 0]
    np.testing.assert_array_equal(pixels.astype(bool), region)
    assert not pixels[2].any()
    algorithm = seg.SegmentSequence[0].SegmentationAlgorithmIdentificationSequence[0]
    assert algorithm.AlgorithmName == "vit-ct" and algorithm.AlgorithmFamilyCodeSequence[0].CodeMeaning == (
        "Artificial Intelligence"
    )
    assert "vit_tiny_patch16_224" in algorithm.AlgorithmParameters
    assert "attention rollout (head fusion mean)" in algorithm.AlgorithmParameters
    assert_in_source_study(seg, sources[0])
    assert_valid(path)


def test_secondary_captures_are_burned_in_pictures_of_their_slices(series, tmp_path):
    sources, maps = series
    hu = [s.pixel_array * float(s.RescaleSlope) + float(s.RescaleIntercept) for s in sources]
    caption = ["P(lesion) 0.5", NOT_FOR_DIAGNOSIS]
    pictures = [add_caption(render_overlay(h, m), caption) for h, m in zip(hu, maps, strict=True)]
    images = secondary_captures(sources, pictures, PROVENANCE, description="vit-ct overlays")
    assert len({i.SeriesInstanceUID for i in images}) == 1 and len({i.SOPInstanceUID for i in images}) == 4
    for k, (image, source, picture) in enumerate(zip(images, sources, pictures, strict=True)):
        path = tmp_path / f"sc{k}.dcm"
        image.save_as(path)
        sc = pydicom.dcmread(path)
        assert sc.PhotometricInterpretation == "RGB" and sc.BurnedInAnnotation == "YES"
        np.testing.assert_array_equal(sc.pixel_array, picture)
        assert sc.SourceImageSequence[0].ReferencedSOPInstanceUID == source.SOPInstanceUID
        assert tuple(sc.PatientOrientation) == ("L", "P")  # axial, as the synthetic slices lie
        assert sc.InstanceNumber == k + 1
        assert_in_source_study(sc, source, frame_of_reference=False)
        assert_valid(path)


def test_caption_keeps_the_overlay_and_burns_the_text_in_below():
    rgb = np.random.default_rng(1).integers(0, 255, (64, 48, 3), dtype=np.uint8)
    captioned = add_caption(rgb, ["P(lesion) 0.873", NOT_FOR_DIAGNOSIS])
    scale = -(-384 // 48)
    assert captioned.shape[1] == 48 * scale and captioned.shape[0] > 64 * scale
    np.testing.assert_array_equal(captioned[: 64 * scale], rgb.repeat(scale, axis=0).repeat(scale, axis=1))
    band = captioned[64 * scale :]
    white = (band == 255).all(axis=-1)
    assert 0 < white.mean() < 0.5 and (band == 0).all(axis=-1).mean() > 0.5  # white text on a black band
    Image.fromarray(captioned)  # a valid RGB picture


def test_uids_are_stable_for_the_same_sources_and_model_and_differ_for_another_model(series):
    sources, maps = series
    first = parametric_map(sources, maps, PROVENANCE, description="a")
    again = parametric_map(sources, maps, PROVENANCE, description="a")
    other = parametric_map(sources, maps, replace(PROVENANCE, model_id="cd" * 32), description="a")
    assert (first.SeriesInstanceUID, first.SOPInstanceUID) == (again.SeriesInstanceUID, again.SOPInstanceUID)
    assert first.SeriesInstanceUID != other.SeriesInstanceUID and first.SOPInstanceUID != other.SOPInstanceUID
    seg = segmentation(sources, maps > 0, PROVENANCE, description="a")
    assert seg.SeriesInstanceUID != first.SeriesInstanceUID  # each kind its own series


def test_patient_orientation_follows_the_slice_orientation(series):
    source = copy.deepcopy(series[0][0])  # Dataset.copy() is shallow: it would turn the module's series sagittal
    source.ImageOrientationPatient = [0, 1, 0, 0, 0, -1]  # sagittal: rows run posterior, columns down to the feet
    assert patient_orientation(source) == ("P", "F")


def test_structured_report_says_the_finding_and_references_its_evidence(series, tmp_path):
    """TID 1500 read back with highdicom: per finding its probability, the threshold, Present / Absent as the
    threshold decides and the slice it was read from; the SEG's segment and the Parametric Map by UID; valid."""
    sources, maps = series
    pm = parametric_map(sources, maps, PROVENANCE, description="pm")
    seg = segmentation(sources, maps > 0.01, PROVENANCE, description="seg")
    findings = [Finding(finding_code(None), 0.81, 1), Finding(finding_code("subdural"), 0.3, 3)]
    path = tmp_path / "sr.dcm"
    structured_report(sources, findings, 0.5, pm, seg, PROVENANCE, description="vit-ct finding").save_as(path)
    assert_valid(path)
    sr = hd.sr.srread(path)
    assert_in_source_study(sr, sources[0], frame_of_reference=False, body_part=False)  # an SR has none
    assert sr.SeriesDescription == "vit-ct finding" and sr.VerificationFlag == "UNVERIFIED"
    assert sr.CodingSchemeIdentificationSequence[0].CodingSchemeDesignator == PRIVATE_SCHEME
    evidence = {item.ReferencedSOPInstanceUID for study in sr.CurrentRequestedProcedureEvidenceSequence
                for series in study.ReferencedSeriesSequence for item in series.ReferencedSOPSequence}  # fmt: skip
    assert evidence == {pm.SOPInstanceUID, seg.SOPInstanceUID, *(s.SOPInstanceUID for s in sources)}
    (observer,) = sr.content.get_observer_contexts()
    assert observer.observer_type == codes.DCM.Device and observer.observer_identifying_attributes.name == "vit-ct"

    groups = sr.content.get_image_measurement_groups()
    assert [g.finding_type.value for g in groups] == ["1386000", "subdural"]
    assert groups[0].finding_type.scheme_designator == "SCT"
    for group, finding, present in zip(groups, findings, ("52101004", "272519000"), strict=True):
        (probability,) = group.get_measurements(name=codes.DCM.Probability)
        (threshold,) = group.get_measurements(name=codes.DCM.ThresholdValue)
        assert (probability.value, threshold.value) == (pytest.approx(finding.probability), 0.5)
        (evaluation,) = group.get_qualitative_evaluations(name=codes.DCM.PresenceOfProperty)
        assert evaluation.value.value == present  # SNOMED CT Present at 0.81 >= 0.5, Absent at 0.3
        (source,) = group.source_images
        assert source.referenced_sop_instance_uid == sources[finding.peak].SOPInstanceUID

    (region,) = sr.content.get_volumetric_roi_measurement_groups()
    segment = region.referenced_segment
    assert (segment.referenced_sop_instance_uid, segment.referenced_segment_numbers) == (seg.SOPInstanceUID, [1])
    assert region.tracking_uid == seg.SegmentSequence[0].TrackingUID  # the same region as the SEG names it
    (peak,) = region.get_measurements(name=codes.DCM.Saliency)
    image = peak.referenced_images[0]
    assert (image.referenced_sop_class_uid, image.referenced_sop_instance_uid) == (ParametricMapStorage,
                                                                                    pm.SOPInstanceUID)  # fmt: skip
    (frame,) = image.referenced_frame_numbers
    assert peak.value == pytest.approx(float(pm.pixel_array[frame - 1].max())) and peak.value == pytest.approx(
        float(maps.max())
    )
