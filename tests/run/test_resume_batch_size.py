"""Resuming with another batch size, through real fits: at an epoch's start any size trains on, each slice once per
epoch; mid-epoch, where Lightning counts its place in batches of the old size, the resume is refused naming both."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import DEMO_LEVERS, quiet_trainer
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from npy_manifest import write_npy_manifest

from vit_ct import CTSliceDataModule, ViTClassifier
from vit_ct.data.loading.distributed import EpochShuffleSampler, ResumableDataLoader
from vit_ct.run.checkpoint import BestAndLastCheckpoint, ResumeState

TINY = {**DEMO_LEVERS, "embed_dim": 32, "depth": 2, "num_heads": 2, "img_size": 32, "in_chans": 1}
TRAIN = 16  # slices of the training split


class SeenSlices(Callback):
    """The training slices of each epoch, in order, and whether each epoch ended in a validation."""

    def __init__(self) -> None:
        self.seen: dict[int, list[int]] = {}
        self.validated: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.setdefault(trainer.current_epoch, []).extend(batch["index"].tolist())

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.validated.append(trainer.current_epoch)


def _fit(folder: Path, manifest: Path, batch_size: int, *, epochs: int, ckpt: Path | None = None, steps: bool = False):
    """A fit with vit-ct's checkpoints (``last.ckpt`` after each validation) and, with ``steps``, one every 2 steps."""
    L.seed_everything(0)
    seen = SeenSlices()
    saving = [BestAndLastCheckpoint(dirpath=folder, monitor=None, save_last=True)]
    if steps:
        saving.append(ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1, filename="{step}"))
    trainer = quiet_trainer(
        max_epochs=epochs, default_root_dir=folder, enable_checkpointing=True, callbacks=[seen, ResumeState(), *saving]
    )
    data = CTSliceDataModule(str(manifest), windows="brain", img_size=32, batch_size=batch_size, num_workers=0)
    trainer.fit(ViTClassifier.from_hparams(**TINY), datamodule=data, ckpt_path=ckpt)
    return trainer, seen


@pytest.fixture(scope="module")
def first_epoch(tmp_path_factory) -> tuple[Path, Path]:
    """Manifest and checkpoint folder of one epoch at batch size 4 (4 steps), saved every 2 steps and at its end."""
    folder = tmp_path_factory.mktemp("resume")
    manifest = write_npy_manifest(folder / "data", train=TRAIN, val=2)
    trainer, seen = _fit(folder / "ckpt", manifest, 4, epochs=1, steps=True)
    assert trainer.global_step == 4 and sorted(seen.seen[0]) == list(range(TRAIN))
    return manifest, folder / "ckpt"


@pytest.mark.parametrize("batch_size", [2, 8])
def test_at_an_epochs_end_another_batch_size_trains_every_slice_once(first_epoch, tmp_path, batch_size):
    manifest, saved = first_epoch
    trainer, seen = _fit(tmp_path, manifest, batch_size, epochs=2, ckpt=saved / "last.ckpt")
    assert list(seen.seen) == [1] and sorted(seen.seen[1]) == list(range(TRAIN))
    assert trainer.global_step == 4 + TRAIN // batch_size and seen.validated[-1] == 1


def test_a_step_checkpoint_at_an_epochs_last_batch_resumes_at_a_larger_size(first_epoch, tmp_path):
    manifest, saved = first_epoch
    assert torch.load(saved / "step=4.ckpt", weights_only=True)["loops"]["fit_loop"]["state_dict"][
        "combined_loader"
    ] == [{"epoch": 0, "batches": 4, "batch_size": 4, "num_replicas": 1}]
    trainer, seen = _fit(tmp_path, manifest, 8, epochs=2, ckpt=saved / "step=4.ckpt")
    assert sorted(seen.seen[1]) == list(range(TRAIN)) and trainer.global_step == 4 + 2


@pytest.mark.medium
@pytest.mark.parametrize(
    ("checkpoint", "batch_size", "where"),
    [
        ("step=2.ckpt", 2, "after 2 batches of epoch 0"),  # slices 4-7 would have been trained twice
        ("step=2.ckpt", 8, "after 2 batches of epoch 0"),  # the epoch would have ended at once, 8 slices unseen
        ("step=4.ckpt", 2, "Lightning would count epoch 1 from batch 4 of this run's 8"),  # 8 slices of it unseen
    ],
)
def test_mid_epoch_another_batch_size_is_refused_naming_both(first_epoch, tmp_path, checkpoint, batch_size, where):
    manifest, saved = first_epoch
    with pytest.raises(ValueError) as refused:
        _fit(tmp_path, manifest, batch_size, epochs=2, ckpt=saved / checkpoint)
    message = str(refused.value)
    assert f"cannot resume with --data.init_args.batch_size {batch_size}:" in message
    assert "written with --data.init_args.batch_size 4," in message and where in message
    assert f"Resume with --data.init_args.batch_size 4{'' if where.startswith('after') else ' or more'}" in message
    assert "--model.weights" in message


def test_mid_epoch_at_the_same_batch_size_resumes_exactly(first_epoch, tmp_path):
    manifest, saved = first_epoch
    _, whole = _fit(tmp_path / "whole", manifest, 4, epochs=1)
    _, resumed = _fit(tmp_path / "resumed", manifest, 4, epochs=1, ckpt=saved / "step=2.ckpt")
    assert resumed.seen[0] == whole.seen[0][8:]  # the epoch's last 8 slices, in their order


def test_loader_state_from_before_the_batch_size_was_saved_resumes_as_before():
    def loader(batch_size: int) -> ResumableDataLoader:
        sampler = EpochShuffleSampler(range(10), seed=3)
        return ResumableDataLoader(list(range(10)), sampler=sampler, batch_size=batch_size)

    full = loader(3)
    full.sampler.set_epoch(2)
    uninterrupted = [b.tolist() for b in full]
    resumed = loader(3)
    resumed.load_state_dict({"epoch": 2, "batches": 2})  # a checkpoint of an earlier vit-ct
    assert [b.tolist() for b in resumed] == uninterrupted[2:]
    with pytest.raises(ValueError, match="--data.init_args.batch_size 3 on 2 processes"):
        loader(3).load_state_dict({"epoch": 2, "batches": 1, "batch_size": 3, "num_replicas": 2})
