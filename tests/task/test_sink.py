"""The attention sink: air patches masked as keys in the model, rollout over masked and register-token attention
against hand-computed products, and the sink measures (rollout_air, class-token shares, the patch-level floor)."""

import math

import lightning
import pytest
import torch
from conftest import DEMO_LEVERS

from vit_ct.explain.attention import from_full_sequence, record_attention, to_full_sequence
from vit_ct.explain.maps import explain_forward, explain_gradient_rollout
from vit_ct.explain.rollout import attention_rollout, class_token_rollout
from vit_ct.metrics.sink import SinkMetrics, air_patches, class_token_shares, mass_share, patch_level_floor
from vit_ct.model.network import attention_keys
from vit_ct.run.summary import report
from vit_ct.task import ViTClassifier
from vit_ct.task.losses import attention_loss, lesion_share

TINY = {**DEMO_LEVERS, "img_size": 32, "patch_size": 8, "in_chans": 2, "embed_dim": 32, "depth": 2, "num_heads": 2,
        "drop_path_rate": 0.0}  # fmt: skip


def head_slice(B=2):
    """(B, 2, 32, 32) windowed slices: a 'head' in rows 8-31, columns 8-23; patches of row 0 and the outer columns
    hold nothing but air (0 in every window)."""
    image = torch.zeros(B, 2, 32, 32)
    image[:, :, 8:, 8:24] = torch.rand(B, 2, 24, 16, generator=torch.Generator().manual_seed(0)) * 0.9 + 0.05
    return image


AIR = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 1], [1, 0, 0, 1], [1, 0, 0, 1]], dtype=torch.bool)  # of head_slice


def test_attention_keys_are_the_prefix_and_every_patch_above_the_window_floor():
    keys = attention_keys(head_slice(), patch_size=8, num_prefix_tokens=2)
    assert keys.shape == (2, 1, 1, 2 + 16) and keys.dtype == torch.bool
    assert keys[..., :2].all()
    assert torch.equal(keys[0, 0, 0, 2:], ~AIR.flatten())
    one_pixel = torch.zeros(1, 1, 32, 32)
    one_pixel[0, 0, 31, 0] = 0.01  # a single pixel of faint tissue makes its patch a key
    assert attention_keys(one_pixel, 8, 1)[0, 0, 0, 1:].tolist() == [False] * 12 + [True] + [False] * 3


def test_air_patches_get_no_attention_and_no_rollout():
    model = ViTClassifier.from_hparams(**TINY, reg_tokens=2).eval()
    image = head_slice()
    with torch.no_grad(), record_attention(model) as attentions:
        model(image)
    air = torch.cat([torch.zeros(3, dtype=torch.bool), AIR.flatten()])  # of the 19 tokens
    for a in attentions:  # (B, heads, T, T), T = 1 + 2 registers + 16 patches
        torch.testing.assert_close(a.sum(-1), torch.ones(2, 2, 19))
        assert (a[:, :, ~air][..., air] == 0).all()  # no token attends to an air patch
        assert (a[:, :, ~air][..., ~air] > 0).all()
        # an air patch skips the blocks: its row is its own, an identity row
        torch.testing.assert_close(a[:, :, air][..., air], torch.eye(int(air.sum())).expand(2, 2, -1, -1))
        assert (a[:, :, air][..., ~air] == 0).all()
    explained = explain_forward(model, lambda: model(image), image.shape)
    assert (explained.rollout[:, AIR] == 0).all() and (explained.rollout[:, ~AIR] > 0).all()
    torch.testing.assert_close(explained.class_attention.sum(-1), torch.ones(2, 2))
    full = attention_rollout(attentions, num_prefix_tokens=3, grid_size=(4, 4))
    torch.testing.assert_close(explained.rollout, full.float())


