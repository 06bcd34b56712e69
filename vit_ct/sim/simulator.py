"""Synthetic head CT simulated on the fly, inside the DataLoader workers: new slices every epoch, none on disk.

Pretrain on the simulator, then fine-tune on a few hundred of your own slices::

    vit-ct fit --config configs/pretrain.yaml
    vit-ct fit --config configs/finetune.yaml --data.manifest my.csv --model.weights runs/latest/checkpoints/last.ckpt
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from vit_ct.data.loading.distributed import decode_index
from vit_ct.data.loading.slice_dataset import CTBatch, slice_item
from vit_ct.data.loading.slice_module import SliceDataModule, Window
from vit_ct.data.transforms.contract import DEFAULT_IMG_SIZE, DEFAULT_WINDOWS
from vit_ct.data.transforms.windows import parse_windows
from vit_ct.progress import track
from vit_ct.sim.phantom import PhantomConfig, sample_head, simulate_slices
from vit_ct.sim.projector import METHODS

EVAL_SEED_OFFSETS = {"val": 10**6, "test": 2 * 10**6}  # evaluation sets: seed families training never draws from
NO_PREDICT = "SimulatorDataModule has nothing to predict on: predict with a manifest (configs/manifest.yaml)"


def worker_batches(num_batches: int, worker: int, num_workers: int) -> range:
    """Batches one DataLoader worker simulates: every ``num_workers``-th, in the round-robin order in which the
    DataLoader collects them, so the loader's batches do not depend on ``num_workers``."""
    return range(worker, num_batches, num_workers)


def head_generator(seed: int, epoch: int, rank: int, batch: int, head: int) -> np.random.Generator:
    """The generator of one synthetic head: distinct for every (seed, epoch, rank, batch, head)."""
    return np.random.default_rng([seed, epoch, rank, batch, head])  # hashed by numpy's SeedSequence


def _distributed_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    if rank is None:
        rank = torch.distributed.get_rank() if initialised else 0
    if world_size is None:
        world_size = torch.distributed.get_world_size() if initialised else 1
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
    return rank, world_size


