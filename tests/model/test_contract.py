"""A checkpoint knows how it sees its input: every vit-ct checkpoint records its input contract (size, windows, read
options), and commands, the review and fine-tuning prepare slices as it says, with one line where a config disagreed."""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path

import pytest
import torch
from npy_manifest import manifest_args, write_npy_manifest

from vit_ct import ViTClassifier
from vit_ct.cli import main
from vit_ct.data.transforms.contract import CHECKPOINT_KEY, InputContract
from vit_ct.model import shipped, weights_input
from vit_ct.review import review_datamodule
from vit_ct.run.checkpoint import BestAndLastCheckpoint, read_checkpoint, read_wandb_run_id

SHIPPED = "vit-ct/headct-tiny-256"
FINETUNE = str(Path(__file__).resolve().parents[2] / "configs" / "finetune.yaml")

NO_LOGGER = ["--trainer.logger", "false"]
READ = ["--data.init_args.modalities", "[CT,MR]", "--data.init_args.stored_values_are_hu", "true"]


@pytest.fixture
def fitted(tmp_path, monkeypatch):
    """(manifest, checkpoint) of a one-epoch fit at 32 x 32 on the brain window, CT and MR accepted, stored values
    taken as HU."""
    monkeypatch.chdir(tmp_path)
    manifest = write_npy_manifest(tmp_path / "data", train=4, val=2)
    main(["fit", *manifest_args(manifest), *NO_LOGGER, *READ, "--trainer.max_epochs", "1",
          "--trainer.default_root_dir", str(tmp_path / "run")])  # fmt: skip
    return manifest, tmp_path / "run" / "checkpoints" / "last.ckpt"


@pytest.mark.medium
def test_a_checkpoint_records_how_its_weights_see_the_input(fitted):
    _, ckpt = fitted
    expected = InputContract(32, 16, 1, ((40.0, 80.0),), {"modalities": ("CT", "MR"), "stored_values_are_hu": True})
    assert InputContract.from_checkpoint(read_checkpoint(ckpt)) == expected
    assert ViTClassifier.load_from_checkpoint(ckpt).input_contract == expected
    assert expected.describe() == "32 x 32 px, windows brain 40/80, CT/MR only, stored values taken as HU"


@pytest.mark.medium
def test_commands_with_a_checkpoint_prepare_slices_as_it_says_and_say_what_they_overruled(fitted, tmp_path, caplog):
    manifest, ckpt = fitted
    other = ["--data.init_args.img_size", "64", "--data.init_args.windows", "[brain,subdural]"]
    with caplog.at_level(logging.INFO):
        cli = main(["predict", *manifest_args(manifest), *NO_LOGGER, *other, "--ckpt_path", str(ckpt),
                    "--output_dir", str(tmp_path / "out")])  # fmt: skip
    data = cli.datamodule
    read = {"modalities": ("CT", "MR"), "stored_values_are_hu": True}
    assert (data.img_size, data.windows, data.read_options) == (32, [(40.0, 80.0)], read)
    assert cli.model.hparams.img_size == 32
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("input follows the checkpoint")]
    assert (
        f"input follows the checkpoint: data.img_size: 32 x 32 (as {ckpt} was trained; the config said 64 x 64)"
        in lines
    )
    assert any("data.windows: [brain 40/80]" in line and "subdural 80/200" in line for line in lines)
    assert any("data.stored_values_are_hu: True" in line for line in lines)
    assert (tmp_path / "out" / "predictions.csv").is_file()


