"""The model's settings by concern: the constructor's groups, the flat names checkpoints keep, and configs in the
grouped shape."""

import inspect
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import yaml

from vit_ct.cli import main
from vit_ct.model.architecture import Network
from vit_ct.task import ViTClassifier
from vit_ct.task.settings import (
    GROUPS,
    GuidingLosses,
    Labels,
    Optimisation,
    flat_config,
    flat_hparams,
    group_of,
    grouped,
    nested,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = Network(img_size=32, in_chans=1, embed_dim=32, depth=2, num_heads=2)


def test_the_model_takes_its_settings_by_concern_in_at_most_twelve_arguments():
    parameters = inspect.signature(ViTClassifier).parameters
    assert len(parameters) <= 12
    assert {"network", "labels", "losses", "optimisation", "maps"} <= set(parameters)
    names = [f.name for kind in GROUPS.values() for f in fields(kind)]
    assert len(names) == len(set(names))  # one flat name per field: checkpoints keep them flat
    assert group_of("lr") == "optimisation" and group_of("depth") == "network" and group_of("weights") is None


def test_grouped_and_flat_construction_build_the_same_model():
    torch.manual_seed(0)
    grouped_model = ViTClassifier(
        network=TINY,
        labels=Labels(label_smoothing=0.1),
        losses=GuidingLosses(patch_loss_weight=1.0, mil_loss_weight=0.5),
        optimisation=Optimisation(lr=1e-3, layer_decay=0.75),
    )
    torch.manual_seed(0)
    flat_model = ViTClassifier.from_hparams(
        img_size=32, in_chans=1, embed_dim=32, depth=2, num_heads=2, label_smoothing=0.1, patch_loss_weight=1.0,
        mil_loss_weight=0.5, lr=1e-3, layer_decay=0.75,
    )  # fmt: skip
    assert dict(grouped_model.hparams) == dict(flat_model.hparams)
    assert grouped_model.hparams.lr == 1e-3 and grouped_model.hparams.mil_loss_weight == 0.5
    assert grouped_model.patch_head is not None and grouped_model.label_smoothing == 0.1
    state, other = grouped_model.state_dict(), flat_model.state_dict()
    assert state.keys() == other.keys() and all(torch.equal(state[k], other[k]) for k in state)
    with pytest.raises(TypeError, match="unknown hyper-parameter.*map_shifts"):
        ViTClassifier.from_hparams(map_shifts=2)


def test_flat_names_round_trip_through_the_groups():
    hparams = flat_hparams(network=TINY, optimisation=Optimisation(lr=0.25))
    assert grouped(hparams)["network"] == TINY and grouped(hparams)["optimisation"].lr == 0.25
    assert nested({"lr": 0.1, "depth": 3, "_instantiator": "x"}) == {
        "optimisation": {"lr": 0.1},
        "network": {"depth": 3},
    }


def test_a_checkpoint_stores_flat_names_and_one_written_before_the_groups_loads(tmp_path):
    """Checkpoints of earlier releases hold flat hyper-parameters and, from the CLI, Lightning's ``_instantiator``;
    they load into the groups as they were built."""
    model = ViTClassifier(network=TINY, optimisation=Optimisation(lr=2e-3))
    checkpoint = {"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}
    assert "lr" in checkpoint["hyper_parameters"] and "optimisation" not in checkpoint["hyper_parameters"]
    checkpoint["hyper_parameters"]["_instantiator"] = "lightning.pytorch.cli.instantiate_module"
    checkpoint["pytorch-lightning_version"] = "2.5.0"
    torch.save(checkpoint, tmp_path / "before.ckpt")
    loaded = ViTClassifier.load_from_checkpoint(tmp_path / "before.ckpt")
    assert dict(loaded.hparams) == dict(model.hparams) and len(loaded.vit.blocks) == 2
    assert torch.equal(loaded.vit.pos_embed, model.vit.pos_embed)
    assert ViTClassifier.load_from_checkpoint(tmp_path / "before.ckpt", lr=1.0).hparams.lr == 1.0  # flat overrides


def test_every_config_states_its_model_in_the_groups():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        model = yaml.safe_load(path.read_text()).get("model") or {}
        stray = [key for key in model if group_of(key) is not None]
        assert not stray, f"{path.name}: model.{stray[0]} belongs under model.{group_of(stray[0])}"
        assert set(model) <= {*GROUPS, "pretrained", "weights"}, path.name
        assert flat_config(model).keys() >= {k for values in model.values() if isinstance(values, dict) for k in values}


def test_the_command_line_sets_a_group_field_and_the_data_links_into_the_groups():
    config = ROOT / "configs" / "demo.yaml"
    cli = main(["--config", str(config), "--trainer.logger", "false", "--model.optimisation.lr", "0.002",
                "--data.init_args.img_size", "64", "--model.network.depth", "1"], run=False)  # fmt: skip
    assert cli.model.hparams.lr == 0.002 and cli.model.hparams.img_size == 64 and len(cli.model.vit.blocks) == 1
    assert cli.model.hparams.patch_loss_weight == 1.0  # the config's group kept beside the typed field