def test_logits_do_not_depend_on_anything_at_air_patches():
    """Masked as keys, an air patch's token never reaches another token: its position embedding cannot matter."""
    image = head_slice()
    for mask_air, unchanged in ((True, True), (False, False)):
        model = ViTClassifier.from_hparams(**TINY, mask_air=mask_air).eval()
        with torch.no_grad():
            before = model(image)
            noise = torch.randn(int(AIR.sum()), 32, generator=torch.Generator().manual_seed(2))
            model.vit.pos_embed[0, 1:][AIR.flatten()] += noise  # LayerNorm would cancel a constant shift
            after = model(image)
        assert torch.allclose(before, after, atol=1e-6) is unchanged


def uneven_air():
    """Two slices with different air: the second has a single content patch, so the blocks run it padded with
    air tokens that are masked as keys."""
    image = head_slice()
    image[1] = 0
    image[1, :, 16:24, 8:16] = 0.5
    return image


def test_skipping_air_equals_timm_masked_forward_for_every_token_that_is_a_key():
    """Air patches skip the blocks: the class token and every content patch come out as in timm's forward with air
    masked as keys (where the air tokens do run, as queries nobody reads), and so do the logits."""
    model = ViTClassifier.from_hparams(**TINY, reg_tokens=1).eval()
    image = uneven_air()
    keys = attention_keys(image, 8, model.vit.num_prefix_tokens)
    assert keys.sum(-1).flatten().tolist() == [2 + 6, 2 + 1]
    with torch.no_grad():
        skipped, masked = model.vit.forward_features(image), model.vit.forward_features(image, attn_mask=keys)
        torch.testing.assert_close(skipped[keys[:, 0, 0]], masked[keys[:, 0, 0]])
        torch.testing.assert_close(model(image), model.vit.forward_head(masked))
    # the attention recorded from the shorter sequence is timm's full one on every row of a key token
    with torch.no_grad(), record_attention(model) as ours:
        model(image)
    with torch.no_grad(), record_attention(model.vit) as timms:
        model.vit.forward_features(image, attn_mask=keys)
    for a, b in zip(ours, timms, strict=True):
        rows = keys[:, 0, 0]  # (B, T)
        torch.testing.assert_close(
            a[rows.nonzero(as_tuple=True)[0], :, rows.nonzero(as_tuple=True)[1]],
            b[rows.nonzero(as_tuple=True)[0], :, rows.nonzero(as_tuple=True)[1]],
        )
        torch.testing.assert_close(a.sum(-1), torch.ones_like(a.sum(-1)))


def test_gradient_rollout_and_the_attention_loss_see_through_skipped_air():
    """Gradients taken at the recorded (full-sequence) attention are the model's: gradient rollout equals that of
    timm's masked forward, and the attention loss trains the blocks."""
    model = ViTClassifier.from_hparams(**TINY).eval()
    image = uneven_air()
    keys = attention_keys(image, 8, model.vit.num_prefix_tokens)

    class Masked(torch.nn.Module):  # timm's own masked forward, every token through every block
        def __init__(self, vit):
            super().__init__()
            self.vit = vit

        def forward(self, x):
            return self.vit.forward_head(self.vit.forward_features(x, attn_mask=keys))

    torch.testing.assert_close(
        explain_gradient_rollout(model, image, target=1), explain_gradient_rollout(Masked(model.vit), image, target=1)
    )
    model.train()
    batch = {
        "image": image,
        "label": torch.tensor([1, 1]),
        "mask": torch.zeros(2, 1, 32, 32),
        "has_mask": torch.tensor([True, True]),
    }
    batch["mask"][:, :, 16:24, 8:16] = 1
    _, _, parts = model.losses(batch)
    assert parts["attention_loss"] > 0
    model.losses(batch)[0].backward()
    assert model.vit.blocks[0].attn.qkv.weight.grad.abs().sum() > 0


