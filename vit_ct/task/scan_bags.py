"""Training from scan labels by multiple-instance learning, two levels deep: patches -> slice -> scan.

A scan (the bag) holds a lesion when one of its slices does; a slice when one of its patches does. Each slice gives
evidence, as a log-odds: its classifier's (P(lesion), or each label's) and, with the patch head, its patches' pooled
evidence (:func:`vit_ct.task.losses.mil_logit`). A scan's evidence is its slices' pooled by the log-sum-exp mean
``log(mean(exp(r z))) / r`` (Pinheiro & Collobert 2015; between the mean and the maximum, every slice getting a
share of the gradient by how much it drives the scan's verdict), scored by binary cross-entropy against the scan
label. Slices of a lesion-free scan are also plain negatives (their slice label is 0,
:mod:`vit_ct.data.manifests.scan_labels`); no slice of a scan with a lesion is ever scored as a slice.

A batch holds whole scans where they fit (the training order keeps a scan's slices together,
:class:`vit_ct.data.loading.distributed.EpochShuffleSampler`); the slices of a scan outside the batch join its bag with
their latest evidence, detached (:class:`ScanMemory`, one number per slice and source): memory stays bounded by one
batch, and a long scan's verdict still reads all of its slices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vit_ct.data.manifests.labels import lesion_label
from vit_ct.model.network import attention_keys
from vit_ct.task.losses import Task, mil_logit


def lesion_evidence(logits: torch.Tensor, task: Task) -> torch.Tensor:
    """``(B, K)`` log-odds per slice: of a lesion (``binary``; ``multiclass``: of any class but 0, K = 1) or of each
    label (``multilabel``, K = labels), in float32."""
    logits = logits.float()
    if task == "multilabel":
        return logits
    if task == "binary":
        return (logits[:, 1] - logits[:, 0])[:, None]
    return (torch.logsumexp(logits[:, 1:], dim=1) - logits[:, 0])[:, None]


def scan_targets(scan_label: torch.Tensor, task: Task) -> torch.Tensor:
    """``(B, K)`` targets matching :func:`lesion_evidence`: 1 (a lesion), 0 (none), -1 (unknown)."""
    if task == "multilabel":
        return scan_label
    return lesion_label(scan_label)[:, None]


def pool_bags(
    evidence: torch.Tensor, bags: torch.Tensor, valid: torch.Tensor, sharpness: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The log-sum-exp mean of each bag's evidence, per column, over its valid members.

    Args:
        evidence: ``(n, K)`` members' log-odds.
        bags: ``(n,)`` int, each member's bag.
        valid: ``(n, K)`` bool, the members that count (others are left out of their bag).
        sharpness: ``r``: the pool moves from the mean (``r`` -> 0) to the maximum (``r`` -> inf).

    Returns:
        ``(ids, pooled, counts)``: the bags ``(S,)`` (sorted), their pooled log-odds ``(S, K)`` (-inf where a bag has
        no valid member) and the members counted ``(S, K)``.
    """
    ids, inverse = torch.unique(bags, return_inverse=True)
    shape, columns = (len(ids), evidence.shape[1]), inverse[:, None].expand_as(evidence)
    z = (evidence.float() * sharpness).masked_fill(~valid, float("-inf"))
    peak = torch.full(shape, float("-inf"), device=z.device).scatter_reduce(0, columns, z, "amax")
    peak = torch.where(peak.isfinite(), peak, 0.0).detach()  # a stabiliser only: it cancels in the value
    total = torch.zeros(shape, device=z.device).index_add(0, inverse, (z - peak[inverse]).exp())
    counts = torch.zeros(shape, device=z.device).index_add(0, inverse, valid.float())
    total = torch.where(counts > 0, total, 1.0)  # no log(0) in the graph of an empty bag
    pooled = (total.log() + peak - counts.clamp_min(1).log()) / sharpness
    return ids, pooled.masked_fill(counts == 0, float("-inf")), counts


