"""Reading a slice in its scan: a small head over the slices' embeddings, in their order along the scan.

The strong head-CT models read a scan in two stages: a slice network, then a sequence model over the slices'
embeddings (the RSNA 2019 winners; Wu et al. 2024, a bidirectional LSTM over the scan). :class:`ScanSequence` is that
second stage: a bidirectional GRU over the class-token embeddings of one scan's slices, ordered by position, gives
each slice a correction to its own logits; :class:`ScanTransformer` is the same with a small transformer encoder
(every slice attends to every other of its scan, their order given by sinusoidal encodings). The correction starts at
zero, so that a network with a fresh sequence head reads every slice as the slice network alone does, and the slice
network's logits (and its rollout maps) stay its own: the sequence adds to them, it does not replace them.

:func:`in_scan_logits` runs it over any set of slices, grouped into scans by a scan number and ordered by position;
a slice with no scan (-1) is a scan of one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


class ScanSequence(nn.Module):
    """A bidirectional GRU over one scan's slice embeddings ``(S, L, D)`` -> a correction ``(S, L, outputs)`` to each
    slice's logits.

    Args:
        dim: The slice network's embedding width.
        outputs: The logits per slice.
        hidden: The GRU's width per direction.
        dropout: Dropout on the embeddings before the GRU.
    """

    def __init__(self, dim: int, outputs: int, hidden: int = 128, dropout: float = 0.1) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)
        self.gru = nn.GRU(dim, hidden, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * hidden, outputs)
        nn.init.zeros_(self.out.weight)  # a fresh head changes no logit: the scan starts as its slices read alone
        nn.init.zeros_(self.out.bias)

    def forward(self, embeddings: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Corrections ``(S, L, outputs)`` for ``S`` scans of ``lengths`` slices each, padded to ``L`` (padding
        rows are never read: the GRU runs over each scan's own length)."""
        x = self.drop(self.norm(embeddings))
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.gru(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=embeddings.shape[1])
        return self.out(out)


class ScanTransformer(nn.Module):
    """A transformer encoder over one scan's slice embeddings ``(S, L, D)`` -> a correction ``(S, L, outputs)`` to
    each slice's logits: the embeddings projected to ``width``, a sinusoidal encoding of each slice's place in its
    scan added (order, as the GRU reads it), ``depth`` pre-norm blocks of self-attention over the scan's slices
    (padding masked), a zero-initialised output layer.

    Args:
        dim: The slice network's embedding width.
        outputs: The logits per slice.
        width: The encoder's width.
        depth: Its blocks.
        heads: Attention heads per block.
        dropout: Dropout on the embeddings and in the blocks.
    """

    def __init__(self, dim: int, outputs: int, width: int = 128, depth: int = 2, heads: int = 4,
                 dropout: float = 0.1) -> None:  # fmt: skip
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)
        self.proj = nn.Linear(dim, width)
        block = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(block, depth, enable_nested_tensor=False)
        self.out_norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, outputs)
        nn.init.zeros_(self.out.weight)  # a fresh head changes no logit: the scan starts as its slices read alone
        nn.init.zeros_(self.out.bias)

    def forward(self, embeddings: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Corrections ``(S, L, outputs)`` for ``S`` scans of ``lengths`` slices each, padded to ``L`` (no slice
        attends to padding, so a scan reads the same whatever the padding)."""
        x = self.proj(self.drop(self.norm(embeddings)))
        x = x + sinusoid(embeddings.shape[1], x.shape[-1]).to(x)
        padding = torch.arange(embeddings.shape[1], device=x.device)[None] >= lengths.to(x.device)[:, None]
        return self.out(self.out_norm(self.encoder(x, src_key_padding_mask=padding)))


def sinusoid(length: int, width: int) -> torch.Tensor:
    """The sinusoidal encodings ``(length, width)`` of places ``0..length-1`` (Vaswani et al. 2017)."""
    place = torch.arange(length, dtype=torch.float32)[:, None]
    rate = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(10_000.0) / width))
    encoding = torch.zeros(length, width)
    encoding[:, 0::2] = torch.sin(place * rate)
    encoding[:, 1::2] = torch.cos(place * rate[: width // 2])
    return encoding


SEQUENCES = {"gru": ScanSequence, "transformer": ScanTransformer}  # model.network.sequence -> its head


def scan_order(scans: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How to lay rows out as padded scans: rows of one scan together, in position order.

    Args:
        scans: ``(n,)`` int, each row's scan; -1: a scan of its own.
        positions: ``(n,)`` float, each row's position along its scan (mm); NaN: after the placed rows, in row order.

    Returns:
        ``(order, scan, slot)``: the rows in scan and position order ``(n,)``; for each of those rows its scan's
        number ``0..S-1`` and its place in that scan ``(n,)``.
    """
    n = len(scans)
    scans = scans.clone()
    alone = scans < 0
    scans[alone] = scans.max().clamp_min(0) + 1 + torch.arange(int(alone.sum()), device=scans.device)
    # stable sorts: by position (NaN last), then by scan, so that each scan's rows come in position order
    order = torch.sort(positions.nan_to_num(float("inf")), stable=True).indices
    order = order[torch.sort(scans[order], stable=True).indices]
    _, scan, counts = torch.unique_consecutive(scans[order], return_inverse=True, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(n, device=scans.device) - starts[scan]
    return order, scan, slot


def in_scan_logits(
    sequence: nn.Module,
    embeddings: torch.Tensor,
    logits: torch.Tensor,
    scans: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Each slice's logits read in its scan ``(n, C)``: its own ``logits`` ``(n, C)`` plus the sequence's correction
    from the ``embeddings`` ``(n, D)`` of its scan's slices among the rows (``scans``, ``positions``:
    :func:`scan_order`), in float32."""
    if not len(logits):
        return logits.float()
    order, scan, slot = scan_order(scans, positions)
    lengths = torch.bincount(scan)
    padded = embeddings.new_zeros((len(lengths), int(lengths.max()), embeddings.shape[1]))
    padded[scan, slot] = embeddings[order]
    correction = sequence(padded.float(), lengths)[scan, slot]  # (n, C) in the sorted order
    out = logits.float().clone()
    out[order] = out[order] + correction.float()
    return out


@contextmanager
def head_inputs(head: nn.Module) -> Iterator[list[torch.Tensor]]:
    """The inputs of ``head`` (a network's classifier: the slices' embeddings ``(B, D)``), one per call while open,
    so that a pass that returns only logits gives its embeddings too."""
    seen: list[torch.Tensor] = []
    handle = head.register_forward_pre_hook(lambda _module, args: seen.append(args[0]))
    try:
        yield seen
    finally:
        handle.remove()
