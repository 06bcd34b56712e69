"""How a split is dealt out to processes and epochs: a training order fixed by (seed, epoch) that resumes mid-epoch,
and evaluation shards whose padding is marked, so DDP metrics count every slice exactly once.

Under DDP every rank must run the same number of batches, so a split whose size is not a multiple of the world
size is padded with repeated samples (as :class:`~torch.utils.data.DistributedSampler` does). The padding here comes
as ``-1 - index``; :class:`~vit_ct.data.loading.datamodule.CTSliceDataset` reads it as slice ``index`` with
``valid=False``, and the model leaves such samples out of its metrics.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def padding_index(index: int) -> int:
    """The sampler index of a padding repeat of sample ``index`` (negative, so it cannot pass for a real one)."""
    return -1 - index


def decode_index(index: int) -> tuple[int, bool]:
    """``(sample index, valid)`` of a sampler index: valid False for a padding repeat."""
    return (index, True) if index >= 0 else (-1 - index, False)


def global_seed() -> int:
    """The seed Lightning's ``seed_everything`` exported (also what its own distributed samplers use)."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


class MarkedPaddingSampler(DistributedSampler):
    """In-order shard of an evaluation split for one rank, padded like ``DistributedSampler`` but with the repeats
    marked (``-1 - index``). Being a ``DistributedSampler``, Lightning keeps it instead of injecting its own.

    Args:
        dataset: The split.
        num_replicas: Processes in the job (world size).
        rank: This process's global rank.
    """

    def __init__(self, dataset: Dataset, *, num_replicas: int, rank: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        indices = list(range(n))
        padding = self.total_size - n
        repeats = (indices * math.ceil(padding / n))[:padding]  # the samples DistributedSampler would repeat
        indices += [padding_index(i) for i in repeats]
        return iter(indices[self.rank : self.total_size : self.num_replicas])


class EpochShuffleSampler(DistributedSampler):
    """Training order of one rank, a function of (seed, epoch) only, also with a single process, so a run restarted
    from a mid-epoch checkpoint can skip exactly the samples it already trained on.

    With ``groups`` (each sample's scan, for training from scan labels) the order keeps a scan's slices together:
    the scans in random order, each one's slices shuffled among themselves, and each rank takes one contiguous share
    of that order, so a batch holds whole scans (a scan longer than a batch spans consecutive batches).

    Args:
        dataset: The training split.
        num_replicas: Processes in the job (world size).
        rank: This process's global rank.
        seed: Shuffle seed, the same on every rank.
        groups: ``(N,)`` int: each sample's group (scan); None shuffles samples one by one.
    """

    def __init__(self, dataset: Dataset, *, num_replicas: int = 1, rank: int = 0, seed: int = 0, groups=None) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.groups = None if groups is None else torch.as_tensor(groups, dtype=torch.int64)
        self.skip = 0  # samples of the next pass to leave out (set when resuming mid-epoch)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__()) if self.groups is None else self._grouped()
        skip, self.skip = self.skip, 0
        return iter(indices[skip:])

    def _grouped(self) -> list[int]:
        """This rank's share of the epoch's order by groups (padded as ``DistributedSampler`` pads)."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        shuffled = torch.randperm(len(self.groups), generator=generator)  # slices, shuffled within their scan below
        groups = self.groups[shuffled]
        place = torch.empty(int(self.groups.max()) + 1, dtype=torch.int64)
        place[torch.randperm(len(place), generator=generator)] = torch.arange(len(place))  # each scan's turn
        indices = shuffled[torch.sort(place[groups], stable=True).indices].tolist()
        padding = self.total_size - len(indices)
        indices += (indices * math.ceil(padding / len(indices)))[:padding]
        return indices[self.rank * self.num_samples : (self.rank + 1) * self.num_samples]


class ResumableDataLoader(DataLoader):
    """A training DataLoader Lightning resumes mid-epoch (it saves and restores ``state_dict`` in checkpoints).

    The state is the epoch, the batches handed out in it, and the batch size and processes they were dealt at; a
    restored loader starts that epoch after those batches, without reading them. Lightning builds no iterator ahead
    of the batch it trains on when the loader has a length, so "handed out" equals "trained on" when a checkpoint is
    written.

    Another batch size (``--data.init_args.batch_size``) or number of processes is taken at an epoch's start only.
    Lightning restores its own place in the epoch as a count of batches (the epoch loop's ``batch_progress``) and
    ends the epoch when that count reaches the new loader's length: resumed mid-epoch at another size, its count and
    the samples left could not agree (at a smaller size slices are trained twice and the epoch's validation is
    skipped; at a larger one slices are never seen), so such a resume is refused, naming both sizes.
    """

    def __init__(self, dataset: Dataset, *, sampler: EpochShuffleSampler, **kwargs: Any) -> None:
        # Its own generator: starting an epoch draws the worker seeds from it, not from the global RNG.
        kwargs.setdefault("generator", torch.Generator())
        super().__init__(dataset, sampler=sampler, **kwargs)
        self._served = 0
        self._resume_from = 0

    def __iter__(self) -> Iterator[Any]:
        self._served, self._resume_from = self._resume_from, 0
        self.sampler.skip = self._served * self.batch_size
        self.generator.manual_seed(self.sampler.seed * 100_003 + self.sampler.epoch)  # worker seeds per epoch
        for batch in super().__iter__():
            self._served += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.sampler.epoch,
            "batches": self._served,
            "batch_size": self.batch_size,
            "num_replicas": self.sampler.num_replicas,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Start at the saved place: after the batches served in the saved epoch, or at the next epoch's start when
        the saved one was finished.

        Raises:
            ValueError: the batch size or the number of processes differs from the saved one, and Lightning would
                continue counting the epoch in batches of the old size (see the class docstring).
        """
        epoch, batches = int(state["epoch"]), int(state["batches"])
        # states written before these were saved: assumed unchanged, as they were then
        size = int(state.get("batch_size", self.batch_size))
        replicas = int(state.get("num_replicas", self.sampler.num_replicas))
        changed = (size, replicas) != (self.batch_size, self.sampler.num_replicas)
        finished = batches * size >= math.ceil(len(self.sampler.dataset) / replicas)  # the rank's samples, all served
        if changed and not (finished and batches >= len(self)):  # Lightning's count would not be this run's
            raise ValueError(_refusal(epoch, batches, finished, (size, replicas), self))
        if finished:  # saved at the end of an epoch: the next one starts from its beginning
            epoch, batches = epoch + 1, 0
        # Lightning builds the first iterator before it calls set_epoch, and worker processes draw indices at once.
        self.sampler.set_epoch(epoch)
        self._resume_from = batches


def _refusal(epoch: int, batches: int, finished: bool, saved: tuple[int, int], loader: ResumableDataLoader) -> str:
    """Why a resume at another batch size or number of processes is refused, and what to do instead."""
    size, replicas = saved
    was, now = f"--data.init_args.batch_size {size}", f"--data.init_args.batch_size {loader.batch_size}"
    if replicas != loader.sampler.num_replicas:
        was += f" on {replicas} processes"
        now += f" on {loader.sampler.num_replicas}"
    if finished:  # saved at the last batch's end (a step checkpoint): any size whose epoch has no more batches fits
        smallest = math.ceil(loader.sampler.num_samples / batches)
        where = (
            f"after the last of epoch {epoch}'s {batches} batches, and Lightning would count epoch {epoch + 1} from"
            f" batch {batches} of this run's {len(loader)}, leaving slices of it unseen. Resume with"
            f" --data.init_args.batch_size {smallest} or more here"
        )
    else:
        where = (
            f"after {batches} batches of epoch {epoch}, and Lightning counts its place in an epoch in batches: at"
            f" another size the rest of the epoch would train slices twice or leave some unseen. Resume with {was}"
        )
    return (
        f"cannot resume with {now}: the checkpoint was written with {was}, {where} (a last.ckpt written after an"
        " epoch's validation resumes at any batch size), or start a new fit from the checkpoint's weights with"
        " --model.weights CKPT"
    )
