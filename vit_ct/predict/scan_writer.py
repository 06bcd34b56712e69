"""Per-scan results of ``vit-ct predict``: ``scans.csv`` (slice probabilities, the scan's probability as the maximum
over its slices, the slice where it peaks: :mod:`vit_ct.metrics.lesion_probability`) and, per scan, the rollout volume
and the CT as NIfTI on the scan's own grid and affine, so that a viewer (3D Slicer, ITK-SNAP) overlays them without
registration.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
from lightning.pytorch.callbacks import Callback

from vit_ct.data.io.reader import from_display, load_ct_slice
from vit_ct.data.io.scans import Scan, find_scans, nifti_scan
from vit_ct.data.manifests.labels import lesion_labels
from vit_ct.data.manifests.manifest import frame_number
from vit_ct.data.transforms.windows import AIR_HU
from vit_ct.explain.volume_views import render_orthogonal_views
from vit_ct.files import atomic_write, inside, safe_name
from vit_ct.metrics.lesion_probability import has_in_scan_columns, lesion_probability, scan_column, scan_summary
from vit_ct.metrics.schema import PREDICTIONS, SCANS

# ------------------------------------------------------------------------------------------------------- NIfTI


def save_nifti(volume: np.ndarray, affine: np.ndarray, path: Path) -> None:
    """Write ``.nii.gz`` atomically, with the affine as sform and qform (scanner coordinates, mm)."""
    img = nib.Nifti1Image(volume, affine)
    img.set_sform(affine, code=1)
    img.set_qform(affine, code=1)
    img.header.set_xyzt_units("mm")
    with atomic_write(path) as tmp:
        tmp.write_bytes(gzip.compress(img.to_bytes(), compresslevel=6))


def _slice_plane(scan: Scan, plane: np.ndarray) -> np.ndarray:
    """A (rows, columns) plane as `load_ct_slice` shows it, on the volume's voxel axes 0 and 1."""
    return from_display(plane, scan.affine) if scan.kind == "nifti" else plane