@pytest.mark.medium
def test_fit_from_weights_takes_their_network_and_input_unless_typed_on_the_command_line(fitted, tmp_path, caplog):
    manifest, ckpt = fitted
    base = ["fit", *manifest_args(manifest), *NO_LOGGER, "--trainer.max_epochs", "0", "--model.weights", str(ckpt)]
    # the config's network (the demo's 6 blocks of 192) and input give way to the weights'
    cli = main([*base[:-4], "--model.network.depth", "6", "--model.network.embed_dim", "192",
                "--model.network.num_heads", "3", *base[-4:], "--data.init_args.windows", "[brain]"])  # fmt: skip
    assert (len(cli.model.vit.blocks), cli.model.vit.embed_dim) == (2, 32)
    assert cli.datamodule.read_options["stored_values_are_hu"] is True
    # an input size typed on the command line is kept: the position embeddings are interpolated to it, and said
    with caplog.at_level(logging.INFO):
        cli = main([*base, "--data.init_args.img_size", "64"])
    assert cli.model.hparams.img_size == 64 and cli.model.vit.patch_embed.grid_size == (4, 4)
    assert any("data.img_size: 64 x 64 as typed on the command line" in r.getMessage() for r in caplog.records)


@pytest.mark.medium
def test_a_checkpoint_from_before_contracts_with_other_windows_is_refused_by_name(fitted, tmp_path):
    manifest, ckpt = fitted
    checkpoint = torch.load(ckpt, weights_only=True)
    del checkpoint[CHECKPOINT_KEY]  # as written before checkpoints recorded their input
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    assert InputContract.from_checkpoint(checkpoint) == InputContract(32, 16, 1)  # what its hyper-parameters tell
    with pytest.raises(ValueError, match=rf"{old} takes 1 input window\(s\) but data.windows gives \[brain 40/80, "):
        main(["predict", *manifest_args(manifest), *NO_LOGGER, "--data.init_args.windows", "[brain,subdural]",
              "--ckpt_path", str(old), "--output_dir", str(tmp_path / "out")])  # fmt: skip


@pytest.mark.medium
def test_the_review_reads_slices_with_the_checkpoints_read_options(fitted):
    manifest, ckpt = fitted
    model = ViTClassifier.load_from_checkpoint(ckpt)
    data = review_datamodule(model, manifest, config={})
    assert data.read_options == {"modalities": ("CT", "MR"), "stored_values_are_hu": True}
    assert (data.img_size, data.windows) == (32, [(40.0, 80.0)])


@pytest.mark.medium
@pytest.mark.parametrize("subcommand", ["test", "validate", "predict"])
def test_every_command_sees_named_weights_as_they_were_trained(tmp_path, caplog, subcommand):
    """Shipped weights named by a config and no checkpoint (score them as they are): every command builds the network
    at the size they were trained for, as fit does, instead of resampling their position embeddings."""
    manifest = write_npy_manifest(tmp_path / "data", train=2, val=2)
    output = ["--output_dir", str(tmp_path / "out")] if subcommand == "predict" else []
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = main([subcommand, "--config", FINETUNE, "--data.manifest", str(manifest), *NO_LOGGER, *output])
    said = [r.getMessage() for r in caplog.records]
    line = "input follows the shipped weights: data.img_size: 256 x 256 (as vit-ct/headct-tiny-256 was trained; the"
    assert f"{line} config said 192 x 192)" in said
    assert cli.datamodule.img_size == cli.model.hparams.img_size == 256
    assert cli.model.vit.patch_embed.grid_size == (16, 16)
    assert cli.model.input_contract == shipped.input_contract(SHIPPED)
    assert not [w for w in caught if "resampled" in str(w.message)]


@pytest.mark.medium
def test_python_sees_named_weights_as_they_were_trained_and_says_where_told_otherwise(fitted):
    _, ckpt = fitted
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing to say: the weights' own input
        model = ViTClassifier.from_hparams(pretrained=SHIPPED)
    assert model.hparams.img_size == 256 and model.input_contract == shipped.input_contract(SHIPPED)
    with pytest.warns(UserWarning, match=r"position embeddings are resampled from 256 x 256 \(img_size=256"):
        model = ViTClassifier.from_hparams(pretrained=SHIPPED, img_size=192)
    assert model.hparams.img_size == 192 and model.input_contract.windows is None
    model = ViTClassifier.from_hparams(weights=str(ckpt))  # a vit-ct checkpoint as start weights: its input and network
    assert model.input_contract == InputContract.from_checkpoint(read_checkpoint(ckpt))
    assert (model.hparams.img_size, model.hparams.in_chans) == (32, 1)
    plain = ViTClassifier.from_hparams(depth=1)  # no weights that know their input: the data module's defaults
    assert (plain.hparams.img_size, plain.hparams.in_chans) == (192, 2)


