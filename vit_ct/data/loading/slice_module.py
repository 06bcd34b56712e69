"""What every vit-ct data module shares, whatever its slices come from (a manifest, whole scans, the simulator): the
windows and input size that make its input contract, loaders that know DDP and CUDA, and batches windowed and
augmented where they land (on the GPU when there is one)."""

from __future__ import annotations

import lightning as L
import numpy as np
import pandas as pd
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from vit_ct.data.loading.distributed import MarkedPaddingSampler, global_seed
from vit_ct.data.loading.slice_dataset import CTBatch
from vit_ct.data.manifests.neighbours import neighbour_rows, slice_places
from vit_ct.data.transforms.augment import BatchAugmentation
from vit_ct.data.transforms.contract import DEFAULT_IMG_SIZE, DEFAULT_WINDOWS, InputContract, slices_read
from vit_ct.data.transforms.model_input import apply_windows
from vit_ct.data.transforms.scanner_augment import ScannerAugmentation
from vit_ct.data.transforms.windows import parse_windows

Window = str | tuple[float, float]
__all__ = ["DEFAULT_IMG_SIZE", "DEFAULT_WINDOWS", "SliceDataModule", "Window"]


class SliceDataModule(L.LightningDataModule):
    """The base of vit-ct's data modules: slices as :class:`~vit_ct.data.loading.slice_dataset.CTBatch` batches.

    Subclasses add where the slices come from (``setup`` and the loaders) and may refuse bad input before a run in
    :meth:`check`.

    Args:
        windows: HU windows stacked as channels: preset names or ``[centre, width]`` pairs.
        img_size: Side of the square model input.
        batch_size: Slices per batch (per device under DDP).
        num_workers: DataLoader worker processes.
        augment: Augment training batches where they land (:class:`~vit_ct.data.transforms.augment.BatchAugmentation`).
        scanner_augment: Before the windows, another scanner's kernel, dose and HU calibration on training batches
            (:class:`~vit_ct.data.transforms.scanner_augment.ScannerAugmentation`); the batches then travel in HU.
        read_options: Options of :func:`~vit_ct.data.io.reader.load_ct_slice` (``modalities``,
            ``stored_values_are_hu``), recorded in the input contract.
        context_mm: Read each slice with the slices of its scan this far below and above it, as further channels
            (:mod:`vit_ct.data.manifests.neighbours`); None: each slice alone. Recorded in the input contract.
    """

    def __init__(
        self,
        *,
        windows,
        img_size: int,
        batch_size: int,
        num_workers: int,
        augment: bool,
        read_options: dict,
        scanner_augment: bool = False,
        context_mm: float | None = None,
    ) -> None:
        super().__init__()
        try:
            self.windows = parse_windows(windows)
        except ValueError as err:
            raise ValueError(f"data.windows: {err}") from None
        if img_size <= 0:
            raise ValueError(f"data.img_size must be a positive number of pixels, got {img_size}")
        if batch_size <= 0:
            raise ValueError(f"data.batch_size must be a positive number of slices, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"data.num_workers must be 0 (load in the main process) or more, got {num_workers}")
        if context_mm is not None and not context_mm > 0:
            raise ValueError(
                f"data.context_mm must be a distance > 0 in mm (or null: each slice alone), got {context_mm}"
            )
        self.context_mm = None if context_mm is None else float(context_mm)
        # batches carry each slice's volume and position (CTBatch): set by `setup` for a model with a sequence head
        self.read_volumes = False
        self.img_size = img_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.augment = augment
        self.augmentation = BatchAugmentation()
        self.scanner_augment = scanner_augment
        self.scanner_augmentation = ScannerAugmentation()
        self.read_options = dict(read_options)

    @property
    def num_channels(self) -> int:
        """Input channels of the model: one per window, of the slice and (with context) of its two neighbours."""
        return len(self.windows) * slices_read(self.context_mm)

    def input_contract(self, patch_size: int) -> InputContract:
        """How this module prepares slices for a model with ``patch_size`` (recorded in its checkpoints)."""
        return InputContract.of(
            img_size=self.img_size,
            patch_size=patch_size,
            windows=self.windows,
            read_options=self.read_options,
            context_mm=self.context_mm,
        )

    def scan_places(self, table: pd.DataFrame, where: str) -> tuple[tuple | None, np.ndarray | None]:
        """Where the slices of ``table`` lie, as far as a run needs: each row's volume and position
        (:func:`~vit_ct.data.manifests.neighbours.slice_places`) where the model reads slices in their scan
        (``read_volumes``), else None; with ``context_mm``, the rows read with each row, said in one line naming
        ``where``, else None."""
        if self.context_mm is None and not self.read_volumes:
            return None, None
        places = slice_places(table.reset_index(drop=True))
        if self.context_mm is None:
            return places, None
        found = neighbour_rows(*places, self.context_mm)
        rank_zero_info(found.describe(where))
        return (places if self.read_volumes else None), found.rows

    def check(self, stage: str, *, num_classes: int | None = None) -> None:
        """Refuse bad input for ``stage`` before a run starts (the CLI calls it before the trainer does anything);
        nothing to check here."""

    def _pin_memory(self) -> bool:
        """Page-locked batches when they go to a CUDA device: the copy then overlaps the step before."""
        trainer = self.trainer
        return trainer is not None and trainer.strategy.root_device.type == "cuda"

    def _ranks(self) -> dict[str, int]:
        """``num_replicas`` and ``rank`` of this process under a multi-process strategy, else empty."""
        trainer = self.trainer
        kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
        return {"num_replicas": kwargs["num_replicas"], "rank": kwargs["rank"]} if kwargs else {}

    def _evaluation_loader(self, dataset: Dataset, **loader) -> DataLoader:
        """A loader over every slice of ``dataset`` once; under DDP each rank's shard is padded with marked repeats,
        so that no slice counts twice (:mod:`vit_ct.data.loading.distributed`)."""
        ranks = self._ranks()
        sampler = MarkedPaddingSampler(dataset, **ranks) if ranks.get("num_replicas", 1) > 1 else None
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, drop_last=False, **loader)

    def on_after_batch_transfer(self, batch: CTBatch, dataloader_idx: int) -> CTBatch:
        """Window batches that arrive in HU (the disk cache's), then augment training batches where they are now
        (GPU or CPU), with generators seeded by (seed, rank, batch number), so that a resumed run draws what the
        interrupted one would have drawn: the slices' parameters from one on the CPU, the pixels' noise from one on
        the batch's device (the same generator when that is the CPU)."""
        trainer = self.trainer
        training = trainer is not None and trainer.training
        generator = pixels = None
        if training and (self.augment or self.scanner_augment):
            number = trainer.fit_loop.epoch_loop.batch_progress.total.ready  # batches drawn before, checkpointed
            state = np.random.SeedSequence([global_seed(), trainer.global_rank, number]).generate_state(2)
            seed = int(state[0]) << 32 | int(state[1])
            device = (batch["hu"] if "hu" in batch else batch["image"]).device
            generator = torch.Generator().manual_seed(seed)
            pixels = generator if device.type == "cpu" else torch.Generator(device=device).manual_seed(seed)
        if "hu" in batch:
            if training and self.scanner_augment:
                batch = {**batch, "hu": self.scanner_augmentation(batch["hu"], pixels)}
            batch = apply_windows(batch, self.windows)
        if not (training and self.augment):
            return batch
        return self.augmentation(batch, generator, pixels)
