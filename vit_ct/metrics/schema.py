"""The outputs' schema, named once: the columns of ``predictions.csv`` and ``scans.csv`` and the keys of ``run.json``
(what ``vit-ct predict`` writes), and the columns of the review's table. Writers and readers take the names from
here; users' scripts read these files, so a name or an order changes only with the README. Plain names, no torch:
``python -m vit_ct.run.summary`` reads them and answers at once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict


@dataclass(frozen=True)
class PredictionColumns:
    """``predictions.csv``: one row per predicted slice, in the dataset's order, with the columns below in this order
    (those the run has). The files named are relative to the folder of ``predictions.csv``."""

    file: str = "predictions.csv"
    index: str = "index"
    """The slice's row in the predicted dataset: the order while writing; not in the file."""
    image: str = "image"
    """The slice as the manifest names it."""
    prob: str = "prob"
    """Binary: P(lesion). Multi-class and multi-label runs write ``prob_<class>`` instead (:meth:`probs`)."""
    prob_tta: str = "prob_tta"
    """Where the map is read over shifted grids (``--map_shifts`` > 1): ``prob`` as the mean over those passes
    (test-time augmentation), beside the single pass's; ``prob_tta_<class>`` for multi-class and multi-label runs."""
    prob_in_scan: str = "prob_in_scan"
    """With a sequence head (``--model.network.sequence``): ``prob`` of the slice read in its whole scan (every
    predicted slice of its volume, in position order); ``prob_in_scan_<class>`` for multi-class and multi-label runs.
    ``prob`` stays the slice read alone, whose map the rollout reads."""
    prob_calibrated: str = "prob_calibrated"
    """With ``vit-ct predict --calibration FILE`` (binary runs): ``prob`` after the temperature scaling that
    ``vit-ct report`` fitted, ``sigmoid(logit(prob) / T)``; ``prob``, which the metrics read, stays the model's."""
    label: str = "label"
    """The manifest's class index, where known. Multi-label runs write ``label_<name>`` instead (:meth:`labels`)."""
    rollout: str = "rollout"
    """The rollout map: float32 ``.npy``, the source slice's rows x columns, non-negative."""
    overlay: str = "overlay"
    """PNG for a person: windowed CT, rollout heat map, lesion contour where known."""
    scan: str = "scan"
    """The slice's scan (the manifest's ``scan``, else ``patient_id``), where the manifest names one."""
    slice: str = "slice"
    """The manifest's ``slice`` (index along a volume's last axis), where it has one."""
    mask: str = "mask"
    """The manifest's lesion mask, where the slice has one."""
    outside_domain: str = "outside_domain"
    """Why the slice does not look like an axial head CT (another body part by its DICOM header, no skull around the
    brain in its pixels: :func:`vit_ct.data.io.head_check.head_check`); empty where it does."""
    rollout_air: str = "rollout_air"
    """Share of the rollout on patches without a head pixel (the attention sink)."""
    rollout_outside_head: str = "rollout_outside_head"
    """Share of the rollout, upsampled to the slice grid, outside the head's pixels."""
    cls_prefix: str = "cls_prefix"
    """Per block ``b`` (``cls_prefix_b<b>``, :meth:`block`): the class token's attention on the prefix tokens."""
    cls_air: str = "cls_air"
    """Per block ``b`` (``cls_air_b<b>``): the class token's attention on air patches."""
    # then per map scored against the lesion (vit_ct.metrics.localisation.SURFACE_DISTANCE_SOURCES: the rollout and
    # its ceilings, perfect_grid only where the map is read over shifted grids) each score as a column
    # `<source>_<score>` (:meth:`score`): NaN on slices without a known, non-empty lesion mask; HD95 only in the unit
    # some slice was measured in (`hd95_mm`, `hd95_px`)

    def probs(self, task: str, class_names: Sequence[str], *, tta: bool = False, in_scan: bool = False) -> list[str]:
        """The probability columns: ``prob`` (binary), else one ``prob_<class>`` per output; with ``tta`` the same of
        ``prob_tta``, with ``in_scan`` of ``prob_in_scan``."""
        base = self.prob_tta if tta else self.prob_in_scan if in_scan else self.prob
        return [base] if task == "binary" else [f"{base}_{name}" for name in class_names]

    def labels(self, names: Sequence[str]) -> list[str]:
        """The multi-label runs' label columns, ``label_<name>``."""
        return [f"{self.label}_{name}" for name in names]

    def block(self, name: str, block: int) -> str:
        """A per-block sink column: ``cls_prefix_b0``, ``cls_air_b3``, ..."""
        return f"{name}_b{block}"

    def score(self, source: str, score: str) -> str:
        """A localisation column: ``rollout_pointing``, ``perfect_patch_hd95_mm``, ..."""
        return f"{source}_{score}"

    def header(
        self,
        *,
        task: str,
        class_names: Sequence[str],
        labels: bool,
        scan: bool,
        frame: bool,
        mask: bool,
        blocks: int | None,
        sources: Sequence[str] = (),
        scores: Sequence[str] = (),
        tta: bool = False,
        in_scan: bool = False,
    ) -> list[str]:
        """The columns of a run whose slices all have the same kinds of values: ``labels`` known, a ``scan``, a
        ``frame`` (``slice``), a ``mask``, the sink over ``blocks`` (None: no head mask), the ``scores`` of the
        map ``sources`` scored against the lesion (none without a mask), ``tta`` (the map read over shifted grids),
        ``in_scan`` (a sequence head)."""
        names = [self.image, *self.probs(task, class_names)]
        names += self.probs(task, class_names, tta=True) if tta else []
        names += self.probs(task, class_names, in_scan=True) if in_scan else []
        if labels:
            names += self.labels(class_names) if task == "multilabel" else [self.label]
        names += [self.rollout, self.overlay]
        names += [self.scan] * scan + [self.slice] * frame + [self.mask] * mask + [self.outside_domain]
        if blocks is not None:
            names += [self.rollout_air, self.rollout_outside_head]
            names += [self.block(name, b) for name in (self.cls_prefix, self.cls_air) for b in range(blocks)]
        return names + [self.score(source, score) for source in sources for score in scores]