class ScanMemory:
    """The latest evidence of each training slice (its row in the split), detached, and its scan: so that a bag
    pools the slices of its scan that are not in the batch. One float per slice and source, grown as rows appear."""

    def __init__(self) -> None:
        self.evidence: torch.Tensor | None = None  # (N, K), NaN where not seen or not valid
        self.scans: torch.Tensor | None = None  # (N,), -1 where not seen

    def reset(self) -> None:
        self.evidence = self.scans = None

    def update(self, index: torch.Tensor, scans: torch.Tensor, evidence: torch.Tensor) -> None:
        """Remember ``evidence`` ``(B, K)`` (NaN where it does not count) of the rows ``index`` of scans ``scans``."""
        size = int(index.max()) + 1
        if self.evidence is None or self.evidence.shape[1] != evidence.shape[1]:
            self.evidence = evidence.new_full((0, evidence.shape[1]), float("nan"))
            self.scans = scans.new_full((0,), -1)
        if size > len(self.evidence):
            grow = size - len(self.evidence)
            self.evidence = torch.cat([self.evidence, evidence.new_full((grow, evidence.shape[1]), float("nan"))])
            self.scans = torch.cat([self.scans, scans.new_full((grow,), -1)])
        self.evidence[index] = evidence.detach().float()
        self.scans[index] = scans

    def recall(self, index: torch.Tensor, scans: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The remembered evidence ``(M, K)`` and scans ``(M,)`` of the other slices of ``scans``, those not among
        the rows ``index`` of the batch."""
        if self.evidence is None:
            return scans.new_empty((0, 0), dtype=torch.float32), scans.new_empty((0,))
        others = torch.isin(self.scans, scans)
        others[index[index < len(others)]] = False
        rows = others.nonzero().squeeze(1)
        return self.evidence[rows], self.scans[rows]


@dataclass
class ScanBags:
    """The scan-label losses of a batch that carries ``scan_label`` and ``scan``: ``scan_loss`` on the classifier's
    evidence and, with the patch head, ``scan_mil_loss`` on the patches' evidence (weighted as the slice-level
    multiple-instance loss).

    Attributes:
        task: the model's task; patch_size, num_prefix_tokens: for the patches that hold something.
        sharpness: the pool's ``r`` (:func:`pool_bags`); mil_weight: weight of the patch-level loss (0: none).
    """

    task: Task
    patch_size: int
    num_prefix_tokens: int
    sharpness: float = 5.0
    mil_weight: float = 0.0
    memory: ScanMemory = field(default_factory=ScanMemory)

    def __call__(
        self, batch: dict, logits: torch.Tensor, patch_logits: torch.Tensor | None, *, remember: bool, gather=None
    ) -> list[tuple[str, float, torch.Tensor | None]]:
        """``(name, weight, loss or None)`` per loss, for a batch, its logits ``(B, C)`` and patch logits ``(B, N)``.

        Args:
            remember: pool with the remembered slices of the batch's scans, and remember this batch's (training).
            gather: under DDP, a function that gathers a tensor from every rank (``(world, ...)``), so that every
                rank remembers every rank's slices.
        """
        scans, label = batch["scan"], batch["scan_label"]
        evidence, targets = lesion_evidence(logits, self.task), scan_targets(label, self.task)
        names = ["scan_loss"] * evidence.shape[1]
        use_patches = patch_logits is not None and self.mil_weight > 0
        if use_patches:
            prefix = self.num_prefix_tokens
            patches = attention_keys(batch["image"], self.patch_size, prefix)[:, 0, 0, prefix:]  # (B, N)
            held = patches.any(dim=1)  # a slice of nothing but air gives no patch evidence
            pooled = torch.full_like(evidence[:, 0], float("-inf"))
            pooled[held] = mil_logit(patch_logits[held], patches[held], self.sharpness)
            evidence = torch.cat([evidence, pooled[:, None]], dim=1)
            targets = torch.cat([targets, lesion_label(label)[:, None]], dim=1)
            names.append("scan_mil_loss")
        valid = evidence.isfinite()
        members, bags, member_valid = evidence, scans, valid
        if remember:
            past, past_scans = self.memory.recall(batch["index"], scans)
            if len(past) and past.shape[1] == evidence.shape[1]:
                members = torch.cat([evidence, past.to(evidence.device)])
                bags = torch.cat([scans, past_scans.to(scans.device)])
                member_valid = torch.cat([valid, past.isfinite()])
            self._remember(batch["index"], scans, torch.where(valid, evidence.detach(), float("nan")), gather)
        ids, pooled, counts = pool_bags(members, bags, member_valid, self.sharpness)
        # each bag's target: its slices' scan label (they agree, checked when the manifest is read)
        first = torch.zeros(len(ids), dtype=torch.int64, device=scans.device)
        first.scatter_(0, torch.searchsorted(ids, scans), torch.arange(len(scans), device=scans.device))
        target = targets[first].float()
        scored = (target >= 0) & (counts > 0)
        terms: dict[str, list[torch.Tensor]] = {}
        for column, name in enumerate(names):
            keep = scored[:, column]
            if keep.any():
                part = F.binary_cross_entropy_with_logits(pooled[keep, column], target[keep, column], reduction="sum")
                terms.setdefault(name, []).append((part, int(keep.sum())))
        out = [("scan_loss", 1.0, _mean(terms.get("scan_loss")))]
        if use_patches:
            out.append(("scan_mil_loss", self.mil_weight, _mean(terms.get("scan_mil_loss"))))
        return out

    def _remember(self, index, scans, evidence, gather) -> None:
        if gather:  # (world, B, ...) -> every rank's rows
            index, scans, evidence = (gather(t).flatten(0, 1) for t in (index, scans, evidence))
        self.memory.update(index, scans, evidence)


def _mean(parts: list[tuple[torch.Tensor, int]] | None) -> torch.Tensor | None:
    """The mean over every scored (bag, label) of summed losses; None when none was scored."""
    if not parts:
        return None
    return torch.stack([p for p, _ in parts]).sum() / sum(n for _, n in parts)