def test_a_checkpoint_is_opened_once_while_unchanged(fitted, monkeypatch):
    _, ckpt = fitted
    opened = []
    load = torch.load
    monkeypatch.setattr(weights_input.torch, "load", lambda path, **kw: opened.append(path) or load(path, **kw))
    seen = weights_input.weights_input(ckpt_path=ckpt)
    read_wandb_run_id(ckpt)
    checkpoint = read_checkpoint(ckpt)
    assert len(opened) == 1 and seen.contract == InputContract.from_checkpoint(checkpoint)
    checkpoint["hyper_parameters"]["img_size"] = 64  # the caller's copy: the next reader is not misled
    assert read_checkpoint(ckpt)["hyper_parameters"]["img_size"] == 32 and len(opened) == 1
    torch.save({**checkpoint, "epoch": 7}, ckpt.with_suffix(".new"))  # (its tensors map the old file: not over it)
    ckpt.with_suffix(".new").replace(ckpt)  # changed on disk, as checkpoints are written: read again
    assert read_checkpoint(ckpt)["epoch"] == 7 and len(opened) == 2


@pytest.mark.medium
def test_the_review_keeps_the_windows_a_checkpoint_records(fitted):
    manifest, ckpt = fitted
    model = ViTClassifier.load_from_checkpoint(ckpt)
    with pytest.warns(UserWarning, match="input_windows='subdural' left aside: the model was trained with 32 x 32"):
        data = review_datamodule(model, manifest, config={}, input_windows="subdural")
    assert data.windows == [(40.0, 80.0)]


@pytest.mark.parametrize(
    ("metrics", "name"),
    [({"epoch": 0}, "final-epoch00-aurocna"),  # not measured (no validation)
     ({"epoch": 0, "val/auroc": torch.tensor(math.nan)}, "final-epoch00-aurocna"),  # undefined (one class)
     ({"epoch": 3, "val/auroc": torch.tensor(0.91234)}, "final-epoch03-auroc0.9123")],
)  # fmt: skip
def test_a_checkpoint_name_never_claims_a_score_that_was_not_measured(tmp_path, metrics, name):
    callback = BestAndLastCheckpoint(dirpath=tmp_path, filename="final-epoch{epoch:02d}-auroc{val/auroc:.4f}",
                                     auto_insert_metric_name=False)  # fmt: skip
    assert callback.format_checkpoint_name(metrics).endswith(f"{name}.ckpt")


def test_a_contract_with_context_says_it_and_one_without_stores_as_before():
    alone = InputContract.of(img_size=64, patch_size=16, windows=["brain", "subdural"],
                             read_options={"modalities": ["CT"], "stored_values_are_hu": False})  # fmt: skip
    assert "context_mm" not in alone.to_dict() and alone.slices == 1  # checkpoints without context: as before
    around = InputContract.of(img_size=64, patch_size=16, windows=["brain", "subdural"], context_mm=5,
                              read_options={"modalities": ["CT"], "stored_values_are_hu": False})  # fmt: skip
    assert (around.in_chans, around.slices, around.context_mm) == (6, 3, 5.0)
    assert InputContract.from_dict(around.to_dict()) == around
    assert around.data_arguments()["context_mm"] == 5.0 and "context_mm" not in alone.data_arguments()
    assert around.describe().endswith(", each slice with its neighbours 5 mm below and above")
    with pytest.raises(ValueError, match="one channel per window and slice"):
        InputContract(64, 16, 2, ((40.0, 80.0), (80.0, 200.0)), None, 5.0)
    with pytest.raises(ValueError, match="context_mm is a distance > 0"):
        InputContract(64, 16, 6, None, None, -1.0)