def test_attention_on_a_token_subset_goes_to_the_full_sequence_by_hand():
    # tokens 0..3; the blocks ran tokens 0 and 2 (in that order): their 2 x 2 attention lands on rows and columns 0
    # and 2, tokens 1 and 3 get identity rows and zero columns
    a = torch.tensor([[0.25, 0.75], [0.6, 0.4]])[None, None]
    full = to_full_sequence(a, torch.tensor([[0, 2]]), 4)
    expected = torch.tensor([[0.25, 0, 0.75, 0], [0, 1, 0, 0], [0.6, 0, 0.4, 0], [0, 0, 0, 1]])
    torch.testing.assert_close(full, expected[None, None])
    torch.testing.assert_close(from_full_sequence(full, torch.tensor([[0, 2]])), a)
    # another order: the blocks ran tokens 3 and 0
    full = to_full_sequence(a, torch.tensor([[3, 0]]), 4)
    expected = torch.tensor([[0.4, 0, 0, 0.6], [0, 1, 0, 0], [0, 0, 1, 0], [0.75, 0, 0, 0.25]])
    torch.testing.assert_close(full, expected[None, None])


def test_masked_forward_with_and_without_checkpointing():
    model = ViTClassifier.from_hparams(**TINY, mask_air=True)
    image = uneven_air()
    model.train()
    plain = model(image).sum()
    grads = torch.autograd.grad(plain, model.vit.pos_embed)[0]
    model.vit.set_grad_checkpointing(True)
    checkpointed = model(image).sum()
    torch.testing.assert_close(checkpointed, plain)
    torch.testing.assert_close(torch.autograd.grad(checkpointed, model.vit.pos_embed)[0], grads)


def test_a_checkpoint_from_before_mask_air_runs_unmasked(tmp_path):
    model = ViTClassifier.from_hparams(**TINY)
    hparams = {k: v for k, v in dict(model.hparams).items() if k != "mask_air"}
    path = tmp_path / "old.ckpt"
    torch.save(
        {
            "state_dict": model.state_dict(),
            "hyper_parameters": hparams,
            "pytorch-lightning_version": lightning.__version__,
        },
        path,
    )
    assert ViTClassifier.load_from_checkpoint(path).hparams.mask_air is False
    new = tmp_path / "new.ckpt"
    torch.save({**torch.load(path, weights_only=True), "hyper_parameters": dict(model.hparams)}, new)
    assert ViTClassifier.load_from_checkpoint(new).hparams.mask_air is True


def test_rollout_through_masked_attention_by_hand():
    # tokens: class, patch 1, patch 2 (air: a masked key, so its column is 0)
    a = torch.tensor([[0.5, 0.5, 0.0], [0.25, 0.75, 0.0], [0.4, 0.6, 0.0]])[None, None]
    # rownorm(A + I): [.75 .25 0], [.125 .875 0], [.2 .3 .5]; one block: row 0; two: .75 r0 + .25 r1
    for blocks, expected in ((1, [0.25, 0.0]), (2, [0.40625, 0.0])):
        rollout = class_token_rollout([a] * blocks, num_prefix_tokens=1, grid_size=(1, 2))
        torch.testing.assert_close(rollout, torch.tensor([[expected]]))
        torch.testing.assert_close(attention_rollout([a] * blocks, grid_size=(1, 2)), rollout)


def test_rollout_keeps_register_tokens_as_nodes_by_hand():
    # tokens: class, register, patch 1, patch 2; the class token reaches patch 2 only through the register
    a = torch.tensor([[0.2, 0.6, 0.2, 0.0], [0.0, 0.2, 0.4, 0.4], [0.1, 0.1, 0.8, 0.0], [0.0, 0.0, 0.5, 0.5]])
    a = a[None, None]
    # rownorm(A + I) = (A + I) / 2: r0 = [.6 .3 .1 0], r1 = [0 .6 .2 .2], r2 = [.05 .05 .9 0]
    # two blocks: r0 @ (A + I) / 2 = .6 r0 + .3 r1 + .1 r2 = [.365 .365 .21 .06]
    rollout = class_token_rollout([a, a], num_prefix_tokens=2, grid_size=(1, 2))
    torch.testing.assert_close(rollout, torch.tensor([[[0.21, 0.06]]]))
    torch.testing.assert_close(attention_rollout([a, a], num_prefix_tokens=2, grid_size=(1, 2)), rollout)
    prefix, on_air = class_token_shares(a[:, 0, :1], torch.tensor([[[False, True]]]), num_prefix_tokens=2)
    assert prefix.item() == pytest.approx(0.8) and on_air.item() == pytest.approx(0.0)  # 0.2 self + 0.6 register
    _, on_air = class_token_shares(a[:, 0, :1], torch.tensor([[[True, False]]]), num_prefix_tokens=2)
    assert on_air.item() == pytest.approx(0.2)


