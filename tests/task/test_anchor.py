"""The anchor loss (``anchor_loss_weight``): fine-tuning holds the rollout to the start weights' own, read by a frozen
copy of the start network that is neither trained nor saved; the divergence by hand on a known pair of attentions."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEMO_LEVERS

from vit_ct.explain.rollout import class_token_rollout
from vit_ct.task import ViTClassifier
from vit_ct.task.losses import PatchLosses

BUILT = dict(DEMO_LEVERS, img_size=32, in_chans=1, embed_dim=32, depth=2, num_heads=2, drop_path_rate=0.0)


def _start_weights(tmp_path) -> str:
    """A vit-ct checkpoint to start from, as `vit-ct fit` writes one."""
    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(**BUILT)
    contract = {"img_size": 32, "patch_size": 16, "in_chans": 1, "windows": [[40.0, 80.0]],
                "read_options": {"modalities": ["CT"], "stored_values_are_hu": False}}  # fmt: skip
    path = tmp_path / "start.ckpt"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams), "vit_ct_input": contract,
                "pytorch-lightning_version": "2.6.0", "hparams_name": "kwargs"}, path)  # fmt: skip
    return str(path)


def _batch() -> dict:
    torch.manual_seed(1)
    image = torch.rand(3, 1, 32, 32)
    image[2] = 0.0  # nothing but air: no patch to attend to, not scored
    return {"image": image, "label": torch.tensor([1, 0, 0]), "mask": torch.zeros(3, 1, 32, 32),
            "has_mask": torch.zeros(3, dtype=torch.bool)}  # fmt: skip


def test_the_anchor_loss_is_the_kl_divergence_of_the_rollout_from_the_start_networks():
    held, own = torch.eye(5)[None, None].repeat(1, 1, 1, 1), torch.eye(5)[None, None].repeat(1, 1, 1, 1)
    held[0, 0, 0] = torch.tensor([0.2, 0.4, 0.2, 0.2, 0.0])  # the start network's class token: patches 0, 1, 2
    own[0, 0, 0] = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.2])
    image = torch.full((1, 1, 32, 32), 0.5)
    batch = {"image": image, "label": torch.tensor([0]), "mask": torch.zeros(1, 1, 32, 32),
             "has_mask": torch.tensor([False])}  # fmt: skip
    losses = PatchLosses(patch_size=16, num_prefix_tokens=1, grid_size=(2, 2), anchor_weight=0.5)
    [(name, weight, part)] = losses(batch, None, [own], [held])
    # one block: the rollout of (A + I) / 2, row renormalised, read at the class token's row over the patches
    p = (torch.tensor([0.4, 0.2, 0.2, 0.0]) / 2 + 0) / (0.8 / 2)  # start: 0.5, 0.25, 0.25, 0
    q = torch.tensor([0.1, 0.1, 0.1, 0.2]) / 0.5  # own: 0.2, 0.2, 0.2, 0.4
    expected = sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p.tolist(), q.tolist(), strict=True) if pi)
    assert (name, weight) == ("anchor_loss", 0.5)
    assert part.item() == pytest.approx(expected, rel=1e-5)
    assert losses(batch, None, [held], [held])[0][2].item() == pytest.approx(0.0, abs=1e-6)  # the same: 0
    rollout = class_token_rollout([held], num_prefix_tokens=1, grid_size=(2, 2)).flatten()
    torch.testing.assert_close(rollout / rollout.sum(), p)


def test_fine_tuning_from_start_weights_holds_the_rollout_to_theirs(tmp_path):
    start = _start_weights(tmp_path)
    model = ViTClassifier.from_hparams(
        **BUILT, weights=start, anchor_loss_weight=1.0
    )  # training mode, no dropout of any kind
    batch = _batch()
    assert "anchor_loss" not in model.eval().losses(batch).parts  # a training loss: validation and test leave it out
    model.train()
    # the anchor is the start network, frozen, outside the model's parameters and its checkpoint
    assert not any(name.startswith("anchor") for name in model.state_dict())
    assert {id(p) for p in model.anchor.network.parameters()}.isdisjoint(id(p) for p in model.parameters())
    assert model.losses(batch).parts["anchor_loss"].item() == pytest.approx(0.0, abs=1e-5)  # not moved yet
    with torch.no_grad():
        for block in model.vit.blocks:
            block.attn.qkv.weight.add_(torch.randn_like(block.attn.qkv.weight))
    before = {k: v.clone() for k, v in model.anchor.network.state_dict().items()}
    loss = model.losses(batch)
    assert loss.parts["anchor_loss"].item() > 1e-3  # moved away from the start's rollout: a divergence
    loss.total.backward()
    assert model.vit.blocks[0].attn.qkv.weight.grad.abs().sum() > 0  # it trains the model ...
    assert all(p.grad is None for p in model.anchor.network.parameters())  # ... never the anchor
    assert all(torch.equal(before[k], v) for k, v in model.anchor.network.state_dict().items())
    model.double()  # casts and moves reach the anchor too
    assert next(model.anchor.network.parameters()).dtype == torch.float64


def test_without_start_weights_the_anchor_has_nothing_to_hold_to(tmp_path):
    model = ViTClassifier.from_hparams(
        **BUILT, anchor_loss_weight=1.0
    )  # e.g. a fine-tuned checkpoint loaded to predict
    assert not model.anchor and "anchor_loss" not in model.losses(_batch()).parts
    with pytest.raises(ValueError, match="anchor_loss_weight.*--model.pretrained or --model.weights"):
        model.on_fit_start()
