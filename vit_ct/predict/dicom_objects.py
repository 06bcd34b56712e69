"""DICOM objects of one scan's results in its source study (highdicom): a Parametric Map of the rollout, a SEG of the
map's half-maximum region, RGB Secondary Captures of the overlays, and a Structured Report (TID 1500) of the finding
that references the SEG and the Parametric Map. Each belongs to the source study and Frame of
Reference, copies its patient, references the source slices, and gets UIDs derived from the source SOPInstanceUIDs,
the model's identity and the object's kind, so that a rerun of the same input and model writes the same UIDs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import highdicom as hd
import numpy as np
from pydicom import Dataset
from pydicom.sr.codedict import codes
from pydicom.uid import ExplicitVRLittleEndian, generate_uid

MANUFACTURER = "vit-ct"
NOT_FOR_DIAGNOSIS = "NOT FOR DIAGNOSIS"
# Series numbers of the derived series, high so that they list after the scanner's own.
SERIES_NUMBERS = {"pm": 9001, "seg": 9002, "sc": 9003, "sr": 9004}
SEGMENT = 1  # the SEG's one segment: the map's half-maximum region
# A finding the model reports without a code of a standard scheme (a subtype named by the training set's labels) is
# coded in this private scheme (PS3.3 8.2: designators beginning "99"), named in the SR's Coding Scheme Identification.
PRIVATE_SCHEME = "99VITCT"


@dataclass(frozen=True)
class Provenance:
    """What made the objects, as they name it (AlgorithmIdentification, equipment) and as their UIDs derive from it.

    Args:
        model_name: The network, e.g. the timm architecture.
        model_id: Identity of the model and map method (a hash of the weights and the map's settings): a different
            model gives different UIDs.
        map_method: How the map was computed, e.g. ``attention rollout (head fusion mean, discard 0)``.
        version: vit-ct's version.
    """

    model_name: str
    model_id: str
    map_method: str
    version: str


@dataclass(frozen=True)
class Finding:
    """One finding of a scan's Structured Report: what the model looked for, and the scan's probability of it.

    Args:
        concept: The finding, a code (e.g. SNOMED CT 1386000 "Intracranial hemorrhage"; see :func:`finding_code`).
        probability: The scan's probability of it (its most suspicious slice's).
        peak: Index, in scan order, of the slice where that probability peaks.
    """

    concept: hd.sr.CodedConcept
    probability: float
    peak: int


def finding_code(name: str | None) -> hd.sr.CodedConcept:
    """The code of a finding: intracranial haemorrhage itself (SNOMED CT) for ``None`` (the model's P(lesion)), else
    the output ``name`` in the private scheme :data:`PRIVATE_SCHEME` (a subtype as the training labels name it)."""
    if name is None:
        return hd.sr.CodedConcept.from_code(codes.SCT.IntracranialHemorrhage)
    return hd.sr.CodedConcept(value=name[:16], scheme_designator=PRIVATE_SCHEME, meaning=f"{name} (vit-ct output)"[:64])


def derived_uid(sources: Sequence[Dataset], provenance: Provenance, kind: str, *parts) -> str:
    """A UID that depends only on the source slices, the model and the object (``kind``, ``parts``)."""
    entropy = ["vit-ct", provenance.model_id, kind, *(str(s.SOPInstanceUID) for s in sources), *map(str, parts)]
    return generate_uid(entropy_srcs=entropy)


def _identity(sources: Sequence[Dataset], provenance: Provenance, kind: str) -> dict:
    """The series and instance of a one-instance object of ``kind`` (``pm``, ``seg``, ``sr``): derived UIDs, its
    series number, instance 1."""
    return {
        "series_instance_uid": derived_uid(sources, provenance, f"{kind} series"),
        "series_number": SERIES_NUMBERS[kind],
        "sop_instance_uid": derived_uid(sources, provenance, f"{kind} instance"),
        "instance_number": 1,
    }


def _equipment(provenance: Provenance) -> dict:
    """The General Equipment of every object: vit-ct, the model, the first 16 hex digits of its identity."""
    return {
        "manufacturer": MANUFACTURER,
        "manufacturer_model_name": provenance.model_name[:64],
        "software_versions": provenance.version,
        "device_serial_number": provenance.model_id[:16],
    }


def copy_body_part(obj: Dataset, sources: Sequence[Dataset]) -> Dataset:
    """``obj`` with the sources' BodyPartExamined: it tells a validator that the part is unpaired (no Laterality)."""
    if "BodyPartExamined" in sources[0]:
        obj.BodyPartExamined = sources[0].BodyPartExamined
    return obj


def algorithm(provenance: Provenance) -> hd.AlgorithmIdentificationSequence:
    """The SEG's AlgorithmIdentification: vit-ct (an AI algorithm), its model and map method as parameters."""
    return hd.AlgorithmIdentificationSequence(
        name=MANUFACTURER,
        family=codes.cid7162.ArtificialIntelligence,
        version=provenance.version,
        parameters={"model": provenance.model_name, "map": provenance.map_method, "model id": provenance.model_id[:16]},
    )


def parametric_map(
    sources: Sequence[Dataset], maps: np.ndarray, provenance: Provenance, *, description: str
) -> hd.pm.ParametricMap:
    """A float32 Parametric Map of the rollout on the source slices' grid, one frame per source slice, each
    referencing its slice (highdicom orders the frames by position).

    Args:
        sources: The source CT slices, in the order of ``maps``' first axis.
        maps: ``(n, rows, columns)`` float32, as the ``.npy`` maps hold them (stored as they are: no rescaling, so a
            reader gets the written values back exactly).
        provenance: The model and map method.
        description: SeriesDescription (64 characters at most).
    """
    maps = np.ascontiguousarray(maps, dtype=np.float32)
    top = float(maps.max())
    mapping = hd.pm.RealWorldValueMapping(  # identity: the stored float is the rollout value, without unit
        lut_label="rollout",
        lut_explanation="rollout: share of the class token's attention (no unit)",
        unit=codes.UCUM.NoUnits,
        value_range=(float(maps.min()), top),
        slope=1.0,
        intercept=0.0,
        quantity_definition=codes.DCM.Saliency,
    )
    # rollout values are far below 1, where a LINEAR window may not be narrower than 1: LINEAR_EXACT may
    window = hd.VOILUTTransformation(
        window_center=top / 2, window_width=top if top > 0 else 1.0, voi_lut_function="LINEAR_EXACT"
    )
    pm = hd.pm.ParametricMap(
        source_images=list(sources),
        pixel_array=maps,
        **_identity(sources, provenance, "pm"),
        contains_recognizable_visual_features=False,
        real_world_value_mappings=[mapping],
        voi_lut_transformations=[window],
        content_label="ROLLOUT",
        content_description=provenance.map_method[:64],
        series_description=description[:64],
        **_equipment(provenance),
    )
    return copy_body_part(pm, sources)


def segmentation(
    sources: Sequence[Dataset], region: np.ndarray, provenance: Provenance, *, description: str
) -> hd.seg.Segmentation:
    """A BINARY SEG with one segment, the map's half-maximum region, one frame per source slice, each referencing its
    slice (empty frames kept: every slice has its frame; highdicom orders the frames by position).

    Args:
        sources: The source CT slices, in the order of ``region``'s first axis.
        region: ``(n, rows, columns)`` bool.
        provenance: The model and map method, named in the segment's AlgorithmIdentification.
        description: SeriesDescription (64 characters at most).
    """
    segment = hd.seg.SegmentDescription(
        segment_number=1,
        segment_label="rollout half-maximum",
        segmented_property_category=codes.SCT.SpatialAndRelationalConcept,
        segmented_property_type=codes.DCM.Saliency,
        algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
        algorithm_identification=algorithm(provenance),
        tracking_uid=derived_uid(sources, provenance, "seg tracking"),
        tracking_id="vit-ct rollout half-maximum",
    )
    seg = hd.seg.Segmentation(
        source_images=list(sources),
        pixel_array=np.asarray(region, dtype=bool).astype(np.uint8),
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=[segment],
        **_identity(sources, provenance, "seg"),
        omit_empty_frames=False,
        content_label="HALFMAX",
        content_description="pixels where the map reaches half its maximum over the head",
        series_description=description[:64],
        **_equipment(provenance),
    )
    return copy_body_part(seg, sources)


def patient_orientation(source: Dataset) -> tuple[str, str]:
    """PatientOrientation of a picture of ``source``: the patient direction along its rows and down its columns, the
    dominant axis of each ImageOrientationPatient vector (LPS: +x left, +y posterior, +z head)."""
    letters = (("R", "L"), ("A", "P"), ("F", "H"))
    vectors = np.asarray(source.ImageOrientationPatient, dtype=float).reshape(2, 3)
    return tuple(letters[int(np.argmax(np.abs(v)))][int(v[np.argmax(np.abs(v))] > 0)] for v in vectors)


def secondary_captures(
    sources: Sequence[Dataset], pictures: Sequence[np.ndarray], provenance: Provenance, *, description: str
) -> list[hd.sc.SCImage]:
    """RGB Secondary Capture images, one per source slice, in one series, each with BurnedInAnnotation YES (the
    pictures carry P(lesion) and the "not for diagnosis" notice) and referencing its source slice.

    Args:
        sources: The source CT slices, one per picture.
        pictures: ``(rows, columns, 3)`` uint8 each, any size (a captioned overlay is not on the slice's grid).
        provenance: The model and map method.
        description: SeriesDescription (64 characters at most).
    """
    series_uid = derived_uid(sources, provenance, "sc series")
    images = []
    for k, (source, picture) in enumerate(zip(sources, pictures, strict=True)):
        image = hd.sc.SCImage.from_ref_dataset(
            ref_dataset=source,
            pixel_array=np.ascontiguousarray(picture, dtype=np.uint8),
            photometric_interpretation=hd.PhotometricInterpretationValues.RGB,
            bits_allocated=8,
            coordinate_system=hd.CoordinateSystemNames.PATIENT,
            patient_orientation=patient_orientation(source),  # the picture keeps the slice's orientation
            series_instance_uid=series_uid,
            series_number=SERIES_NUMBERS["sc"],
            sop_instance_uid=derived_uid(sources, provenance, "sc instance", k),
            instance_number=k + 1,
            manufacturer=MANUFACTURER,
            transfer_syntax_uid=ExplicitVRLittleEndian,
            series_description=description[:64],
        )
        image.BurnedInAnnotation = "YES"
        image.Modality = "OT"  # the modality SC images of derived pictures carry
        image.ImageComments = NOT_FOR_DIAGNOSIS
        image.DerivationDescription = f"{provenance.map_method} over the windowed CT"[:1024]
        reference = Dataset()
        reference.ReferencedSOPClassUID = source.SOPClassUID
        reference.ReferencedSOPInstanceUID = source.SOPInstanceUID
        image.SourceImageSequence = [reference]
        images.append(copy_body_part(image, sources))
    return images


def structured_report(
    sources: Sequence[Dataset],
    findings: Sequence[Finding],
    threshold: float,
    pm: Dataset,
    seg: Dataset,
    provenance: Provenance,
    *,
    description: str,
) -> hd.sr.Comprehensive3DSR:
    """A Comprehensive 3D SR holding a TID 1500 Measurement Report of one scan: per finding a measurement group
    (TID 1501) with the scan's probability, the threshold, the decision (presence of the finding: Present when the
    probability is at or above the threshold, else Absent) and the slice the probability was read from; and a
    volumetric group (TID 1411) of the map's half-maximum region that references the SEG's segment and, as the
    image its peak was read on, the Parametric Map. Observer: vit-ct as a device; verification flag UNVERIFIED (no
    person has read it).

    Args:
        sources: The source CT slices, in scan order (the order of :attr:`Finding.peak`).
        findings: The scan's findings: intracranial haemorrhage first, then any subtypes.
        threshold: The probability at or above which a finding is called present.
        pm: The scan's Parametric Map (:func:`parametric_map`), read back or as made.
        seg: The scan's SEG (:func:`segmentation`).
        provenance: The model and map method.
        description: SeriesDescription (64 characters at most).
    """
    no_units = codes.UCUM.NoUnits
    algorithm_id = hd.sr.AlgorithmIdentification(
        name=MANUFACTURER,
        version=provenance.version,
        parameters=[f"model {provenance.model_name}", f"model id {provenance.model_id[:16]}"],
    )
    groups = []
    for finding in findings:
        present = finding.probability >= threshold
        groups.append(
            hd.sr.MeasurementsAndQualitativeEvaluations(
                tracking_identifier=hd.sr.TrackingIdentifier(
                    uid=derived_uid(sources, provenance, "sr finding", finding.concept.value),
                    identifier=f"vit-ct {finding.concept.meaning}"[:64],
                ),
                finding_type=finding.concept,
                algorithm_id=algorithm_id,
                measurements=[
                    hd.sr.Measurement(name=codes.DCM.Probability, value=finding.probability, unit=no_units),
                    hd.sr.Measurement(name=codes.DCM.ThresholdValue, value=threshold, unit=no_units),
                ],
                qualitative_evaluations=[
                    hd.sr.QualitativeEvaluation(
                        name=codes.DCM.PresenceOfProperty, value=codes.SCT.Present if present else codes.SCT.Absent
                    )
                ],
                source_images=[hd.sr.SourceImageForMeasurementGroup.from_source_image(sources[finding.peak])],
            )
        )
    frames = [g.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID
              for g in pm.PerFrameFunctionalGroupsSequence]  # fmt: skip
    maps = pm.pixel_array.reshape(len(frames), -1)
    peak_frame = int(np.argmax(maps.max(axis=1)))
    tracking = seg.SegmentSequence[SEGMENT - 1]
    groups.append(
        hd.sr.VolumetricROIMeasurementsAndQualitativeEvaluations(
            tracking_identifier=hd.sr.TrackingIdentifier(
                uid=tracking.TrackingUID, identifier=tracking.TrackingID
            ),  # the SEG segment's own
            referenced_segment=hd.sr.ReferencedSegment(
                sop_class_uid=seg.SOPClassUID,
                sop_instance_uid=seg.SOPInstanceUID,
                segment_number=SEGMENT,
                source_series=hd.sr.SourceSeriesForSegmentation(sources[0].SeriesInstanceUID),
            ),
            finding_type=codes.DCM.Saliency,
            algorithm_id=algorithm_id,
            measurements=[
                hd.sr.Measurement(
                    name=codes.DCM.Saliency,
                    value=float(maps[peak_frame].max()),
                    unit=no_units,
                    derivation=codes.SCT.Maximum,
                    referenced_images=[
                        hd.sr.SourceImageForMeasurement(pm.SOPClassUID, pm.SOPInstanceUID, [peak_frame + 1])
                    ],
                )
            ],
        )
    )
    observer = hd.sr.ObserverContext(
        observer_type=codes.DCM.Device,
        observer_identifying_attributes=hd.sr.DeviceObserverIdentifyingAttributes(
            uid=derived_uid(sources, provenance, "sr device"),
            name=MANUFACTURER,
            manufacturer_name=MANUFACTURER,
            model_name=provenance.model_name[:64],
            serial_number=provenance.model_id[:16],
        ),
    )
    report = hd.sr.MeasurementReport(
        observation_context=hd.sr.ObservationContext(observer_device_context=observer),
        procedure_reported=codes.SCT.ComputedTomographyOfHead,
        imaging_measurements=groups,
    )
    private = [f for f in findings if f.concept.scheme_designator == PRIVATE_SCHEME]
    schemes = [
        hd.coding_schemes.CodingSchemeIdentificationItem(
            designator=PRIVATE_SCHEME, name="vit-ct outputs", responsible_organization=MANUFACTURER
        )
    ]
    sr = hd.sr.Comprehensive3DSR(
        evidence=[*sources, pm, seg],
        content=report,
        **_identity(sources, provenance, "sr"),
        manufacturer=MANUFACTURER,
        is_complete=True,
        series_description=description[:64],
        coding_schemes=schemes if private else None,
        **{k: v for k, v in _equipment(provenance).items() if k != "manufacturer"},
    )
    return sr  # (an SR has no Body Part Examined)
