"""``vit-ct predict --dicom_out true``: per scan of a predict output read from one DICOM series, the objects of
:mod:`vit_ct.predict.dicom_objects` in the scan's study, written under ``OUT/dicom/<scan>/`` (``pm.dcm``,
``seg.dcm``, ``sc/<k>.dcm``, ``sr.dcm``) and listed in ``OUT/dicom/objects.csv``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pydicom
import torch
from lightning.pytorch.callbacks import Callback

from vit_ct.data.io.reader import load_ct_slice
from vit_ct.data.transforms.model_input import HEAD_HU
from vit_ct.data.transforms.windows import DISPLAY_WINDOW
from vit_ct.explain.map_reading import MapReading
from vit_ct.explain.overlay import add_caption, render_overlay
from vit_ct.explain.segmentation import half_max_region
from vit_ct.files import atomic_write, inside, safe_name
from vit_ct.metrics.lesion_probability import ANY, has_in_scan_columns, lesion_probability
from vit_ct.metrics.schema import PREDICTIONS, RUN_JSON, SCANS
from vit_ct.predict.dicom_objects import (
    NOT_FOR_DIAGNOSIS,
    Finding,
    Provenance,
    finding_code,
    parametric_map,
    secondary_captures,
    segmentation,
    structured_report,
)
from vit_ct.predict.scan_writer import group_scan
from vit_ct.task.reading import reading_of

DICOM_FOLDER = "dicom"
OBJECTS_CSV = "objects.csv"  # in OUT/dicom/: scan, kind, file, series and SOP instance UIDs; reason where not written
KINDS = ("pm", "seg", "sc", "sr")  # Parametric Map, SEG, Secondary Captures, Structured Report
THRESHOLD = 0.5  # --decision_threshold's default: the probability at or above which the SR calls a finding present
PERSON_NAME_ADVICE = r'The string ".*" is unlikely to represent the intended person name'  # highdicom's warning


def model_provenance(pl_module, reading: MapReading) -> Provenance:
    """The model as the objects name it: its timm architecture, and as identity the SHA-256 of its weights and of
    how its maps are computed (``reading``: the same weights and settings give the same UIDs on every machine)."""
    h = pl_module.hparams
    method = f"attention rollout (head fusion {h.rollout_head_fusion}, discard ratio {h.rollout_discard_ratio})"
    if reading.pixels:
        method += ", spread over pixels by gradient x input"
    digest = hashlib.sha256(method.encode())
    for name, tensor in sorted(pl_module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    version = importlib.metadata.version("vit-ct")  # the installed package's (vit_ct/__init__.py is above this room)
    return Provenance(model_name=str(h.arch), model_id=digest.hexdigest(), map_method=method, version=version)


def _save(dataset, path: Path) -> Path:
    with atomic_write(path) as tmp:
        dataset.save_as(tmp, enforce_file_format=True)
    return path


def write_dicom_objects(
    output_dir: str | Path,
    provenance: Provenance,
    *,
    window=DISPLAY_WINDOW,
    shown_as: str | Path | None = None,
    threshold: float = THRESHOLD,
) -> list[Path]:
    """Write the DICOM objects of every scan of a predict output ``OUT`` that is one DICOM series of single-frame
    slices; other scans (NIfTI, ``.npy``, mixed series, enhanced multi-frame files) are listed as skipped.

    Per scan, under ``OUT/dicom/<scan>/``: ``pm.dcm``, the rollout as a float32 Parametric Map on the source grid;
    ``seg.dcm``, a BINARY SEG of each slice's half-maximum region over the head (as the Dice score reads it:
    :func:`vit_ct.explain.segmentation.half_max_region`); ``sc/<k>.dcm``, an RGB Secondary Capture of slice ``k``'s
    overlay with P(lesion) and "NOT FOR DIAGNOSIS" burned in; ``sr.dcm``, a Structured Report (TID 1500) of the scan's
    finding: intracranial haemorrhage with the scan's P(lesion), ``threshold`` and the decision (present at or above
    it), one more finding per subtype of a multi-class or multi-label model (its output's name, the scan's highest
    probability of it), each with the slice it peaks on, and the SEG's segment and the Parametric Map by UID. The
    scan's P(lesion) and its peak slice's InstanceNumber are in each series' SeriesDescription.

    Args:
        output_dir: ``OUT`` of ``vit-ct predict`` (``predictions.csv``, ``scans.csv``, ``run.json``, ``maps/``).
        provenance: The model and map method (:func:`model_provenance`).
        window: (centre, width) HU of the Secondary Captures' grey image.
        shown_as: ``OUT`` as messages name it (predict writes into a staging folder that becomes ``OUT``).
        threshold: The probability at or above which the SR calls a finding present.

    A kind of object that cannot be made for a scan (highdicom refuses a Parametric Map and a SEG of sources without
    a FrameOfReferenceUID) is listed in ``objects.csv`` with its reason and said in one line; the scan's other
    objects, and every other scan's, are written all the same.

    Returns:
        The files written, also listed in ``OUT/dicom/objects.csv``.
    """
    out = Path(output_dir)
    shown = Path(shown_as) if shown_as is not None else out
    if not (out / SCANS.file).is_file():
        print(f"--dicom_out: {out} has no {SCANS.file} (its slices belong to no scan): no DICOM objects written")
        return []
    info = json.loads((out / RUN_JSON).read_text())
    base = Path(info["images_relative_to"]) if info.get("images_relative_to") else Path.cwd()
    read_options = (info.get("input") or {}).get("read_options") or {}
    predictions = pd.read_csv(out / PREDICTIONS.file, dtype={PREDICTIONS.scan: str})
    # a model with a sequence head reports each slice as it read it in its scan (prob_in_scan...), its final reading
    in_scan = has_in_scan_columns(predictions, info["task"], info["class_names"])
    predictions["p_lesion"] = lesion_probability(predictions, info["task"], info["class_names"], in_scan=in_scan)
    # resolved, as the scan lists them: an absolute path stays itself
    predictions["path"] = [str((base / p).resolve()) for p in predictions[PREDICTIONS.image]]
    written, listed, skipped, failed = [], [], [], []
    for scan_id, rows in predictions.groupby(PREDICTIONS.scan, sort=False):
        frames = rows[PREDICTIONS.slice] if PREDICTIONS.slice in rows else pd.Series([None])
        scan = group_scan(list(rows["path"])) if frames.isna().all() else None
        if scan is None or scan.kind != "dicom" or len(scan.images) != len(rows):
            skipped.append(scan_id)
            failed.append({"scan": scan_id, "kind": "all", "reason": "not one DICOM series of single-frame slices"})
            continue
        try:
            objects = scan_objects(out, scan, rows, provenance, window, read_options, findings_of(info, in_scan),
                                   threshold, in_scan=in_scan)  # fmt: skip
        except Exception as err:  # a scan whose sources cannot be read as needed: the others are written all the same
            objects = {kind: err for kind in KINDS}
        for kind, made in objects.items():
            if isinstance(made, Exception):
                failed.append({"scan": scan_id, "kind": kind, "reason": f"{type(made).__name__}: {made}"})
                continue
            folder = inside(out / DICOM_FOLDER, safe_name(scan_id))  # the scan id is the manifest's
            for k, dataset in enumerate(made):
                path = folder / (f"{kind}.dcm" if kind != "sc" else f"sc/{k:03d}.dcm")
                written.append(_save(dataset, path))
                listed.append({"scan": scan_id, "kind": kind, "file": path.relative_to(out).as_posix(),
                               "series_uid": dataset.SeriesInstanceUID, "sop_uid": dataset.SOPInstanceUID})  # fmt: skip
    if skipped:
        print(f"--dicom_out: {len(skipped)} scans are not one DICOM series of single-frame slices, no DICOM objects"
              f" for them: {', '.join(map(str, skipped[:5]))}{', ...' if len(skipped) > 5 else ''}")  # fmt: skip
    refused = [f for f in failed if f["kind"] != "all"]
    if refused:
        first = refused[0]
        print(f"--dicom_out: {len(refused)} object(s) of {len({f['scan'] for f in refused})} scan(s) could not be"
              f" written, each listed with its reason in {shown / DICOM_FOLDER / OBJECTS_CSV}; e.g. scan"
              f" {first['scan']} {first['kind']}: {first['reason']}")  # fmt: skip
    if listed or failed:
        columns = ["scan", "kind", "file", "series_uid", "sop_uid", "reason"]
        with atomic_write(out / DICOM_FOLDER / OBJECTS_CSV) as tmp:
            pd.DataFrame([*listed, *failed], columns=columns).to_csv(tmp, index=False)
    return written


def findings_of(info: dict, in_scan: bool = False) -> list[tuple[str | None, str]]:
    """What the SR of a predict output (``run.json``'s ``info``) reports, as (name, column of its predictions):
    intracranial haemorrhage from P(lesion) (name None), then each subtype a model has: a multi-label model's outputs
    but ``any``, a multi-class model's classes but the first (no lesion), from their probability columns (``in_scan``:
    those of the slices read in their scans)."""
    task, names = info["task"], list(info["class_names"])
    if task == "binary":
        return [(None, "p_lesion")]
    columns = dict(zip(names, PREDICTIONS.probs(task, names, in_scan=in_scan), strict=True))
    subtypes = [n for n in names if n != ANY] if task == "multilabel" else names[1:]
    return [(None, "p_lesion"), *((name, columns[name]) for name in subtypes)]


def scan_objects(out: Path, scan, rows: pd.DataFrame, provenance: Provenance, window, read_options: dict,
                 findings: list[tuple[str | None, str]] = ((None, "p_lesion"),), threshold: float = THRESHOLD, *,
                 in_scan: bool = False) -> dict[str, list | Exception]:  # fmt: skip
    """The objects of one scan by kind (``pm``, ``seg``, ``sc``, ``sr``): each kind's datasets, or the exception that
    kept it from being made (highdicom refuses, say, a Parametric Map of sources without a FrameOfReferenceUID, which
    a Secondary Capture does not need), so that one kind's failure keeps none of the others from being written (the
    SR, which references the Parametric Map and the SEG, needs both). The scan's P(lesion) is its slices' highest
    (``rows``' ``p_lesion``: read alone, or ``in_scan``, as the descriptions then say), as ``scans.csv`` takes it."""
    rows = rows.set_index("path").loc[[str(Path(p).resolve()) for p in scan.images]]  # scan order
    sources = [pydicom.dcmread(p, stop_before_pixels=True) for p in scan.images]
    maps = np.stack([np.load(out / r) for r in rows[PREDICTIONS.rollout]]).astype(np.float32)
    hu = np.stack([load_ct_slice(p, **read_options) for p in scan.images])
    region = half_max_region(torch.from_numpy(maps), torch.from_numpy(hu > HEAD_HU)).numpy()
    peak = int(np.argmax(rows["p_lesion"].to_numpy()))
    prob = float(rows["p_lesion"].iloc[peak])
    peak_image = sources[peak].get("InstanceNumber", peak + 1)
    text = f"P(lesion) {prob:.3f}{' in scan' if in_scan else ''}, peak image {peak_image}"
    makers = {
        "pm": lambda: [parametric_map(sources, maps, provenance, description=f"vit-ct rollout; {text}")],
        "seg": lambda: [segmentation(sources, region, provenance, description=f"vit-ct half-max; {text}")],
        "sc": lambda: secondary_captures(
            sources,
            [
                add_caption(
                    render_overlay(plane, heat, window=window),
                    [f"vit-ct P(lesion): slice {p:.3f}, scan {prob:.3f}", f"scan peak: image {peak_image}",
                     NOT_FOR_DIAGNOSIS],
                )
                for plane, heat, p in zip(hu, maps, rows["p_lesion"], strict=True)
            ],
            provenance,
            description=f"vit-ct overlays; {text}",
        ),
        "sr": lambda: [
            structured_report(
                sources,
                [Finding(finding_code(name), float(rows[column].max()), int(np.argmax(rows[column].to_numpy())))
                 for name, column in findings],
                threshold,
                *evidence_for_report(objects),
                provenance,
                description=f"vit-ct finding; {text}",
            )
        ],
    }  # fmt: skip
    objects: dict[str, list | Exception] = {}
    for kind, make in makers.items():
        try:
            with warnings.catch_warnings():
                # the patient's name is copied from the source as the scanner wrote it ("ANONYMOUS", no caret):
                # highdicom's advice on composing a name is for a name it is given, not one a user could change here
                warnings.filterwarnings("ignore", PERSON_NAME_ADVICE, UserWarning)
                objects[kind] = make()
        except Exception as err:  # highdicom's refusal of these sources, as it said it
            objects[kind] = err
    return objects


def evidence_for_report(objects: dict[str, list | Exception]) -> tuple:
    """The Parametric Map and the SEG made for a scan, which its SR references; raises where either was not made."""
    missing = {kind: made for kind, made in objects.items() if kind in ("pm", "seg") and isinstance(made, Exception)}
    if missing:
        raise ValueError(f"the SR references the Parametric Map and the SEG, and {' and '.join(missing)} could not be"
                         f" made ({next(iter(missing.values()))})")  # fmt: skip
    return objects["pm"][0], objects["seg"][0]


class DicomObjectsWriter(Callback):
    """After :class:`vit_ct.predict.scan_writer.ScanResultsWriter` has written ``scans.csv``: the DICOM objects of
    :func:`write_dicom_objects`, in the folder the run's ``PredictionWriter`` writes into. Rank 0 only.

    Args:
        writer: The run's ``PredictionWriter``.
        threshold: The probability at or above which the SR calls a finding present.
    """

    def __init__(self, writer, threshold: float = THRESHOLD) -> None:
        self.writer = writer
        self.threshold = threshold

    def on_predict_epoch_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            provenance = model_provenance(pl_module, reading_of(trainer))
            write_dicom_objects(self.writer.output_dir, provenance, window=self.writer.window,
                                shown_as=self.writer.destination, threshold=self.threshold)  # fmt: skip
