"""The on-the-fly simulator: deterministic per seed, different slices per worker, rank and epoch, CTBatch items, and a
fit through the real command with configs/pretrain.yaml."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_MODEL_ARGS

from vit_ct.cli import main
from vit_ct.data.loading.datamodule import CTBatch
from vit_ct.sim.phantom import PhantomConfig
from vit_ct.sim.simulator import (
    SimulatedSliceStream,
    SimulatorDataModule,
    StreamLoader,
    head_generator,
    worker_batches,
)

PRETRAIN = str(Path(__file__).resolve().parents[2] / "configs" / "pretrain.yaml")
FINETUNE = str(Path(__file__).resolve().parents[2] / "configs" / "finetune.yaml")
CONFIG = PhantomConfig(size=64, pixel_spacing_mm=230 / 64)  # 3.6 mm pixels: coarse, but ~100 slices/s


def stream(**kwargs) -> SimulatedSliceStream:
    args = {"config": CONFIG, "windows": ["brain", "subdural"], "img_size": 32, "epoch_size": 8, "batch_size": 4}
    return SimulatedSliceStream(**{**args, **kwargs})


def images(items) -> torch.Tensor:
    return torch.stack([item["image"] for item in items])


def test_same_seed_same_slices_other_seed_other_slices():
    first = next(iter(stream(seed=3)))
    again = next(iter(stream(seed=3)))
    for key in CTBatch.__required_keys__:
        assert torch.equal(first[key], again[key]), key
    assert not torch.equal(first["image"], next(iter(stream(seed=4)))["image"])


def test_items_are_ctbatch_items_with_the_lesion_inside_the_head():
    items = list(stream(epoch_size=12))
    assert len(items) == 12 and [int(item["index"]) for item in items] == list(range(12))
    for item in items:
        assert set(item) == set(CTBatch.__required_keys__)
        assert item["image"].shape == (2, 32, 32) and item["image"].dtype == torch.float32
        assert item["image"].min() >= 0 and item["image"].max() <= 1
        assert item["mask"].shape == item["head"].shape == (1, 32, 32)
        assert item["has_mask"].item() and item["valid"].item()
        assert item["label"].dtype == torch.int64 and item["source_shape"].tolist() == [64, 64]
        assert item["label"].item() == 1 or not item["mask"].any()  # (a small bleed may vanish at 32 px)
        assert (item["mask"] <= item["head"]).all()
        assert item["head"].mean() > 0.2 and item["head"][0, 0, 0] == 0  # a head in the middle, air in the corner
    labels = [int(item["label"]) for item in items]
    assert 0 < sum(labels) < len(labels)


def test_matrix_scan_gives_the_same_slices_but_for_a_few_photon_counts():
    sampled = images(stream(slices_per_head=4))
    difference = (sampled - images(stream(slices_per_head=4, scan_method="matrix"))).abs()
    # Equal line integrals to ~1e-6; the Poisson draw of a ray whose mean sits on a threshold can differ by a photon.
    assert difference.mean() < 0.1 / 80 and difference.max() < 4 / 80  # brain window: 80 HU wide
    with pytest.raises(ValueError, match="scan_method"):
        stream(scan_method="fast")


def test_workers_ranks_and_epochs_are_seeded_apart():
    assert list(worker_batches(5, 0, 2)) == [0, 2, 4] and list(worker_batches(5, 1, 2)) == [1, 3]
    draws = {
        tuple(head_generator(0, epoch, rank, batch, head).integers(0, 2**62, 4))
        for epoch in range(2)
        for rank in range(2)
        for batch in range(3)
        for head in range(2)
    }
    assert len(draws) == 24

    ranks = [images(stream(rank=rank, world_size=2)) for rank in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 4  # epoch_size 8 over 2 ranks
    assert not torch.equal(ranks[0], ranks[1])

    epochs = stream()
    first = images(epochs)
    epochs.set_epoch(1)
    assert not torch.equal(first, images(epochs))
    epochs.set_epoch(0)
    assert torch.equal(first, images(epochs))


def test_two_workers_draw_different_slices_and_the_same_batches_as_one_process():
    def passes(num_workers: int) -> list[list[dict]]:
        loader = StreamLoader(stream(), batch_size=4, num_workers=num_workers, persistent_workers=num_workers > 0)
        return [list(loader) for _ in range(2)]  # epochs 0 and 1 (the loader counts passes)

    (first, second), (single, _) = passes(2), passes(0)
    assert len(first) == len(single) == 2
    assert not torch.equal(first[0]["image"], first[1]["image"])  # one batch from each worker
    for a, b in zip(first, single, strict=True):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["index"], b["index"])
    # persistent workers keep their copy of the stream, yet draw epoch 1's slices
    assert not torch.equal(first[0]["image"], second[0]["image"])


def open_files() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


def test_data_module_is_light_until_setup_and_evaluates_on_its_own_seed_family():
    data = SimulatorDataModule(img_size=32, slice_size=64, epoch_size=8, val_size=8, batch_size=4, num_workers=2)
    assert data.num_channels == 2 and data.datasets == {}  # the default windows: brain and subdural
    before = open_files()
    data.setup("fit")  # the validation set, simulated by 2 workers
    assert open_files() - before < 8  # not one file descriptor per tensor a worker sent (ulimit is often 1024)
    val = data.datasets["val"]
    assert len(val) == 8 and list(val.table.columns[:3]) == ["image", "label", "mask"]
    assert (val.table["label"] == [int(val.load(i)["label"]) for i in range(8)]).all()
    batch = next(iter(data.val_dataloader()))
    assert batch["image"].shape == (4, 2, 32, 32) and batch["valid"].all()
    train = next(iter(data.train_dataloader()))["image"]
    assert not any(torch.equal(train[i], batch["image"][j]) for i in range(4) for j in range(4))
    with pytest.raises(ValueError, match="slice_size"):
        SimulatorDataModule(slice_size=16)
    with pytest.raises(ValueError, match="predict"):
        data.check("predict")


@pytest.mark.slow
def test_pretrain_then_finetune_through_the_real_command(tmp_path, monkeypatch, synthetic_set):
    """configs/pretrain.yaml over a set on disk (here the demo's, tiny), then configs/finetune.yaml from its weights."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "vit-ct" / "pretraining"
    tiny = [
        "--data.manifest",
        str(synthetic_set),
        "--data.init_args.img_size",
        "32",
        "--data.init_args.batch_size",
        "8",
    ]
    tiny += ["--data.init_args.cache_dir", str(tmp_path / "cache"), "--trainer.limit_val_batches", "1"]
    main(["fit", "--config", PRETRAIN, *TINY_MODEL_ARGS, *tiny, "--trainer.max_epochs", "1", "--trainer.logger",
          "false", "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(run)])  # fmt: skip
    summary = json.loads((run / "summary.json").read_text())
    assert Path(summary["last_checkpoint"]).is_file()
    metrics = summary["metrics"]
    assert Path(summary["best_checkpoint"]).name == "epoch00.ckpt"  # the final weights of the schedule
    assert {"test/auroc", "test/loss", "test/rollout_pointing", "test/rollout_dice"} <= set(metrics)  # exact masks
    assert metrics["test/rollout_slices"] > 0 and np.isfinite(metrics["test/loss"])

    # Fine-tuning starts from those weights: the CLI loads them when it builds the model (grid adapted 2x2 -> 4x4).
    pretrained = torch.load(summary["last_checkpoint"], map_location="cpu", weights_only=True)["state_dict"]
    finetune = ["--config", FINETUNE, *TINY_MODEL_ARGS, "--data.manifest", str(synthetic_set)]
    finetune += ["--data.init_args.img_size", "64", "--model.pretrained", "null", "--model.weights"]
    finetune += [summary["last_checkpoint"]]
    finetune += ["--data.init_args.num_workers", "0", "--trainer.logger", "false", "--trainer.accelerator", "cpu"]
    cli = main(finetune, run=False)
    assert cli.model.vit.pos_embed.shape[1] == 1 + 4 * 4
    for name, value in cli.model.vit.state_dict().items():
        if name != "pos_embed":
            assert torch.equal(value, pretrained[f"vit.{name}"]), name
    out = tmp_path / "runs" / "vit-ct" / "finetune"
    main(["fit", *finetune, "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(out)])
    metrics = json.loads((out / "summary.json").read_text())["metrics"]
    assert np.isfinite(metrics["test/auroc"]) and Path(out / "checkpoints" / "last.ckpt").is_file()
