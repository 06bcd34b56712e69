"""The one inference pass of vit-ct over a batch, which ``vit-ct predict`` and the review both run: probabilities, the
attention rollout (arXiv:2005.00928), the attention sink and the rollout's scores against the lesion per slice, and a
slice's values under the names of the output columns (:mod:`vit_ct.metrics.schema`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vit_ct.explain.map_reading import ONE_PASS, MapReading
from vit_ct.explain.maps import Explained, localisation_maps
from vit_ct.metrics.localisation import SURFACE_DISTANCE_SOURCES, scores_per_slice
from vit_ct.metrics.schema import PREDICTIONS
from vit_ct.metrics.sink import sink_per_slice
from vit_ct.model.sequence import head_inputs


@dataclass
class Inference:
    """What the model says about each slice of a batch."""

    index: torch.Tensor  # (B,) the slices' rows in the dataset
    prob: torch.Tensor  # (B,) P(lesion) when binary, else (B, num_classes); float32
    rollout: torch.Tensor  # (B, grid_h, grid_w) float32, non-negative; `map_shifts` times finer than the patches
    class_attention: torch.Tensor  # (B, blocks, T): the class token's head-fused row per block
    sink: dict[str, torch.Tensor]  # vit_ct.metrics.sink.sink_per_slice; empty without a head mask
    scores: dict[str, torch.Tensor]  # {source}_{score}: (B,) float64, NaN unscored; empty when no slice has a mask
    prob_tta: torch.Tensor | None = None  # as `prob`, the mean over the shifted passes' too; None: one pass
    # with a sequence head: what reading the slices in their scans needs (vit_ct.task.scan_reading.read_in_scan):
    # the slices' `embeddings` (B, D) and `logits` (B, C) of the unshifted pass, their `volume` and `position_mm`
    in_scan: dict[str, torch.Tensor] | None = None

    def probabilities(self, i: int, class_names: Sequence[str]) -> dict[str, float]:
        """Slice ``i``'s ``prob`` (binary) or ``prob_<class>`` columns, then ``prob_tta`` (``prob_tta_<class>``) where
        the map was read over shifted grids."""
        task = "binary" if self.prob[i].ndim == 0 else "multiclass"
        columns = {}
        for probs, tta in ((self.prob, False), (self.prob_tta, True)):
            if probs is not None:
                values = probs[i].float().cpu().reshape(-1).tolist()
                columns.update(zip(PREDICTIONS.probs(task, class_names, tta=tta), values, strict=True))
        return columns

    def sink_columns(self, i: int) -> dict[str, float]:
        """Slice ``i``'s attention-sink columns: ``rollout_air``, ``rollout_outside_head``, and per block ``b``
        ``cls_prefix_b{b}`` / ``cls_air_b{b}``; none when the batch had no head mask."""
        columns = {name: float(self.sink[name][i]) for name in self.shares if name in self.sink}
        for name in (PREDICTIONS.cls_prefix, PREDICTIONS.cls_air):
            if name in self.sink:
                columns.update(
                    {PREDICTIONS.block(name, b): float(v) for b, v in enumerate(self.sink[name][i].tolist())}
                )
        return columns

    def score_columns(self, i: int) -> dict[str, float]:
        """Slice ``i``'s localisation columns ``{source}_{score}``; none when no slice of the batch had a mask."""
        return {name: float(values[i]) for name, values in self.scores.items()}

    shares = (PREDICTIONS.rollout_air, PREDICTIONS.rollout_outside_head)  # the sink's per-slice shares


def infer(
    model, batch: dict, reading: MapReading = ONE_PASS, *, sources: tuple[str, ...] = SURFACE_DISTANCE_SOURCES
) -> Inference:
    """Runs a :class:`vit_ct.ViTClassifier` (in eval mode) once over ``batch``, without gradients.

    Args:
        model: The classifier; its rollout settings and ``localisation_tolerance_mm`` apply.
        batch: A :class:`vit_ct.CTBatch` on the model's device; the sink needs its ``head``, the localisation
            scores its ``mask`` and ``has_mask``.
        reading: How the maps are read (shifted grids, pixels); one pass by default.
        sources: The maps scored against the lesion (:data:`vit_ct.metrics.localisation.MAP_SOURCES`); predict
            scores the rollout and its ceiling, the review also the floors.
    """
    with head_inputs(model.vit.head) as embeddings:  # the first call: the unshifted pass
        explained: Explained = model.explained(batch["image"], reading=reading)  # shifted grids: reading.shifts > 1
    in_scan = None
    if getattr(model, "sequence", None) is not None and "volume" in batch:
        in_scan = {"embeddings": embeddings[0], "logits": explained.output, "volume": batch["volume"],
                   "position_mm": batch["position_mm"]}  # fmt: skip
    rollout, patches = explained.rollout, tuple(model.vit.patch_embed.grid_size)
    sink = {}
    if "head" in batch:  # the attention sink, per slice
        sink = sink_per_slice(rollout, explained.class_attention, batch["head"], model.num_prefix, patches)
    scores = {}
    if "has_mask" in batch and batch["has_mask"].any():  # the map against the lesion, per slice
        maps = localisation_maps(None, batch, rollout=rollout, patch_grid=patches)
        scores = scores_per_slice(maps, batch, tolerance_mm=model.hparams.localisation_tolerance_mm, sources=sources)
    prob = model.probabilities(explained.output)
    tta = None
    if explained.shifted_outputs:  # test-time augmentation: the mean probability over every pass
        passes = (explained.output, *explained.shifted_outputs)
        tta = torch.stack([model.probabilities(output) for output in passes]).mean(dim=0)
    return Inference(batch["index"], prob, rollout, explained.class_attention, sink, scores, tta, in_scan)
