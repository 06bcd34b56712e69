"""Start weights load into the network they fit, or say what they leave behind: a timm state dict's linear patch
embedding builds the patch stem it fits; tensors left at their fresh initialisation (a stem of another kind, a head
for another number of classes) are named in one warning; architecture arguments the named weights overrule are named."""

from __future__ import annotations

import warnings

import pytest
import timm
import torch
from conftest import DEMO_LEVERS
from npy_manifest import manifest_args, write_npy_manifest
from timm.models import adapt_input_conv

from vit_ct.cli import main
from vit_ct.model.weights import read_as_centre
from vit_ct.task import ViTClassifier

TINY = {**DEMO_LEVERS, "img_size": 32, "in_chans": 1, "embed_dim": 32, "depth": 2, "num_heads": 2}
SHIPPED = "vit-ct/headct-tiny-256"  # ViT-Ti/16 (192 wide), 6 blocks, conv stem, 256 x 256, two windows


@pytest.fixture
def timm_file(tmp_path):
    """A user's timm ViT state dict (``torch.save``): linear patch embedding on RGB, a 1000-class head."""
    torch.manual_seed(0)
    source = timm.create_model("vit_tiny_patch16_224", pretrained=False, embed_dim=32, depth=2, num_heads=2,
                               num_classes=1000, in_chans=3, img_size=64)  # fmt: skip
    path = tmp_path / "timm.pth"
    torch.save(source.state_dict(), path)
    return source.state_dict(), path


def test_a_linear_patch_embedding_builds_the_patch_stem_and_loads_into_it(timm_file):
    state, path = timm_file
    with pytest.warns(UserWarning) as caught:
        model = ViTClassifier.from_hparams(**TINY, weights=str(path))
    said = [str(w.message) for w in caught]
    assert said == [
        f"weights file {path} holds timm's linear patch embedding: the network is built with stem 'patch' so that it"
        " loads (--model.network.stem conv starts a convolutional stem from scratch instead)",
        f"weights file {path}: 4 tensors start from a fresh initialisation: the classifier head (2 outputs here, 1000"
        " in the weights); the patch head (not in the weights)",
    ]
    assert model.hparams.stem == "patch"  # what a checkpoint of it rebuilds
    # the stem is the file's, its RGB kernels summed for one window (timm's rule)
    torch.testing.assert_close(model.vit.patch_embed.proj.weight, adapt_input_conv(1, state["patch_embed.proj.weight"]))
    torch.testing.assert_close(model.vit.patch_embed.proj.bias, state["patch_embed.proj.bias"])
    torch.testing.assert_close(model.vit.blocks[1].attn.qkv.weight, state["blocks.1.attn.qkv.weight"])


def test_a_conv_stem_asked_for_starts_afresh_and_is_named(timm_file):
    state, path = timm_file
    with pytest.warns(UserWarning) as caught:
        model = ViTClassifier.from_hparams(**TINY, stem="conv", weights=str(path))
    fresh = [str(w.message) for w in caught]
    assert len(fresh) == 1 and fresh[0].startswith(
        f"weights file {path}: 30 tensors start from a fresh initialisation:"
    )
    assert "the stem (a convolutional stem; the weights hold timm's linear patch embedding)" in fresh[0]
    assert "the classifier head (2 outputs here, 1000 in the weights)" in fresh[0]
    assert model.hparams.stem == "conv"
    torch.testing.assert_close(model.vit.blocks[0].mlp.fc1.weight, state["blocks.0.mlp.fc1.weight"])


