"""Maps from labels alone: the multiple-instance loss (patch logits pooled by log-sum-exp into the slice's decision)
and the rollout trained toward the model's own patch evidence on positive slices without a mask, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from vit_ct.model.architecture import Network
from vit_ct.task import ViTClassifier
from vit_ct.task.losses import PatchLosses, evidence_share, lesion_share, mil_logit, mil_loss
from vit_ct.task.settings import GuidingLosses


def test_mil_logit_is_the_log_sum_exp_mean_over_the_patches_that_hold_something():
    z = torch.tensor([[0.0, 0.0, 2.0, 9.0]])
    patches = torch.tensor([[True, True, True, False]])  # the 9 is air: never pooled
    r = 5.0
    expected = math.log((1 + 1 + math.exp(2 * r)) / 3) / r
    assert mil_logit(z, patches, r).item() == pytest.approx(expected, rel=1e-6)
    # r -> 0: the mean; r large: the maximum
    assert mil_logit(z, patches, 1e-4).item() == pytest.approx(2 / 3, abs=1e-3)
    assert mil_logit(z, patches, 200.0).item() == pytest.approx(2.0 - math.log(3) / 200, rel=1e-6)


def test_mil_loss_is_the_bce_of_the_pooled_evidence_on_labelled_slices():
    z = torch.tensor([[0.0, 0.0, 2.0, 0.0], [1.0, -1.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0], [0.0, 0.0, 0.0, 0.0]])
    patches = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    label = torch.tensor([1, 0, -1, 1])  # slice 2 unlabelled, slice 3 nothing but air: neither scored
    pooled = mil_logit(z[:2], patches[:2], 5.0)
    expected = torch.nn.functional.binary_cross_entropy_with_logits(pooled, torch.tensor([1.0, 0.0]))
    assert mil_loss(z, patches, label, 5.0).item() == pytest.approx(expected.item(), rel=1e-6)
    multilabel = torch.tensor([[0, 1], [0, 0], [-1, -1], [1, 0]])  # a lesion where any label is 1
    assert mil_loss(z, patches, multilabel, 5.0).item() == pytest.approx(expected.item(), rel=1e-6)
    assert mil_loss(z, patches, torch.full((4,), -1), 5.0) is None


def test_evidence_share_is_the_detached_softmax_over_the_patches_that_hold_something():
    z = torch.tensor([[0.0, math.log(3.0), 7.0], [1.0, 1.0, 1.0]], requires_grad=True)
    patches = torch.tensor([[True, True, False], [False, False, False]])
    share = evidence_share(z, patches)
    torch.testing.assert_close(share, torch.tensor([[0.25, 0.75, 0.0], [0.0, 0.0, 0.0]]))
    assert not share.requires_grad


def test_a_positive_slice_without_a_mask_trains_the_rollout_toward_its_own_evidence():
    patch = 16
    image = torch.zeros(2, 1, 32, 32)
    image[:, :, :, :16] = 0.5  # the left column of patches holds tissue, the right one air
    batch = {
        "image": image,
        "label": torch.tensor([1, 1]),
        "mask": torch.zeros(2, 1, 32, 32),
        "has_mask": torch.tensor([False, True]),  # slice 1: a mask, empty: not scored at all
    }
    z = torch.tensor([[2.0, 5.0, 0.0, 9.0], [0.0, 0.0, 0.0, 0.0]])  # patch 1 is air: not in the evidence
    attention = torch.eye(5)[None, None].repeat(2, 1, 1, 1)
    attention[:, 0, 0] = torch.tensor([0.2, 0.6, 0.0, 0.2, 0.0])  # class token: itself, patch 0, patch 2
    losses = PatchLosses(patch_size=patch, num_prefix_tokens=1, grid_size=(2, 2), attention_weight=1.0,
                         evidence_attention=True)  # fmt: skip
    ((name, weight, loss),) = losses(batch, z, [attention])
    # evidence over patches 0 and 2 (the tissue): softmax(2, 0) = e^2 / (e^2 + 1), 1 / (e^2 + 1)
    evidence = torch.tensor([math.exp(2) / (math.exp(2) + 1), 0.0, 1 / (math.exp(2) + 1), 0.0])
    # rollout: rownorm(A + I) row 0 = [.6 .3 0 .1 0]: over the patches [.75 0 .25 0]
    expected = -(evidence * torch.tensor([0.75, 1e-6, 0.25, 1e-6]).log()).sum()
    assert name == "attention_loss" and weight == 1.0
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    without = PatchLosses(patch_size=patch, num_prefix_tokens=1, grid_size=(2, 2), attention_weight=1.0)
    assert without(batch, z, [attention])[0][2] is None  # no mask, no evidence: nothing to train the rollout on
    masked = dict(batch, mask=torch.zeros(2, 1, 32, 32), has_mask=torch.tensor([True, False]))
    masked["mask"][0, :, 16:, :16] = 1  # slice 0's lesion in patch 2: the mask wins over the evidence
    share = lesion_share(masked["mask"], patch)
    assert share[0].tolist() == [0.0, 0.0, 1.0, 0.0]


def test_labels_alone_teach_the_patch_head_where_the_lesion_is():
    """MIL on slice labels only (no masks): after a few steps the patch evidence peaks on the bright patch of the
    positive slices, and the loss appears in the model's losses."""
    torch.manual_seed(0)
    model = ViTClassifier(
        network=Network(img_size=32, patch_size=8, in_chans=1, embed_dim=32, depth=2, num_heads=2),
        losses=GuidingLosses(mil_loss_weight=1.0),
    )
    image = 0.3 + 0.05 * torch.rand(16, 1, 32, 32)
    label = torch.tensor([1, 0] * 8)
    where = torch.randint(0, 16, (16,))
    for i in torch.nonzero(label).flatten():
        r, c = divmod(int(where[i]), 4)
        image[i, :, 8 * r : 8 * r + 8, 8 * c : 8 * c + 8] = 0.9  # a bright patch: the "bleed"
    batch = {"image": image, "label": label, "mask": torch.zeros(16, 1, 32, 32), "has_mask": torch.zeros(16).bool()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        loss, _, parts = model.losses(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert "mil_loss" in parts
    with torch.no_grad():
        tokens = model.vit.forward_features(image)
        evidence = model.patch_head(tokens[:, 1:]).squeeze(-1)  # (16, 16)
    hits = (evidence.argmax(dim=1) == where)[label == 1].float().mean()
    assert hits >= 0.75  # chance: 1 / 16
