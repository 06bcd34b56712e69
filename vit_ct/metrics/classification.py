"""Slice-level classification metrics: AUROC (also per label), accuracy, F1, sensitivity and specificity via
torchmetrics, and RSNA 2019's weighted multi-label log loss.

Every metric is a torchmetrics ``Metric``, so it syncs its state across DDP ranks before it computes.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import (
    Accuracy,
    BinaryAccuracy,
    BinaryAUROC,
    BinaryF1Score,
    BinaryRecall,
    BinarySpecificity,
    F1Score,
    MulticlassAUROC,
    MultilabelAUROC,
    Recall,
    Specificity,
)
from torchmetrics.utilities import dim_zero_cat

Task = Literal["binary", "multiclass", "multilabel"]
UNKNOWN = -1  # the label of a slice whose label is not known (vit_ct.data.loading.slice_dataset.table_labels)


def classification_metrics(
    task: Task,
    num_classes: int,
    prefix: str,
    *,
    class_names: Sequence[str] | None = None,
    label_weights: Sequence[float] | None = None,
) -> MetricCollection:
    """The metric set of one stage, keys ``{prefix}auroc``, ``{prefix}accuracy``, ...

    Multi-label adds ``{prefix}auroc_<label>`` per label beside the macro ``{prefix}auroc``, and
    ``{prefix}weighted_log_loss`` when ``label_weights`` are given (RSNA 2019: 1 per subtype, 2 for ``any``).

    Args:
        task: ``binary`` (inputs: P(lesion) per slice), ``multiclass`` (inputs: class probabilities
            ``(B, num_classes)``) or ``multilabel`` (inputs: per-label probabilities ``(B, num_classes)``,
            targets 0/1 integers).
        num_classes: Classes (multi-class) or labels (multi-label); ignored for binary.
        prefix: Stage prefix such as ``"val/"``.
        class_names: Label names for the per-label keys; default ``0``, ``1``, ...
        label_weights: Multi-label: one weight per label for the weighted log loss; None: no such metric.
    """
    # -1: a label not known (a slice of a scan labelled with a lesion): left out of every figure. Each rank still
    # updates every metric with every batch, so that the states DDP gathers exist on all of them.
    unknown = {"ignore_index": UNKNOWN}
    if task == "binary":  # sensitivity: recall of the positive class; specificity: recall of the negative class
        binary = {
            "auroc": DefinedBinaryAUROC(**unknown),
            "accuracy": DefinedBinaryAccuracy(**unknown),
            "f1": DefinedBinaryF1Score(**unknown),
            "sensitivity": DefinedBinaryRecall(**unknown),
            "specificity": DefinedBinarySpecificity(**unknown),
        }
        return MetricCollection(binary, prefix=prefix)
    if task == "multiclass":
        kwargs = {"task": "multiclass", "num_classes": num_classes, "average": "macro", **unknown}
        auroc = DefinedMulticlassAUROC(num_classes=num_classes, **unknown)
    else:
        kwargs = {"task": "multilabel", "num_labels": num_classes, "average": "macro", **unknown}
        auroc = DefinedMultilabelAUROC(num_labels=num_classes, **unknown)
    metrics = {
        "auroc": auroc,
        "accuracy": Accuracy(**kwargs),
        "f1": F1Score(**kwargs),
        # Sensitivity is recall of the positive class; specificity is recall of the negative class.
        "sensitivity": Recall(**kwargs),
        "specificity": Specificity(**kwargs),
    }
    if task == "multilabel":
        names = [str(name) for name in class_names or range(num_classes)]
        metrics.update({f"auroc_{name}": LabelAUROC(i, **unknown) for i, name in enumerate(names)})
        if label_weights is not None:
            metrics["weighted_log_loss"] = WeightedLogLoss(list(label_weights))
    return MetricCollection(metrics, prefix=prefix)


# AUROC ranks positives against negatives: with one of them missing it is undefined. torchmetrics returns 0 there (and
# counts such a class as 0 in its macro average), which reads as a model that is always wrong and, as val/auroc, would
# pick a checkpoint. These return NaN instead (macro: the mean over the classes where AUROC is defined).
UNDEFINED_AUROC = (
    "AUROC is undefined where the targets hold only one class (e.g. a validation split without a bleed, a label never"
    " positive there, or scan labels, which label only the slices of scans without a lesion): it is logged as NaN,"
    " not 0, and never chooses a best checkpoint"
)
_warned = {"undefined": False}  # once per process, not once per metric, stage and label


def _warn_undefined_once() -> None:
    if not _warned["undefined"]:
        rank_zero_warn(UNDEFINED_AUROC)
        _warned["undefined"] = True


def _macro_over_defined(per_class: torch.Tensor, positives: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """Mean of the per-class AUROCs whose class has both positives and negatives; NaN (warned once) when none has."""
    defined = (positives > 0) & (positives < count)
    if not defined.all():
        _warn_undefined_once()
    return per_class[defined].mean() if defined.any() else per_class.new_tensor(float("nan"))


class DefinedBinaryAUROC(BinaryAUROC):
    """torchmetrics' binary AUROC, NaN (not 0) when the targets hold one class."""

    def compute(self) -> torch.Tensor:
        if not len(self.target):  # nothing scored (e.g. a split labelled by scan, its slices unlabelled)
            _warn_undefined_once()
            return torch.tensor(float("nan"), device=self.device)
        target = dim_zero_cat(self.target)
        if 0 < int(target.sum()) < target.numel():
            return super().compute()
        _warn_undefined_once()
        return torch.tensor(float("nan"), device=target.device)