def test_weights_that_fill_every_tensor_load_without_a_word(tmp_path):
    model = ViTClassifier.from_hparams(**TINY)  # conv stem, patch head, two classes
    path = tmp_path / "ours.pt"
    torch.save(model.state_dict(), path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = ViTClassifier.from_hparams(**TINY, weights=str(path))  # its stem is taken from the file
    assert again.hparams.stem == "conv"
    torch.testing.assert_close(again.vit.patch_embed.proj[0].weight, model.vit.patch_embed.proj[0].weight)


def test_the_command_builds_the_stem_a_timm_file_holds(timm_file, tmp_path):
    state, path = timm_file
    manifest = write_npy_manifest(tmp_path / "data", train=2, val=2)
    with pytest.warns(UserWarning, match="holds timm's linear patch embedding: the network is built with stem 'patch'"):
        cli = main(["fit", *manifest_args(manifest), "--trainer.logger", "false", "--trainer.max_epochs", "0",
                    "--model.weights", str(path), "--trainer.default_root_dir", str(tmp_path / "run")])  # fmt: skip
    assert cli.model.hparams.stem == "patch"
    assert (tmp_path / "run" / "config.yaml").is_file()  # the run's files in its own folder, not the working one
    torch.testing.assert_close(
        cli.model.vit.patch_embed.proj.weight, adapt_input_conv(1, state["patch_embed.proj.weight"])
    )


def test_architecture_arguments_the_shipped_weights_overrule_are_named():
    with pytest.warns(UserWarning) as caught:
        model = ViTClassifier.from_hparams(
            pretrained=SHIPPED, img_size=256, in_chans=2, depth=12, embed_dim=384, stem="patch"
        )
    assert [str(w.message) for w in caught] == [
        f"--model.pretrained {SHIPPED} has its own architecture, which the network takes so that the weights fit:"
        " stem conv (stem='patch' was given); embed_dim 192 (embed_dim=384 was given); depth 6 (depth=12 was given)"
    ]
    assert (len(model.vit.blocks), model.vit.embed_dim, model.hparams.stem) == (6, 192, "conv")
    with warnings.catch_warnings():  # the arguments the weights agree with, or left at their defaults: no word
        warnings.simplefilter("error")
        ViTClassifier.from_hparams(pretrained=SHIPPED, img_size=256, in_chans=2, depth=6, stem="conv")


def test_weights_of_single_slices_read_the_slice_itself_in_a_model_with_context():
    """Shipped weights (single slices, two windows) in a model that reads each slice with its neighbours: its first
    convolution holds their kernels on the slice's own channels and zeros on the neighbours', so it starts as they
    read the slice; the contract keeps their windows and says the context."""
    with pytest.warns(UserWarning, match="they read slices with neighbours 5 mm below and above"):
        model = ViTClassifier.from_hparams(pretrained=SHIPPED, context_mm=5.0).eval()
    alone = ViTClassifier.from_hparams(pretrained=SHIPPED).eval()
    contract = model.input_contract
    assert (contract.in_chans, contract.context_mm, contract.windows) == (6, 5.0, alone.input_contract.windows)
    assert model.hparams.in_chans == 6 and model.hparams.context_mm == 5.0
    torch.manual_seed(0)
    image = torch.rand(2, 2, 256, 256)
    image[:, :, :64] = 0.0  # air patches (the shipped network skips them): the same in every slice here
    with torch.no_grad():
        torch.testing.assert_close(model(image.repeat(1, 3, 1, 1)), alone(image), rtol=1e-4, atol=1e-4)


def test_a_tiny_model_with_context_ignores_its_neighbours_at_the_start_and_keeps_them_after_a_save(tmp_path):
    torch.manual_seed(0)
    alone = ViTClassifier.from_hparams(**{**TINY, "in_chans": 2, "mask_air": False}).eval()
    path = tmp_path / "alone.pth"
    torch.save(alone.vit.state_dict(), path)
    settings = {**TINY, "in_chans": 6, "mask_air": False, "context_mm": 2.5}
    with pytest.warns(UserWarning, match="fresh initialisation"):  # the patch head, not in a timm state dict
        model = ViTClassifier.from_hparams(**settings, weights=str(path)).eval()
    kernels = model.vit.patch_embed.proj[0].weight
    torch.testing.assert_close(kernels[:, :2], alone.vit.patch_embed.proj[0].weight)
    assert not kernels[:, 2:].any()
    image = torch.rand(3, 6, 32, 32)
    with torch.no_grad():  # whatever the neighbours hold
        torch.testing.assert_close(model(image), alone(image[:, :2]), rtol=1e-5, atol=1e-5)


def test_an_inflated_start_reads_a_scan_constant_along_its_axis_as_the_weights_read_its_slice(tmp_path):
    """``neighbour_start: inflated``: the slice's kernels a third on each of the three slices read (I3D's inflation),
    so the same slice three times gives the weights' own logits, and a slice whose neighbours differ does not."""
    torch.manual_seed(0)
    alone = ViTClassifier.from_hparams(**{**TINY, "in_chans": 2, "mask_air": False}).eval()
    path = tmp_path / "alone.pth"
    torch.save(alone.vit.state_dict(), path)
    settings = {**TINY, "in_chans": 6, "mask_air": False, "context_mm": 2.5, "neighbour_start": "inflated"}
    with pytest.warns(UserWarning, match="fresh initialisation"):
        model = ViTClassifier.from_hparams(**settings, weights=str(path)).eval()
    own = alone.vit.patch_embed.proj[0].weight
    kernels = model.vit.patch_embed.proj[0].weight
    for k in range(3):
        torch.testing.assert_close(kernels[:, 2 * k : 2 * k + 2], own / 3)
    assert model.hparams.neighbour_start == "inflated"
    image = torch.rand(3, 2, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(image.repeat(1, 3, 1, 1)), alone(image), rtol=1e-5, atol=1e-5)
        darker = torch.cat([image, image / 4, image / 4], dim=1)  # the neighbours hold less: read as less
        difference = model(darker) - alone(image)
        torch.testing.assert_close(model(darker), alone(image / 2), rtol=1e-5, atol=1e-5)  # (1 + 1/4 + 1/4) / 3
        assert difference.abs().max() > 1e-4


@pytest.mark.parametrize(("neighbours", "expected"), [("zeros", [1, 0, 0]), ("inflated", [1 / 3] * 3)])
def test_read_as_centre_spreads_or_zeroes_the_new_neighbours_and_drops_them_when_reading_fewer(neighbours, expected):
    kernel = torch.ones(4, 2, 3, 3)
    wider = read_as_centre(kernel, 2, 6, neighbours=neighbours)
    assert [float(wider[:, 2 * k : 2 * k + 2].mean()) for k in range(3)] == pytest.approx(expected)
    narrower = read_as_centre(torch.cat([kernel, 5 * kernel, 7 * kernel], dim=1), 2, 2, neighbours=neighbours)
    torch.testing.assert_close(narrower, kernel)  # back to one slice: its own kernels, whatever the start rule
