"""DDP: ranks train on disjoint shards, padding never reaches the metrics, and one job writes one run.

The end-to-end test runs the real ``vit-ct fit`` with two CPU processes (gloo); Lightning starts the second one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from npy_manifest import manifest_args, write_npy_manifest
from sklearn.metrics import roc_auc_score
from torch.utils.data import DistributedSampler

from vit_ct import CTSliceDataModule, ViTClassifier
from vit_ct.data.loading.distributed import EpochShuffleSampler, MarkedPaddingSampler, ResumableDataLoader, decode_index
from vit_ct.explain.maps import localisation_maps
from vit_ct.metrics.localisation import scores_per_slice

TESTS = Path(__file__).resolve().parents[1]


def _vit_ct(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])  # the probe callback
    command = [str(Path(sys.executable).with_name("vit-ct")), *args]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


@pytest.mark.parametrize(("n", "world"), [(5, 2), (7, 3), (1, 2), (4, 2)])
def test_marked_padding_covers_every_sample_once(n, world):
    shards = [list(MarkedPaddingSampler(range(n), num_replicas=world, rank=r)) for r in range(world)]
    plain = [list(DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=False)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # every rank runs the same number of batches
    for shard, reference in zip(shards, plain, strict=True):  # the same samples as Lightning's default, marked
        assert [decode_index(i)[0] for i in shard] == reference
    valid = sorted(decode_index(i)[0] for s in shards for i in s if decode_index(i)[1])
    assert valid == list(range(n))


def test_dataset_marks_padding_and_single_process_batches_are_valid(tmp_path):
    data = CTSliceDataModule(str(write_npy_manifest(tmp_path, train=2, val=3)), img_size=32, num_workers=0)
    data.setup("validate")
    dataset = data.datasets["val"]
    assert bool(dataset[1]["valid"]) and not bool(dataset[-2]["valid"])
    assert int(dataset[-2]["index"]) == 1 and torch.equal(dataset[-2]["image"], dataset[1]["image"])
    batch = next(iter(data.val_dataloader()))  # no trainer: one process
    assert batch["valid"].all()


def test_training_order_resumes_mid_epoch():
    def loader():
        return ResumableDataLoader(list(range(10)), sampler=EpochShuffleSampler(range(10), seed=3), batch_size=3)

    first = loader()
    first.sampler.set_epoch(2)
    uninterrupted = [b.tolist() for b in first]
    interrupted = loader()
    interrupted.sampler.set_epoch(2)
    batches = iter(interrupted)
    head = [next(batches).tolist(), next(batches).tolist()]
    state = interrupted.state_dict()
    assert state == {"epoch": 2, "batches": 2, "batch_size": 3, "num_replicas": 1}
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == uninterrupted
    assert resumed.state_dict() == {"epoch": 2, "batches": 4, "batch_size": 3, "num_replicas": 1}
    other_epoch = loader()
    other_epoch.sampler.set_epoch(3)
    assert [b.tolist() for b in other_epoch] != uninterrupted


@pytest.mark.slow
@pytest.mark.ddp
def test_two_process_fit_and_validate(tmp_path):
    manifest = write_npy_manifest(tmp_path / "data", train=8, val=5)  # 5 = 3 + 2: rank 1 gets one padding repeat
    probe = ["--trainer.callbacks+=probes.RecordIndices", "--trainer.callbacks.folder", str(tmp_path / "rec")]
    ddp = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    common = manifest_args(manifest, batch_size=2)
    fit_args = ["--trainer.max_epochs", "1", "--model.optimisation.grad_checkpointing", "true"]
    _vit_ct("fit", *common, *ddp, *probe, *fit_args, cwd=tmp_path)

    fit = [json.loads((tmp_path / "rec" / f"fit-rank{r}.json").read_text()) for r in (0, 1)]
    assert [f["world_size"] for f in fit] == [2, 2]
    train = [{i for i, _ in f["seen"]["train"]} for f in fit]
    assert not train[0] & train[1] and len(train[0] | train[1]) == 8  # disjoint shards covering the split
    val = [f["seen"]["val"] for f in fit]
    assert len(val[0]) == len(val[1]) == 3  # same number of samples per rank ...
    assert sorted(i for v in val for i, ok in v if ok) == [0, 1, 2, 3, 4]  # ... each real slice counted once
    assert [ok for v in val for _, ok in v].count(False) == 1
    assert fit[0]["metrics"]["val/auroc"] == fit[1]["metrics"]["val/auroc"]  # synced by torchmetrics

    # One job, one run: one run folder with its config and checkpoints, one W&B run.
    runs = [p for p in (tmp_path / "runs" / "vit-ct").iterdir()]
    assert len(runs) == 1 and (runs[0] / "config.yaml").is_file()
    checkpoints = sorted(p.name for p in (runs[0] / "checkpoints").iterdir())
    assert len(checkpoints) == 2 and "last.ckpt" in checkpoints, checkpoints
    assert len(list((tmp_path / "runs" / "wandb").glob("offline-run-*"))) == 1
    best = next(p for p in (runs[0] / "checkpoints").iterdir() if p.name != "last.ckpt")  # the one the run keeps

    # The same checkpoint validated by 2 processes equals sklearn on single-process predictions.
    _vit_ct("validate", *common, *ddp, *probe, "--trainer.logger", "false", "--ckpt_path", str(best), cwd=tmp_path)
    validate = json.loads((tmp_path / "rec" / "validate-rank0.json").read_text())
    model = ViTClassifier.load_from_checkpoint(best, map_location="cpu").eval()
    data = CTSliceDataModule(str(manifest), **model.input_contract.data_arguments(), num_workers=0)  # as trained
    data.setup("validate")
    batch = next(iter(torch.utils.data.DataLoader(data.datasets["val"], batch_size=5)))
    with torch.no_grad():
        probs = model.probabilities(model(batch["image"])).numpy()
    expected = roc_auc_score(batch["label"].numpy(), probs)
    np.testing.assert_allclose(validate["metrics"]["val/auroc"], expected, atol=1e-6)
    np.testing.assert_allclose(fit[0]["metrics"]["val/auroc"], expected, atol=1e-6)  # best = the only epoch

    # The maps' segmentation scores (MONAI's Dice and HD95) synced over the ranks equal one process over the slices.
    with torch.no_grad():
        rollout = model.explain(batch["image"])[1]
    maps = localisation_maps(None, batch, rollout=rollout)
    per_slice = scores_per_slice(maps, batch, tolerance_mm=model.hparams.localisation_tolerance_mm)
    # (.npy slices: no pixel spacing, so HD95 is in pixels of the source slice)
    for name in ("rollout_dice", "rollout_iou", "rollout_hd95_px", "perfect_patch_dice", "perfect_patch_hd95_px"):
        expected = np.nanmean(per_slice[name].numpy())
        np.testing.assert_allclose(validate["metrics"][f"val/{name}"], expected, rtol=1e-4, err_msg=name)