@dataclass(frozen=True)
class ScanColumns:
    """``scans.csv``: one row per scan, in this order (:func:`vit_ct.metrics.lesion_probability.scan_summary`, then
    :class:`vit_ct.predict.scan_writer.ScanResultsWriter`); the files named are relative to ``OUT``."""

    file: str = "scans.csv"
    scan: str = "scan"
    """The scan's name (the manifest's ``scan``, else ``patient_id``)."""
    n_slices: str = "n_slices"
    """Its predicted slices."""
    prob: str = "prob"
    """P(lesion) of the scan: the maximum over its slices."""
    prob_in_scan: str = "prob_in_scan"
    """With a sequence head: the maximum over its slices of P(lesion) read in the scan (``predictions.csv``'s
    ``prob_in_scan``)."""
    peak_slice: str = "peak_slice"
    """Index along the scan of the slice where ``prob`` peaks (``k`` of the NIfTI volume)."""
    peak_image: str = "peak_image"
    """That slice, as the manifest names it."""
    label: str = "label"
    """1 when any slice is positive, 0 when all are negative, empty when a slice's label is unknown."""
    slice_probs: str = "slice_probs"
    """The slices' P(lesion), ';'-separated, in scan order."""
    slice_probs_in_scan: str = "slice_probs_in_scan"
    """With a sequence head: the slices' P(lesion) read in the scan, likewise: where it moved the scan's decision."""
    ct: str = "ct"
    """``scans/<scan>_ct.nii.gz``: the CT in HU on the scan's grid and affine; empty without a known geometry."""
    rollout: str = "rollout"
    """``scans/<scan>_rollout.nii.gz``: the rollout volume on the same grid."""
    views: str = "views"
    """``scans/<scan>_views.png``: three orthogonal views of the map over the CT."""
    series_uid: str = "series_uid"
    """The DICOM series, for a scan read from one."""
    notes: str = "notes"
    """What reading the scan noticed, '; '-separated."""
    p_lesion: str = "p_lesion"
    """Input per slice: P(lesion) (:func:`vit_ct.metrics.lesion_probability.lesion_scores`); not in the file."""
    p_lesion_in_scan: str = "p_lesion_in_scan"
    """Per slice, where the run has a sequence head: P(lesion) read in its scan; not in the file."""
    positive: str = "positive"
    """Input per slice: its lesion label, <NA> where unknown; not in the file."""
    order: str = "order"
    """Input per slice: its index along the scan; not in the file."""


@dataclass(frozen=True)
class ReviewColumns:
    """The review's table (:func:`vit_ct.review.table.run_review`), one row per slice indexed by its row in the split
    (``index``), columns in this order; the sink and localisation columns are named as in ``predictions.csv``
    (:class:`PredictionColumns`), scored on every map source."""

    image: str = "image"
    """The slice as the manifest names it."""
    image_path: str = "image_path"
    """The slice's file."""
    scan: str = "scan"
    """The manifest's ``scan``, else ``patient_id``; None without either."""
    mask_path: str = "mask_path"
    """The lesion mask's file; None without one."""
    frame: str = "frame"
    """The manifest's ``slice``; None without one."""
    label: str = "label"
    """Int64 lesion label: 0/1, <NA> when unknown."""
    prob: str = "prob"
    """P(lesion) (:func:`vit_ct.metrics.lesion_probability.lesion_scores`)."""
    group: str = "group"
    """``TP``, ``FP``, ``FN``, ``TN`` at the review's threshold, or ``unlabelled``."""
    rows: str = "rows"
    """The source slice's rows."""
    cols: str = "cols"
    """The source slice's columns."""
    rollout: str = "rollout"
    """The ``(grid_h, grid_w)`` rollout map, in memory."""
    cls_prefix: str = "cls_prefix"
    """Per block, the class token's attention on the prefix tokens (an array)."""
    cls_air: str = "cls_air"
    """Per block, the class token's attention on air patches (an array)."""


class RunRecord(TypedDict):
    """``run.json``: how ``OUT`` was made, so that a review opens it without the model."""

    checkpoint: str | None
    """The checkpoint, resolved; None when the model was not loaded from one."""
    manifest: str | None
    """The manifest, resolved; None for scans without one."""
    images_relative_to: str | None
    """The folder the slices' paths in ``predictions.csv`` are relative to (the manifest's)."""
    scans: Any
    """``data.scans``: the scans predicted without a manifest."""
    input: dict | None
    """The model's input contract (size, windows, read options)."""
    task: str
    """``binary``, ``multiclass`` or ``multilabel``."""
    class_names: list[str]
    """The outputs' names, as the ``prob_<class>`` columns name them."""
    calibration: dict | None
    """With ``--calibration``: ``{"file": the calibration.json, resolved, "temperature": T}``; else None."""


RUN_JSON = "run.json"
PREDICTIONS = PredictionColumns()
SCANS = ScanColumns()
REVIEW = ReviewColumns()
