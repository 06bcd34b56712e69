"""Checkpoints you can trust: atomic writes, no code execution on load, exact resume after a SIGKILL, EMA weights."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import DEMO_LEVERS, quiet_trainer
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import EMAWeightAveraging
from npy_manifest import manifest_args, write_npy_manifest

from vit_ct import ViTClassifier
from vit_ct.cli import main
from vit_ct.run.checkpoint import WANDB_RUN_ID, AtomicCheckpointIO, read_wandb_run_id

TESTS = Path(__file__).resolve().parents[1]
TINY = {**DEMO_LEVERS, "embed_dim": 32, "depth": 2, "num_heads": 2, "img_size": 32, "in_chans": 1}


class Payload:
    """Pickled, it makes a folder when unpickled: the stand-in for code hidden in a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def _tiny_checkpoint(path: Path) -> dict:
    model = ViTClassifier.from_hparams(**TINY)
    trainer = quiet_trainer()
    trainer.strategy.connect(model)
    trainer.save_checkpoint(path)
    return torch.load(path, weights_only=True)


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"step": torch.tensor(1)}, path)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        io.save_checkpoint({"step": torch.tensor(2), "bad": lambda: None}, path)  # fails half-way through writing
    assert int(io.load_checkpoint(path)["step"]) == 1
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # no temporary file left


@pytest.mark.medium
def test_loading_never_executes_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checkpoint = _tiny_checkpoint(tmp_path / "good.ckpt")
    marker = tmp_path / "pwned"
    checkpoint["hyper_parameters"]["note"] = Payload(marker)
    evil = tmp_path / "evil.ckpt"
    torch.save(checkpoint, evil)
    torch.load(evil, weights_only=False)  # the payload is live: an unsafe load runs it
    assert marker.is_dir()
    marker.rmdir()

    with pytest.raises(ValueError, match="cannot read checkpoint .*evil.ckpt: it holds Python objects"):
        ViTClassifier.load_from_checkpoint(evil)
    with pytest.raises(ValueError, match="weights_only=True"):
        ViTClassifier.load_from_checkpoint(evil, weights_only=False)
    with pytest.raises(pickle.UnpicklingError):
        AtomicCheckpointIO().load_checkpoint(evil)
    with pytest.raises(ValueError, match="evil.ckpt"):
        read_wandb_run_id(evil)
    manifest = write_npy_manifest(tmp_path / "data", train=2, val=2)
    with pytest.raises(ValueError, match="cannot read checkpoint .*evil.ckpt"):
        main(["fit", *manifest_args(manifest), "--trainer.logger", "false", "--ckpt_path", str(evil)])
    assert not marker.exists()
    assert ViTClassifier.load_from_checkpoint(tmp_path / "good.ckpt").hparams.embed_dim == 32  # own ones load


@pytest.mark.parametrize(
    ("plugins", "expected"),
    [
        ([], AtomicCheckpointIO),
        (["--trainer.plugins", "lightning.pytorch.plugins.environments.LightningEnvironment"], AtomicCheckpointIO),
        (["--trainer.plugins", "lightning.pytorch.plugins.io.TorchCheckpointIO"], L.pytorch.plugins.TorchCheckpointIO),
    ],
)
def test_atomic_io_is_the_default_and_trainer_plugins_still_work(tmp_path, plugins, expected):
    manifest = write_npy_manifest(tmp_path / "data", train=2, val=2)
    cli = main([*manifest_args(manifest), "--trainer.logger", "false", *plugins], run=False)
    assert type(cli.trainer.strategy.checkpoint_io) is expected


def test_timm_state_dict_loads_like_timm_own_pretrained_loader(tmp_path):
    """``--model.weights FILE`` (vit_ct.model.weights) adapts channels, position grid and head as timm's loader does."""
    import timm

    torch.manual_seed(0)
    source = timm.create_model("vit_tiny_patch16_224", embed_dim=32, depth=2, num_heads=2, img_size=64, num_classes=5)
    path = tmp_path / "timm.pth"
    torch.save(source.state_dict(), path)
    ours = ViTClassifier.from_hparams(**TINY, stem="patch", num_classes=2, weights=str(path)).vit.state_dict()
    theirs = timm.create_model(
        "vit_tiny_patch16_224", pretrained=True, pretrained_cfg_overlay={"file": str(path), "num_classes": 5},
        embed_dim=32, depth=2, num_heads=2, img_size=32, in_chans=1, num_classes=2,
    ).state_dict()  # fmt: skip
    assert ours.keys() == theirs.keys()
    for key in ours:
        if not key.startswith("head."):  # both re-initialise the 5-class head
            torch.testing.assert_close(ours[key], theirs[key], msg=key)