def test_air_patches_mass_share_and_patch_level_floor_by_hand():
    head = torch.zeros(1, 1, 4, 4)
    head[0, 0, 1, 1] = 1  # one head pixel, in the top-left 2 x 2 patch
    assert air_patches(head, (2, 2)).tolist() == [[[False, True], [True, True]]]
    maps = torch.tensor([[[3.0, 1.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]])
    where = torch.tensor([[[False, True], [False, False]]] * 2)
    assert mass_share(maps, where).tolist() == [0.25, 0.0]  # a map that is zero everywhere puts nothing anywhere
    mask = torch.zeros(1, 4, 4)
    mask[0, :2, :2] = 1  # the top-left patch, whole
    # pooled [[1, 0], [0, 0]], bilinear to 4 x 4 (half-pixel centres): the outer product of [1, .75, .25, 0]
    ramp = torch.tensor([1.0, 0.75, 0.25, 0.0])
    torch.testing.assert_close(patch_level_floor(mask, 2), torch.outer(ramp, ramp)[None])


def test_sink_metrics_average_by_hand():
    metric = SinkMetrics(num_blocks=2)
    rollout = torch.tensor([[[1.0, 1.0], [2.0, 0.0]], [[0.0, 4.0], [0.0, 0.0]]])  # (2, 2, 2) patch grid
    heat = torch.ones(2, 4, 4)
    head = torch.ones(2, 4, 4)
    head[:, :2, :2] = 0  # the top-left patch is air; 4 of 16 pixels outside the head
    mask = torch.zeros(2, 4, 4)
    mask[0, 2:, 2:] = 1
    class_attention = torch.tensor([[[0.5, 0.5, 0, 0, 0], [0.1, 0.2, 0.3, 0.4, 0]]]).expand(2, 2, 5)
    metric.update(
        rollout, heat, class_attention, head, mask, torch.tensor([True, False]), num_prefix_tokens=1, patch_size=2
    )
    values = metric.compute()
    assert values["rollout_air"].item() == pytest.approx((0.25 + 0.0) / 2)
    assert values["cls_prefix_block0"].item() == pytest.approx(0.5) and values["cls_air_block0"].item() == 0.5
    assert values["cls_prefix_block1"].item() == pytest.approx(0.1) and values[
        "cls_air_block1"
    ].item() == pytest.approx(0.2)
    assert values["rollout_outside_head"].item() == pytest.approx(4 / 16)  # slice 0 only: it has a lesion
    # the floor: pooled [[0, 0], [0, 1]] upsampled is the outer product of [0, .25, .75, 1] (sum 4); the air pixels
    # hold .25 * .25 of it
    assert values["rollout_outside_head_floor"].item() == pytest.approx(0.0625 / 4)
    assert values["slices"].item() == 2 and values["lesion_slices"].item() == 1


def _attention_loss(attentions, batch, target):
    share, scored = lesion_share(batch["mask"], 16), batch["has_mask"] & batch["mask"].flatten(1).any(dim=1)
    return attention_loss(attentions, share, scored, num_prefix_tokens=1, grid_size=(2, 2), target=target)


def test_attention_loss_is_the_cross_entropy_of_the_class_token_row_by_hand():
    mask = torch.zeros(2, 1, 32, 32)
    mask[0, 0, :16, :16] = 1  # the whole first patch
    mask[0, 0, :4, 16:32] = 1  # a quarter of the second
    batch = {"mask": mask, "has_mask": torch.tensor([True, True])}  # slice 1: empty mask, not scored
    row = torch.tensor([0.2, 0.4, 0.1, 0.2, 0.1])  # class, 4 patches
    attention = torch.zeros(2, 1, 5, 5)
    attention[:, 0, 0] = row
    # target: patch shares 1 : 0.25 -> 0.8, 0.2
    expected = -(0.8 * torch.log(torch.tensor(0.4)) + 0.2 * torch.log(torch.tensor(0.1)))
    loss = _attention_loss([attention, attention], batch, "class_token")
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    batch["has_mask"][:] = False
    assert _attention_loss([attention], batch, "class_token") is None


def test_attention_loss_on_the_rollout_by_hand():
    mask = torch.zeros(1, 1, 32, 32)
    mask[0, 0, :16, :16] = 1
    mask[0, 0, :4, 16:32] = 1  # target shares 0.8, 0.2, 0, 0
    batch = {"mask": mask, "has_mask": torch.tensor([True])}
    attention = torch.eye(5)[None, None].clone()  # patches attend to themselves
    attention[0, 0, 0] = torch.tensor([0.5, 0.25, 0.25, 0.0, 0.0])
    # rownorm(A + I) row 0 = [.75 .125 .125 0 0]: over the patches [.5 .5 0 0] -> cross-entropy log 2
    assert _attention_loss([attention], batch, "rollout").item() == pytest.approx(math.log(2), rel=1e-6)


def test_attention_loss_pulls_the_class_token_towards_the_lesion():
    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(**{**TINY, "attention_loss_weight": 1.0, "patch_loss_weight": 0.0})
    image = head_slice(4)
    mask = torch.zeros(4, 1, 32, 32)
    mask[:, 0, 16:24, 8:16] = 1  # patch (2, 1)
    batch = {"image": image, "mask": mask, "has_mask": torch.ones(4, dtype=torch.bool), "label": torch.ones(4).long()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def on_lesion() -> float:
        model.eval()
        explained = explain_forward(model, lambda: model(image), image.shape)
        return float(explained.rollout[:, 2, 1].sum() / explained.rollout.sum())

    before = on_lesion()
    model.train()
    for _ in range(30):
        loss, _, parts = model.losses(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert "attention_loss" in parts
    assert on_lesion() > before + 0.2


def test_demo_report_states_the_sink_beside_its_floor(tmp_path):
    metrics = {"test/auroc": 0.9, "test/rollout_air": 0.0, "test/rollout_outside_head": 0.165}
    metrics["test/rollout_outside_head_floor"] = 0.131
    text = report(tmp_path, {"metrics": metrics})
    assert "rollout on air patches 0.0%; outside the head 16.5% (a perfect patch-level map: 13.1%)" in text
    assert "attention sink" not in report(tmp_path, {"metrics": {"test/auroc": 0.9}})


def test_every_token_features_runs_every_token_through_the_blocks_at_the_same_logits():
    """The reference the skipping is timed against (benchmarks/air_tokens.py) and Grad-CAM reads: air masked as keys,
    but air tokens run through the blocks, with real attention rows."""
    model = ViTClassifier.from_hparams(**TINY).eval()
    image = head_slice()
    with torch.no_grad(), record_attention(model, head_fusion="mean") as attentions:
        logits = model.vit.forward_head(model.vit.forward_features_every_token(image))
    torch.testing.assert_close(logits, model(image).detach())
    rows = attentions[0][0, 0, 1:][AIR.flatten()]  # the air tokens' own rows: real attention, not identity rows
    assert (rows[:, 1:][:, ~AIR.flatten()] > 0).all()