class SimulatedSliceStream(IterableDataset):
    """Phantom slices (:mod:`~vit_ct.sim.phantom`: anatomy, bleeds, look-alikes, then a noisy scan) as CTBatch items.

    An epoch gives each rank ``ceil(epoch_size / world_size)`` slices in batches of ``batch_size``. Batch ``b`` is
    simulated by worker ``b % num_workers``, every head in it from :func:`head_generator` of (seed, epoch, rank, b,
    head): ranks, workers and epochs draw different slices, and a seed gives the same batches with any number of
    workers. Each head is a new patient (``sample_head``) with its own rotation; slice level, bleed (type, size,
    contrast), look-alikes, dose and kernel are drawn per slice by ``simulate_slices``.

    Args:
        config: How slices are drawn (size, pixel spacing, bleed mix, dose range, kernels).
        windows: HU windows, one channel each (anything ``parse_windows`` accepts).
        img_size: Side of the model input.
        epoch_size: Slices per epoch, over all ranks.
        batch_size: Slices per batch: the DataLoader's batch size, the unit dealt to workers.
        seed: Seed of every slice (>= 0).
        rank: This process's rank; None reads ``torch.distributed`` (0 when it is not initialised).
        world_size: Processes in the job; None reads ``torch.distributed`` (1 when it is not initialised).
        slices_per_head: Slices drawn from one head and scanned as one batch (faster per slice at 128 px or less).
        rotation_deg: In-plane head rotation, drawn uniformly in [-rotation_deg, rotation_deg] degrees.
        scan_method: The scan's numerical path: ``sampled`` (as always) or ``matrix`` (cached sparse projector
            matrices: faster per slice in batches, ``benchmarks/simulator_throughput.py``; the same slices but for
            a photon here and there).
        details: Also yield ``bleed_type``, ``level``, ``kernel`` and ``photons_per_ray`` (not part of CTBatch).
    """

    def __init__(
        self,
        *,
        config: PhantomConfig,
        windows: Window | list[Window] = DEFAULT_WINDOWS,
        img_size: int = DEFAULT_IMG_SIZE,
        epoch_size: int = 4096,
        batch_size: int = 32,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        slices_per_head: int = 1,
        rotation_deg: float = 15.0,
        scan_method: str = "sampled",
        details: bool = False,
    ) -> None:
        for name, value in (("img_size", img_size), ("epoch_size", epoch_size), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if slices_per_head < 1 or seed < 0 or not 0 <= rotation_deg <= 180:
            raise ValueError(
                f"need slices_per_head >= 1, seed >= 0 and rotation_deg in [0, 180]; "
                f"got {slices_per_head}, {seed}, {rotation_deg}"
            )
        self.config = config
        self.windows = parse_windows(windows)
        self.img_size = img_size
        self.batch_size = batch_size
        self.seed = seed
        self.rank, self.world_size = _distributed_rank(rank, world_size)
        self.slices_per_rank = math.ceil(epoch_size / self.world_size)  # equal on every rank, as DDP needs
        self.slices_per_head = slices_per_head
        self.rotation = math.radians(rotation_deg)
        if scan_method not in METHODS:
            raise ValueError(f"scan_method must be one of {METHODS}, got {scan_method!r}")
        self.scan_method = scan_method
        self.details = details
        # In shared memory: persistent workers keep their copy of the dataset but see the epoch set here.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return self.slices_per_rank

    @property
    def num_batches(self) -> int:
        return math.ceil(self.slices_per_rank / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Draw the slices of ``epoch`` from the next pass on (also in running persistent workers)."""
        self._epoch.fill_(epoch)

    def simulate_batch(self, batch: int, *, epoch: int) -> Iterator[CTBatch]:
        """The items of batch ``batch`` of ``epoch``; ``index`` numbers the slices of the epoch over all ranks."""
        first = batch * self.batch_size
        size = min(self.batch_size, self.slices_per_rank - first)
        for head_number, start in enumerate(range(0, size, self.slices_per_head)):
            rng = head_generator(self.seed, epoch, self.rank, batch, head_number)
            head = sample_head(rng)
            head = replace(head, rotation=float(rng.uniform(-self.rotation, self.rotation)))
            n = min(self.slices_per_head, size - start)
            for k, simulated in enumerate(simulate_slices(rng, self.config, n, head=head, method=self.scan_method)):
                index = self.rank * self.slices_per_rank + first + start + k
                item = slice_item(
                    simulated.hu,
                    simulated.mask,
                    label=torch.tensor(simulated.label),
                    index=index,
                    windows=self.windows,
                    img_size=self.img_size,
                    pixel_spacing_mm=(self.config.pixel_spacing_mm, self.config.pixel_spacing_mm),
                )
                item["valid"] = torch.tensor(True)
                if self.details:
                    item.update(
                        bleed_type=simulated.bleed_type,
                        level=simulated.level,
                        kernel=simulated.kernel,
                        photons_per_ray=simulated.photons_per_ray,
                    )
                yield item

    def __iter__(self) -> Iterator[CTBatch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch = int(self._epoch)
        for batch in worker_batches(self.num_batches, worker, num_workers):
            yield from self.simulate_batch(batch, epoch=epoch)


class StreamLoader(DataLoader):
    """A DataLoader that sets its stream's epoch as each pass starts (Lightning sets epochs on samplers only, and an
    iterable dataset has none).

    Args:
        dataset: The stream.
        epoch: Returns the epoch of the pass about to start (the trainer's), or None to count passes from 0.
        **kwargs: DataLoader arguments.
    """

    def __init__(
        self, dataset: SimulatedSliceStream, *, epoch: Callable[[], int | None] | None = None, **kwargs
    ) -> None:
        super().__init__(dataset, **kwargs)
        self.epoch = epoch
        self._passes = 0

    def __iter__(self):
        epoch = self.epoch() if self.epoch is not None else None
        self.dataset.set_epoch(self._passes if epoch is None else epoch)
        self._passes += 1
        return super().__iter__()


class SimulatedSliceSet(Dataset):
    """A fixed set of simulated slices in memory (validation, test), read like ``CTSliceDataset``: ``load``,
    ``table`` (``image`` names the slice, ``mask`` that its exact mask is known) and DDP padding marks.

    Args:
        items: :class:`CTBatch` items in ``index`` order, ``index`` 0, 1, ...
        table: One row per item: ``image``, ``label``, ``mask``, ``bleed_type``, ``level``, ``kernel``,
            ``photons_per_ray``.
    """

    label_columns = None

    def __init__(self, items: list[dict], table: pd.DataFrame) -> None:
        self.items = items
        self.table = table

    @classmethod
    def simulate(cls, stream: SimulatedSliceStream, *, name: str, num_workers: int = 0) -> SimulatedSliceSet:
        """Every slice of the stream's current epoch, simulated by ``num_workers`` worker processes."""
        if not stream.details:
            raise ValueError("SimulatedSliceSet.simulate needs a stream built with details=True")
        loader = DataLoader(stream, batch_size=None, num_workers=num_workers)  # items, not batches
        items = [
            # A tensor from a worker keeps a file descriptor open while it lives: keep copies in ordinary memory.
            {key: value.clone() if torch.is_tensor(value) else value for key, value in item.items()}
            for item in track(loader, total=len(stream), description=f"simulating {name}", transient=True)
        ]
        items.sort(key=lambda item: int(item["index"]))
        columns = ("bleed_type", "level", "kernel", "photons_per_ray")
        table = pd.DataFrame([{c: item.pop(c) for c in columns} for item in items])
        table.insert(0, "image", [f"{name}/{int(item['index']):06d}" for item in items])
        table.insert(1, "label", [int(item["label"]) for item in items])
        table.insert(2, "mask", table["image"])  # every simulated slice has its exact lesion mask
        for item in items:
            del item["valid"]
        return cls(items, table)

    def __len__(self) -> int:
        return len(self.items)

    def load(self, index: int) -> dict:
        return self.items[index]

    def __getitem__(self, index: int) -> CTBatch:
        index, valid = decode_index(
            index
        )  # a DDP padding repeat arrives as -1 - index (vit_ct.data.loading.distributed)
        return dict(self.items[index], valid=torch.tensor(valid))


class SimulatorDataModule(SliceDataModule):
    """Training slices simulated on the fly (new ones every epoch); validation and test sets simulated once, in
    memory, from seed families training never draws (``seed`` + 10^6 and + 2 x 10^6).

    A :class:`~vit_ct.data.loading.slice_module.SliceDataModule` (what ``vit-ct`` takes as data) whose slices are
    simulated: nothing to read or check.

    Args:
        windows: HU windows stacked as channels: preset names (``brain``, ``subdural``, ``bone``, ``stroke``) or
            ``[centre, width]`` pairs.
        img_size: Side of the square model input; simulated slices are resized to it.
        slice_size: Rows and columns of the simulated slices (the scan's grid).
        field_of_view_mm: Side of the reconstructed field of view (230 mm: 0.9 mm pixels at 256).
        epoch_size: Training slices per epoch (over all ranks under DDP).
        val_size: Slices in each of the validation and test sets.
        batch_size: Slices per batch (per device under DDP).
        num_workers: DataLoader processes simulating training slices (and the evaluation sets, once).
        seed: Seed of every simulated slice.
        bleed_fraction: Share of slices with an acute bleed.
        bleed_hu_range: HU of acute blood.
        low_contrast_fraction: Share of bleeds within 10 HU of the low end of ``bleed_hu_range`` (hard cases).
        small_fraction: Share of bleeds only a few mm across or thick (hard cases).
        lookalike_probability: Chance of each bright look-alike (pineal, choroid plexus, falx calcification).
        photons_per_ray_range: Dose range, unattenuated photons per detector bin and view, drawn log-uniformly.
        kernels: Reconstruction filters, drawn uniformly (``ramp``, ``shepp-logan``, ``cosine``, ``hamming``, ``hann``).
        beam_hardening: Strength of the bone beam-hardening streaks (0: none; else a coarser second projection).
        rotation_deg: In-plane head rotation, drawn uniformly in [-rotation_deg, rotation_deg] degrees.
        slices_per_head: Training slices drawn from each synthetic head (1: a new head for every slice).
        scan_method: The scan's numerical path, ``sampled`` or ``matrix`` (faster with several slices per head).
    """

    def __init__(
        self,
        *,
        windows: Window | list[Window] = DEFAULT_WINDOWS,
        img_size: int = DEFAULT_IMG_SIZE,
        slice_size: int = 256,
        field_of_view_mm: float = 230.0,
        epoch_size: int = 4096,
        val_size: int = 256,
        batch_size: int = 32,
        num_workers: int = 2,
        seed: int = 0,
        bleed_fraction: float = PhantomConfig.bleed_fraction,
        bleed_hu_range: tuple[float, float] = PhantomConfig.bleed_hu_range,
        low_contrast_fraction: float = PhantomConfig.low_contrast_fraction,
        small_fraction: float = PhantomConfig.small_fraction,
        lookalike_probability: float = PhantomConfig.lookalike_probability,
        photons_per_ray_range: tuple[float, float] = PhantomConfig.photons_per_ray_range,
        kernels: tuple[str, ...] = PhantomConfig.kernels,
        beam_hardening: float = PhantomConfig.beam_hardening,
        rotation_deg: float = 15.0,
        slices_per_head: int = 1,
        scan_method: str = "sampled",
    ) -> None:
        simulated = {"modalities": ("CT",), "stored_values_are_hu": False}  # written as CT in HU
        super().__init__(windows=windows, img_size=img_size, batch_size=batch_size, num_workers=num_workers,
                         augment=False, read_options=simulated)  # fmt: skip
        if epoch_size < 1 or val_size < 1 or num_workers < 0:
            raise ValueError(
                f"need epoch_size >= 1, val_size >= 1 and num_workers >= 0; got {epoch_size}, {val_size}, {num_workers}"
            )
        self.epoch_size = epoch_size
        self.val_size = val_size
        self.seed = seed
        self.rotation_deg = rotation_deg
        self.slices_per_head = slices_per_head
        self.scan_method = scan_method
        try:  # checks the phantom arguments now; simulating waits for the loaders
            self.config = PhantomConfig(
                size=slice_size,
                pixel_spacing_mm=field_of_view_mm / slice_size,
                bleed_fraction=bleed_fraction,
                bleed_hu_range=tuple(bleed_hu_range),
                low_contrast_fraction=low_contrast_fraction,
                small_fraction=small_fraction,
                lookalike_probability=lookalike_probability,
                photons_per_ray_range=tuple(photons_per_ray_range),
                kernels=tuple(kernels),
                beam_hardening=beam_hardening,
            )
        except ValueError as error:  # PhantomConfig names `size` and `pixel_spacing_mm`: say which argument
            raise ValueError(
                f"bad simulator arguments (slice_size={slice_size}, field_of_view_mm={field_of_view_mm}): {error}"
            ) from error
        self.datasets: dict[str, SimulatedSliceSet] = {}  # val / test, read by the rollout-overlay callback

    def stream(self, *, seed: int, epoch_size: int, rank: int = 0, world_size: int = 1, **kwargs):
        """A :class:`SimulatedSliceStream` with this module's phantom, windows and sizes."""
        return SimulatedSliceStream(
            config=self.config,
            windows=self.windows,
            img_size=self.img_size,
            epoch_size=epoch_size,
            batch_size=self.batch_size,
            seed=seed,
            rank=rank,
            world_size=world_size,
            rotation_deg=self.rotation_deg,
            scan_method=self.scan_method,
            **kwargs,
        )

    def _evaluation_set(self, split: str) -> SimulatedSliceSet:
        if split not in self.datasets:
            # The same set on every rank (rank 0 of 1); each rank then evaluates its shard of it.
            stream = self.stream(seed=self.seed + EVAL_SEED_OFFSETS[split], epoch_size=self.val_size, details=True)
            self.datasets[split] = SimulatedSliceSet.simulate(stream, name=split, num_workers=self.num_workers)
        return self.datasets[split]

    def check(self, stage: str, *, num_classes: int | None = None) -> None:
        """Nothing to read; refuses what the simulator cannot serve (prediction, fewer than two classes)."""
        if stage == "predict":
            raise ValueError(NO_PREDICT)
        if num_classes is not None and num_classes < 2:
            raise ValueError(
                f"simulated slices have labels 0 and 1; model.labels.num_classes must be >= 2, got {num_classes}"
            )

    def setup(self, stage: str) -> None:
        self.check(stage)
        if stage in ("fit", "validate"):
            self._evaluation_set("val")
        elif stage == "test":
            self._evaluation_set("test")

    def train_dataloader(self) -> StreamLoader:
        ranks = self._ranks()
        stream = self.stream(
            seed=self.seed,
            epoch_size=self.epoch_size,
            rank=ranks.get("rank", 0),
            world_size=ranks.get("num_replicas", 1),
            slices_per_head=self.slices_per_head,
        )
        return StreamLoader(
            stream,
            epoch=lambda: self.trainer.current_epoch if self.trainer is not None else None,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return self._evaluation_loader(self._evaluation_set("val"))  # in memory already: no workers

    def test_dataloader(self) -> DataLoader:
        return self._evaluation_loader(self._evaluation_set("test"))

    def predict_dataloader(self) -> DataLoader:
        raise ValueError(NO_PREDICT)