@pytest.mark.parametrize("in_chans", [1, 3])
def test_conv_stem_input_channels_are_adapted_like_timm_adapts_a_linear_one(tmp_path, in_chans):
    """The demo's weights (conv stem, brain + subdural windows) start a model with other windows: the stem's first
    conv is adapted by timm's rule (-> 1 channel: the kernels summed; -> 3: repeated, scaled by 2 / 3)."""
    torch.manual_seed(0)
    demo = ViTClassifier.from_hparams(**{**TINY, "in_chans": 2})
    path = tmp_path / "demo.ckpt"
    torch.save({"state_dict": demo.state_dict()}, path)
    ours = ViTClassifier.from_hparams(**{**TINY, "in_chans": in_chans}, weights=str(path)).state_dict()
    first = demo.state_dict()["vit.patch_embed.proj.0.weight"]  # (24, 2, 3, 3)
    expected = first.sum(1, keepdim=True) if in_chans == 1 else first[:, [0, 1, 0]] * 2 / 3
    torch.testing.assert_close(ours["vit.patch_embed.proj.0.weight"], expected)
    for key, value in demo.state_dict().items():
        if key != "vit.patch_embed.proj.0.weight":
            torch.testing.assert_close(ours[key], value, msg=key)


def test_ema_callback_saves_the_average_weights(tmp_path):
    """``--trainer.callbacks+=EMAWeightAveraging --trainer.callbacks.decay 0.5``: the saved weights are the EMA."""
    from npy_manifest import write_npy_manifest as write

    from vit_ct import CTSliceDataModule

    manifest = write(tmp_path / "data", train=6, val=2)
    ema = ["--trainer.callbacks+=EMAWeightAveraging", "--trainer.callbacks.decay", "0.5"]
    cli = main([*manifest_args(manifest), "--trainer.logger", "false", *ema], run=False)
    assert [c.should_update(step_idx=1) for c in cli.trainer.callbacks if isinstance(c, EMAWeightAveraging)] == [True]

    class RecordWeights(Callback):
        def __init__(self) -> None:
            self.after_step: list[dict] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.after_step.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    torch.manual_seed(0)
    data = CTSliceDataModule(str(manifest), windows="brain", img_size=32, batch_size=2, num_workers=0)
    record, decay = RecordWeights(), 0.5
    trainer = quiet_trainer(
        max_epochs=1, limit_val_batches=0, default_root_dir=tmp_path, enable_checkpointing=True,
        callbacks=[EMAWeightAveraging(decay=decay), record],
    )  # fmt: skip
    trainer.fit(ViTClassifier.from_hparams(**TINY), datamodule=data)
    trainer.save_checkpoint(tmp_path / "ema.ckpt")
    expected = record.after_step[0]  # the first update copies the weights, later ones blend them in
    for weights in record.after_step[1:]:
        expected = {
            k: decay * expected[k] + (1 - decay) * v if v.is_floating_point() else v for k, v in weights.items()
        }
    saved = ViTClassifier.load_from_checkpoint(tmp_path / "ema.ckpt").state_dict()
    assert len(record.after_step) == 3
    assert not torch.allclose(saved["vit.pos_embed"], record.after_step[-1]["vit.pos_embed"])
    for key, value in expected.items():
        if value.is_floating_point():  # (integer buffers such as BatchNorm's step count are not averaged)
            torch.testing.assert_close(saved[key], value, msg=key)


_started: list[subprocess.Popen] = []


def _start(*args: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])  # the probe callback
    cwd.mkdir(parents=True, exist_ok=True)
    log = open(cwd / "log.txt", "w")  # noqa: SIM115 (closed with the process)
    command = [str(Path(sys.executable).with_name("vit-ct")), *args]
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _started.append(process)
    return process


def _finish(process: subprocess.Popen, cwd: Path) -> None:
    assert process.wait(timeout=600) == 0, (cwd / "log.txt").read_text()[-5000:]


def _last(cwd: Path) -> Path:
    (last,) = (cwd / "runs" / "vit-ct").glob("*/checkpoints/last.ckpt")
    return last


@pytest.mark.slow
def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path):
    manifest = write_npy_manifest(tmp_path / "data", train=16, val=4)  # 8 steps per epoch at batch size 2
    common = [
        *manifest_args(manifest), "--trainer.max_epochs", "2",  # augmented: its draws resume too
        "--checkpoint.every_n_train_steps", "2",
    ]  # fmt: skip
    whole = _start("fit", *common, cwd=tmp_path / "whole")
    try:
        _kill_and_resume(tmp_path, common, whole)
    finally:
        for process in _started:  # never leave a stalled job behind, whatever failed
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)