class _PerClassAUROC:
    """``_per_class()``: the torchmetrics class's own AUROC of every class (``average=None``), its own warnings about
    undefined classes silenced (UNDEFINED_AUROC says it once)."""

    def _per_class(self) -> torch.Tensor:
        average, self.average = self.average, None
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="No (positive|negative) samples", category=UserWarning)
                return super().compute()
        finally:
            self.average = average


class DefinedMulticlassAUROC(_PerClassAUROC, MulticlassAUROC):
    """torchmetrics' one-vs-rest macro AUROC over the classes present with both outcomes; NaN when there is none."""

    def compute(self) -> torch.Tensor:
        target = dim_zero_cat(self.target).long()
        return _macro_over_defined(self._per_class(), torch.bincount(target, minlength=self.num_classes), len(target))


class DefinedMultilabelAUROC(_PerClassAUROC, MultilabelAUROC):
    """torchmetrics' macro AUROC over the labels with both outcomes; NaN when there is none."""

    def compute(self) -> torch.Tensor:
        target = dim_zero_cat(self.target)  # -1 where unknown (ignore_index): counted as neither outcome
        return _macro_over_defined(self._per_class(), (target == 1).sum(0), (target >= 0).sum(0))


class LabelAUROC(DefinedBinaryAUROC):
    """AUROC of one label of multi-label inputs ``(B, L)``: a plain metric, so Lightning logs it like any other
    (torchmetrics' ``ClasswiseWrapper`` returns a dict, which ``log_dict`` cannot take).

    Args:
        label: Column of the label in the inputs.
    """

    def __init__(self, label: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.label = label

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        super().update(preds[:, self.label], target[:, self.label])


class WeightedLogLoss(Metric):
    """Weighted multi-label log loss, the RSNA 2019 Intracranial Hemorrhage Detection metric.

    Per slice, the label-weighted mean of the binary cross-entropies, ``sum_l w_l BCE_l / sum_l w_l``; then the mean
    over slices. RSNA weights ``any`` 2 and each subtype 1. Kaggle scored a submission's (slice, label) rows as one
    log loss with those sample weights, which is the same number: every slice carries the same total weight (7).
    Probabilities are clipped to ``[eps, 1 - eps]`` (scikit-learn's ``log_loss`` of 2019 used 1e-15), so a
    confident mistake costs a large but finite loss.

    Args:
        weights: One weight per label, in the order of the inputs' columns.
        eps: Clipping of the probabilities.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, weights: Sequence[float], *, eps: float = 1e-15, **kwargs) -> None:
        super().__init__(**kwargs)
        self.eps = eps
        self.register_buffer("weights", torch.as_tensor(weights, dtype=torch.float32) / sum(weights), persistent=False)
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """``preds``: probabilities ``(B, L)``; ``target``: 0/1 ``(B, L)``."""
        known = (target >= 0).all(dim=1)  # slices with every label known
        p = preds[known].double().clamp(self.eps, 1 - self.eps)  # float64: 1 - 1e-15 is 1.0 in float32
        y = target[known].double()
        bce = -(y * p.log() + (1 - y) * (1 - p).log())  # (B, L)
        self.total += (bce * self.weights.double()).sum()
        self.count += bce.shape[0]

    def compute(self) -> torch.Tensor:
        return (self.total / self.count).float()


class _NaNWhereUndefined:
    """A binary figure of the slices' counts (true and false positives and negatives), NaN where those slices do not
    define it instead of torchmetrics' 0, which reads as a measured failure: no slice scored at all (a split labelled
    by scan: its slices carry no label), or none of the class the figure is a rate of (sensitivity without a slice
    with a lesion, as scan labels give; specificity without one without)."""

    def undefined(self, tp: torch.Tensor, fp: torch.Tensor, tn: torch.Tensor, fn: torch.Tensor) -> bool:
        return bool((tp + fp + tn + fn).sum() == 0)

    def compute(self) -> torch.Tensor:
        if self.undefined(*self._final_state()):
            return torch.tensor(float("nan"), device=self.device)
        return super().compute()


class DefinedBinaryAccuracy(_NaNWhereUndefined, BinaryAccuracy):
    """Accuracy, NaN where no slice was scored."""


class DefinedBinaryRecall(_NaNWhereUndefined, BinaryRecall):
    """Sensitivity, NaN where no scored slice has a lesion."""

    def undefined(self, tp, fp, tn, fn) -> bool:
        return bool((tp + fn).sum() == 0)


class DefinedBinarySpecificity(_NaNWhereUndefined, BinarySpecificity):
    """Specificity, NaN where every scored slice has a lesion."""

    def undefined(self, tp, fp, tn, fn) -> bool:
        return bool((tn + fp).sum() == 0)


class DefinedBinaryF1Score(_NaNWhereUndefined, BinaryF1Score):
    """F1, NaN where no scored slice has a lesion nor was called one (2 TP + FP + FN = 0)."""

    def undefined(self, tp, fp, tn, fn) -> bool:
        return bool((2 * tp + fp + fn).sum() == 0)