def scan_volumes(
    scan: Scan, maps: dict[int, np.ndarray], read_options: dict | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The CT (HU) and rollout volumes of a scan; slice ``k`` of the rollout is ``maps[k]`` (zero where the slice
    was not predicted, air in the CT). ``read_options``: of :func:`load_ct_slice`, as the prediction read the slices."""
    rows, cols = nib.load(scan.source).shape[:2] if scan.kind == "nifti" else scan.shape  # the voxel grid
    ct = np.full((rows, cols, len(scan.images)), AIR_HU, dtype=np.float32)
    rollout = np.zeros((rows, cols, len(scan.images)), dtype=np.float32)
    for k, (image, frame) in enumerate(zip(scan.images, scan.frames, strict=True)):
        if k in maps:
            ct[:, :, k] = _slice_plane(scan, load_ct_slice(image, frame, **(read_options or {})))
            rollout[:, :, k] = _slice_plane(scan, maps[k])
    if np.array_equal(ct, np.round(ct)) and ct.min() >= -32768 and ct.max() <= 32767:
        ct = ct.astype(np.int16)  # whole HU, as the scanner stores them: half the size
    return ct, rollout


def group_scan(images: list[str]) -> Scan | None:
    """The scan geometry of a manifest's group of slices: their DICOM series or NIfTI volume, when they form exactly
    one; None otherwise (no volume is written for it)."""
    if len(set(images)) == 1 and images[0].lower().endswith((".nii", ".nii.gz")):
        return nifti_scan(images[0])
    try:
        scans, _ = find_scans(sorted(set(images)))
    except ValueError:
        return None
    return scans[0] if len(scans) == 1 else None


def prediction_labels(predictions: pd.DataFrame, pl_module) -> pd.Series:
    """Each row's lesion label (:func:`vit_ct.data.manifests.labels.lesion_labels`) from ``predictions.csv``'s ``label``
    or, multi-label, ``label_<name>`` columns (written where known); <NA> where unknown."""
    if pl_module.task != "multilabel":
        return lesion_labels(predictions)
    columns = PREDICTIONS.labels(pl_module.class_names)
    return lesion_labels(predictions.reindex(columns=columns), columns)


def add_in_scan(scans: pd.DataFrame, slices: pd.DataFrame, in_scan: pd.Series, key: str) -> pd.DataFrame:
    """``scans`` (:func:`scan_summary` of ``slices``) with the scan's P(lesion) in scan after ``prob`` and its slices'
    after ``slice_probs`` (:class:`~vit_ct.metrics.schema.ScanColumns`), from each slice's ``in_scan`` P(lesion)."""
    read = scan_summary(slices.assign(**{SCANS.p_lesion: in_scan.to_numpy()}), key).set_index(SCANS.scan)
    scans = scans.copy()
    for after, column, source in ((SCANS.prob, SCANS.prob_in_scan, SCANS.prob),
                                  (SCANS.slice_probs, SCANS.slice_probs_in_scan, SCANS.slice_probs)):  # fmt: skip
        scans.insert(scans.columns.get_loc(after) + 1, column, scans[SCANS.scan].map(read[source]).to_numpy())
    return scans


class ScanResultsWriter(Callback):
    """After :class:`vit_ct.predict.writer.PredictionWriter` has written ``predictions.csv``: ``scans.csv`` and, per
    scan with a known geometry, ``scans/<scan>_ct.nii.gz``, ``scans/<scan>_rollout.nii.gz`` and a three-view PNG
    ``scans/<scan>_views.png``; files ``data.scans`` left out go to ``skipped.csv``. Rank 0 only.

    Args:
        writer: The run's ``PredictionWriter``; the scan results go into the folder it writes into (so that they
            land in ``OUT`` together with ``predictions.csv``, however that writer stages its files).
        views: Also render the three orthogonal views of each scan's map over its CT.
    """

    def __init__(self, writer, *, views: bool = True) -> None:
        self.writer = writer
        self.views = views

    @property
    def output_dir(self) -> Path:
        return Path(self.writer.output_dir)

    def on_predict_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        datamodule = trainer.datamodule
        table = trainer.predict_dataloaders.dataset.table
        skipped = getattr(datamodule, "skipped_objects", [])
        if skipped:
            with atomic_write(self.output_dir / "skipped.csv") as tmp:
                pd.DataFrame([vars(s) for s in skipped], columns=["path", "reason"]).to_csv(tmp, index=False)
        key = scan_column(table)
        if key is None:
            return
        predictions = pd.read_csv(self.output_dir / PREDICTIONS.file)
        # predictions.csv lists the dataset's rows in order, one each
        if len(predictions) != len(table) or list(predictions[PREDICTIONS.image]) != list(table["image_ref"]):
            raise RuntimeError("predictions.csv does not list the predicted slices in order")
        slices = pd.DataFrame(
            {
                key: table[key].to_numpy(),
                PREDICTIONS.image: table["image_ref"].to_numpy(),
                "path": table["image"].to_numpy(),
                "frame": table["slice"].to_numpy() if "slice" in table.columns else None,
                PREDICTIONS.rollout: predictions[PREDICTIONS.rollout].to_numpy(),
                SCANS.p_lesion: lesion_probability(predictions, pl_module.task, pl_module.class_names).to_numpy(),
                SCANS.positive: prediction_labels(predictions, pl_module).to_numpy(),
            }
        )
        known = {s.scan_id: s for s in getattr(datamodule, "found_scans", [])} if key == "scan" else {}
        geometry = {}
        for scan_id, group in slices.groupby(key, sort=False):
            scan = known.get(scan_id) or group_scan(list(group["path"]))
            order = [None]
            if scan is not None:  # each slice's index along the scan
                where = {(p, frame_number(f)): k for k, (p, f) in enumerate(zip(scan.images, scan.frames, strict=True))}
                order = [where.get((p, frame_number(f))) for p, f in zip(group["path"], group["frame"], strict=True)]
            if None in order:
                slices.loc[group.index, SCANS.order] = range(len(group))  # manifest order; no volume
                continue
            slices.loc[group.index, SCANS.order] = order
            geometry[scan_id] = scan
        scans = scan_summary(slices, key)
        if has_in_scan_columns(predictions, pl_module.task, pl_module.class_names):
            scans = add_in_scan(scans, slices, lesion_probability(predictions, pl_module.task, pl_module.class_names,
                                                                  in_scan=True), key)  # fmt: skip
        scans[SCANS.ct], scans[SCANS.rollout], scans[SCANS.views] = None, None, None
        for i, row in scans.iterrows():
            scan = geometry.get(row[SCANS.scan])
            if scan is None:
                continue
            group = slices[slices[key] == row[SCANS.scan]]
            files = zip(group[SCANS.order], group[PREDICTIONS.rollout], strict=True)
            maps = {int(k): np.load(self.output_dir / r) for k, r in files}
            ct, rollout = scan_volumes(scan, maps, getattr(trainer.predict_dataloaders.dataset, "read_options", None))
            stem = Path("scans") / safe_name(row[SCANS.scan])  # the manifest's patient_id / scan, made a name
            paths = {name: f"{stem}_{name}.nii.gz" for name in (SCANS.ct, SCANS.rollout)}
            save_nifti(ct, scan.affine, inside(self.output_dir, paths[SCANS.ct]))
            save_nifti(rollout, scan.affine, inside(self.output_dir, paths[SCANS.rollout]))
            scans.loc[i, [SCANS.ct, SCANS.rollout]] = paths[SCANS.ct], paths[SCANS.rollout]
            if self.views:
                path = f"{stem}_{SCANS.views}.png"
                render_orthogonal_views(
                    ct, rollout, scan.affine, inside(self.output_dir, path), title=str(row[SCANS.scan])
                )
                scans.loc[i, SCANS.views] = path
            scans.loc[i, [SCANS.series_uid, SCANS.notes]] = scan.series_uid, "; ".join(scan.notes)
        with atomic_write(self.output_dir / SCANS.file) as tmp:
            scans.to_csv(tmp, index=False)