def _kill_and_resume(tmp_path: Path, common: list[str], whole: subprocess.Popen) -> None:
    stalled = tmp_path / "stalled.txt"
    # Lightning defers step checkpoints until the monitored val/auroc exists, i.e. until the first validation.
    probe = ["--trainer.callbacks+=probes.StallAtStep", "--trainer.callbacks.step", "13"]
    killed = _start("fit", *common, *probe, "--trainer.callbacks.marker", str(stalled), cwd=tmp_path / "resumed")
    deadline = time.monotonic() + 300
    while not stalled.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stalled.exists(), (tmp_path / "resumed" / "log.txt").read_text()[-5000:]
    last = _last(tmp_path / "resumed")
    os.killpg(killed.pid, signal.SIGKILL)  # the whole job, as a scheduler's kill would
    killed.wait(timeout=60)
    before = torch.load(last, weights_only=True)
    assert before["global_step"] == 12 and before["epoch"] == 1  # mid-epoch: 4 of the second epoch's 8 steps
    run_id = read_wandb_run_id(last)
    assert run_id and run_id == last.parent.parent.name

    resumed = _start("fit", *common, "--ckpt_path", str(last), cwd=tmp_path / "resumed")
    _finish(whole, tmp_path / "whole")
    _finish(resumed, tmp_path / "resumed")

    reference = torch.load(_last(tmp_path / "whole"), weights_only=True)
    after = torch.load(_last(tmp_path / "resumed"), weights_only=True)
    # (`epoch` may differ: Lightning writes the final last.ckpt at a different hook in a resumed session.)
    assert after["global_step"] == reference["global_step"] == 16
    assert after[WANDB_RUN_ID] == run_id  # the same W&B run continued ...
    wandb_runs = sorted((tmp_path / "resumed" / "runs" / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and all(p.name.endswith(f"-{run_id}") for p in wandb_runs)  # ... in both sessions
    for key, value in reference["state_dict"].items():  # data order, optimizer, schedule and RNG all resumed
        torch.testing.assert_close(after["state_dict"][key], value, msg=key)
    files = sorted((tmp_path / "resumed").rglob("*.ckpt"))
    assert len(files) >= 2 and not list((tmp_path / "resumed").rglob("*.tmp"))
    for path in files:
        assert ViTClassifier.load_from_checkpoint(path).hparams.embed_dim == 32


# The hyper-parameters `vit-ct fit --config configs/demo.yaml --config configs/manifest.yaml` stored before vit-ct's
# defaults became a plain ViT (the demo recipe was the code's then; 32 x 32, one window, 32 wide, as the tests shrink
# it), read from a checkpoint that version wrote.
DEMO_RUN_BEFORE_NEUTRAL_DEFAULTS = {
    "arch": "vit_tiny_patch16_224", "patch_size": 16, "stem": "conv", "num_classes": 2, "embed_dim": 32, "depth": 6,
    "num_heads": 2, "reg_tokens": 0, "mask_air": True, "drop_rate": 0.0, "attn_drop_rate": 0.0, "drop_path_rate": 0.1,
    "patch_loss_weight": 1.0, "attention_loss_weight": 1.0, "attention_target": "rollout", "mil_loss_weight": 0.0,
    "mil_sharpness": 5.0, "evidence_attention": False, "class_weights": None, "label_smoothing": 0.0,
    "label_weights": None, "lr": 0.001, "weight_decay": 0.05, "warmup_epochs": 1.0, "layer_decay": None,
    "rollout_head_fusion": "mean", "rollout_discard_ratio": 0.0, "localisation_tolerance_mm": 5.0,
    "grad_checkpointing": False, "img_size": 32, "multilabel": False, "class_names": None, "in_chans": 1,
    "_instantiator": "lightning.pytorch.cli.instantiate_module",
}  # fmt: skip
CONTRACT = {"img_size": 32, "patch_size": 16, "in_chans": 1, "windows": [[40.0, 80.0]],
            "read_options": {"modalities": ["CT"], "stored_values_are_hu": False}}  # fmt: skip


@pytest.mark.parametrize("stored", ["every argument", "before the link targets and mask_air were stored"])
def test_a_checkpoint_written_before_the_neutral_defaults_loads_as_it_was_built(tmp_path, stored):
    """The network is the checkpoint's, not today's defaults' (12 blocks, 224 x 224, three channels, no patch head):
    every weight loads (strict), and an older checkpoint without its input size and channels (links from the data,
    which `vit-ct fit` did not store then) or options it predates is built for its input contract and run as then."""
    hparams = dict(DEMO_RUN_BEFORE_NEUTRAL_DEFAULTS)
    if stored != "every argument":
        for name in ("img_size", "in_chans", "multilabel", "class_names", "mask_air", "attention_loss_weight"):
            del hparams[name]
    torch.manual_seed(0)
    built = {k: v for k, v in DEMO_RUN_BEFORE_NEUTRAL_DEFAULTS.items() if not k.startswith("_")}
    state = ViTClassifier.from_hparams(**built).state_dict()  # the weights of that network, whatever they are
    path = tmp_path / "old.ckpt"
    checkpoint = {"state_dict": state, "hyper_parameters": hparams, "vit_ct_input": CONTRACT}
    torch.save({**checkpoint, "pytorch-lightning_version": "2.5.0", "hparams_name": "kwargs"}, path)
    model = ViTClassifier.load_from_checkpoint(path)
    assert (len(model.vit.blocks), model.vit.embed_dim, model.vit.patch_embed.grid_size) == (6, 32, (2, 2))
    assert model.vit.patch_embed.proj[0].in_channels == 1 and model.patch_head is not None
    assert model.hparams.drop_path_rate == 0.1 and model.hparams.patch_loss_weight == 1.0
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in state.items())
    predated = stored != "every argument"  # trained with every patch a key and without the attention loss
    assert (model.vit.mask_air, model.patch_losses.attention_weight) == ((False, 0.0) if predated else (True, 1.0))
