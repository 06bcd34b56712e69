"""Training and scoring the sequence head (:mod:`vit_ct.model.sequence`): each slice read in its scan.

In training a batch holds whole scans where they fit (the training order keeps a scan's slices together,
:class:`vit_ct.data.loading.distributed.EpochShuffleSampler`); the slices of a scan outside the batch join its
sequence with their latest embedding, detached (:class:`EmbeddingMemory`), as the scan-label bags pool their latest
evidence (:mod:`vit_ct.task.scan_bags`). The slices in the batch are scored in their scan against their slice labels
(``in_scan_loss``) and, with scan labels, their in-scan evidence makes their scan's bag.

In validation and test every slice's embedding is kept (:class:`EvaluatedRows`); at the end of the epoch each scan is
read whole, and the figures are logged again in scan: ``{stage}/auroc_in_scan`` (and the classification metrics'
other figures, each with ``_in_scan``) and ``{stage}/scan_auroc_in_scan`` (a scan's probability: its slices' highest in
scan, as ``scan_auroc`` takes it from the slices alone).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from vit_ct.data.manifests.labels import lesion_label
from vit_ct.metrics.lesion_probability import lesion_scores, scan_auroc, scan_summary
from vit_ct.model.sequence import in_scan_logits

VOLUME_KEYS = ("volume", "position_mm")


class EmbeddingMemory:
    """The latest embedding of each training slice (its row in the split), detached, in bfloat16, with its volume and
    position: so that a scan's sequence reads the slices that are not in the batch. Grown as rows appear."""

    def __init__(self) -> None:
        self.embeddings: torch.Tensor | None = None  # (N, D)
        self.volumes: torch.Tensor | None = None  # (N,), -1 where not seen
        self.positions: torch.Tensor | None = None  # (N,)

    def reset(self) -> None:
        self.embeddings = self.volumes = self.positions = None

    def update(self, index: torch.Tensor, volumes: torch.Tensor, positions: torch.Tensor, embeddings: torch.Tensor):
        """Remember ``embeddings`` ``(B, D)`` of the rows ``index``, of ``volumes`` at ``positions``."""
        size = int(index.max()) + 1
        if self.embeddings is None or self.embeddings.shape[1] != embeddings.shape[1]:
            self.embeddings = embeddings.new_zeros((0, embeddings.shape[1]), dtype=torch.bfloat16)
            self.volumes = volumes.new_full((0,), -1)
            self.positions = positions.new_zeros((0,))
        if size > len(self.embeddings):
            grow = size - len(self.embeddings)
            self.embeddings = torch.cat([self.embeddings, self.embeddings.new_zeros((grow, embeddings.shape[1]))])
            self.volumes = torch.cat([self.volumes, volumes.new_full((grow,), -1)])
            self.positions = torch.cat([self.positions, positions.new_full((grow,), float("nan"))])
        self.embeddings[index] = embeddings.detach().to(torch.bfloat16)
        self.volumes[index] = volumes
        self.positions[index] = positions

    def recall(self, index: torch.Tensor, volumes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The remembered embeddings ``(M, D)``, volumes ``(M,)`` and positions ``(M,)`` of the other slices of
        ``volumes`` (-1, no volume, has no others), those not among the rows ``index`` of the batch."""
        if self.embeddings is None:
            return volumes.new_empty((0, 0), dtype=torch.float32), volumes.new_empty((0,)), volumes.new_empty((0,))
        known = volumes[volumes >= 0]
        others = torch.isin(self.volumes, known.to(self.volumes.device)) & (self.volumes >= 0)
        others[index[index < len(others)].to(others.device)] = False
        rows = others.nonzero().squeeze(1)
        return self.embeddings[rows].float(), self.volumes[rows], self.positions[rows]


def training_in_scan(
    sequence: nn.Module,
    memory: EmbeddingMemory,
    batch: dict,
    embeddings: torch.Tensor,
    logits: torch.Tensor,
    gather: Callable | None = None,
) -> torch.Tensor:
    """The batch's logits in scan ``(B, C)``, its scans' other slices read from ``memory``; then the batch's
    embeddings remembered (``gather``: under DDP, every rank's, so that every rank's memory holds every slice)."""
    index, volumes, positions = batch["index"], batch["volume"], batch["position_mm"].float()
    past, past_volumes, past_positions = memory.recall(index, volumes)
    n = len(logits)
    if len(past):
        embeddings_all = torch.cat([embeddings, past.to(embeddings)])
        logits_all = torch.cat([logits, logits.new_zeros((len(past), logits.shape[1]))])
        volumes_all = torch.cat([volumes, past_volumes.to(volumes.device)])
        positions_all = torch.cat([positions, past_positions.to(positions)])
    else:
        embeddings_all, logits_all, volumes_all, positions_all = embeddings, logits, volumes, positions
    out = in_scan_logits(sequence, embeddings_all, logits_all, volumes_all, positions_all)[:n]
    remembered = (index, volumes, positions, embeddings.detach())
    if gather:  # (world, B, ...) -> every rank's rows
        remembered = tuple(gather(t).flatten(0, 1) for t in remembered)
    memory.update(*remembered)
    return out


def on_cpu(part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``part``'s tensors detached on the CPU, floating point ones in float32 (bfloat16 does not leave the process)."""
    return {key: (value.detach().float() if value.is_floating_point() else value.detach()).cpu()
            for key, value in part.items()}  # fmt: skip


def joined(parts: list[dict[str, torch.Tensor]], keys: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """The ``parts`` (each a batch of rows with an ``index``) as one table of tensors, each row once (a row read
    twice, a distributed sampler's padding repeat, counts once); ``keys``: those of them that every part has."""
    keys = [key for key in (keys or parts[0]) if all(key in part for part in parts)]
    rows = {key: torch.cat([part[key] for part in parts]) for key in keys}
    _, first = np.unique(rows["index"].numpy(), return_index=True)
    return {key: value[torch.from_numpy(first)] for key, value in rows.items()}


class EvaluatedRows:
    """The rows a validation or test epoch read: each slice's row, volume, position, embedding, logits, labels."""

    KEYS = ("index", "volume", "position_mm", "embeddings", "logits", "label", "scan_label")

    def __init__(self) -> None:
        self.parts: list[dict[str, torch.Tensor]] = []

    def reset(self) -> None:
        self.parts = []

    def add(self, batch: dict, embeddings: torch.Tensor, logits: torch.Tensor) -> None:
        """One evaluated batch (padding repeats already left out), on the CPU."""
        part = {key: batch[key] for key in ("index", "label", *VOLUME_KEYS)}
        if "scan_label" in batch:
            part["scan_label"] = batch["scan_label"]
        self.parts.append(on_cpu({**part, "embeddings": embeddings, "logits": logits}))

    def rows_read(self) -> torch.Tensor:
        """The rows this process read ``(n,)``."""
        return torch.cat([part["index"] for part in self.parts]) if self.parts else torch.zeros(0, dtype=torch.int64)

    def gathered(self) -> dict[str, torch.Tensor] | None:
        """Every rank's rows (each slice once), as one table of tensors; None where no row was read."""
        parts = self.parts
        if dist.is_available() and dist.is_initialized():  # an evaluation shard holds every world-th slice
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, parts)
            parts = [part for rank in every for part in rank]
        return joined(parts, self.KEYS) if parts else None


def scan_auroc_in_scan(probs: torch.Tensor, rows: dict[str, torch.Tensor], task: str, class_names: list[str]) -> float:
    """The scans' AUROC, a scan's probability its slices' highest P(lesion) in scan, a scan positive where its scan
    label says so, else where one of its slices is; slices with no volume left out. NaN where undefined."""
    placed = rows["volume"] >= 0
    if not placed.any():
        return float("nan")
    scores = lesion_scores(probs[placed], task, class_names).numpy()
    given = rows.get("scan_label")
    lesion = lesion_label(given if given is not None else rows["label"])[placed].numpy()
    volume = rows["volume"][placed].numpy()
    positive = pd.Series(lesion == 1, dtype="boolean").mask(lesion < 0)  # NA: unknown, the scan's label too
    slices = pd.DataFrame({"volume": volume, "order": rows["index"][placed].numpy(), "image": volume.astype(str),
                           "p_lesion": scores, "positive": positive})  # fmt: skip
    return scan_auroc(scan_summary(slices, "volume"))  # a scan holds a lesion where one of its slices does


def read_in_scan(sequence: nn.Module, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """The rows' logits in scan ``(n, C)`` (each scan read whole), on the sequence's device."""
    device = next(sequence.parameters()).device
    with torch.no_grad():
        return in_scan_logits(sequence, rows["embeddings"].to(device), rows["logits"].to(device),
                              rows["volume"].to(device), rows["position_mm"].to(device))  # fmt: skip


def log_in_scan(model, stage: str) -> None:
    """Where ``model`` (a :class:`~vit_ct.task.classifier.ViTClassifier`) has a sequence head: log the figures of
    ``stage`` again, each slice read in its whole scan (``{stage}/auroc_in_scan``, ...; ``scan_auroc_in_scan``)."""
    evaluated = model.evaluated[stage]
    if model.sequence is None:
        return
    own = evaluated.rows_read()  # this rank's: the metrics gather the ranks' states themselves
    rows = evaluated.gathered()
    evaluated.reset()
    if rows is None:
        return
    probs = model.probabilities(read_in_scan(model.sequence, rows))
    mine = torch.isin(rows["index"], own)
    metrics = model.in_scan_metrics[stage]
    metrics.update(probs[mine].to(model.device), rows["label"][mine].to(model.device))
    model.log_dict({f"{name}_in_scan": value for name, value in metrics.compute().items()})
    metrics.reset()
    auroc = scan_auroc_in_scan(probs.cpu(), rows, model.task, model.class_names)
    if auroc == auroc:  # defined: the scans hold both classes
        model.log(f"{stage}/scan_auroc_in_scan", auroc)  # the same on every rank
