"""Recording attention from tiny timm ViTs, and explaining them with rollout (Abnar & Zuidema 2020) and
gradient rollout (Chefer et al. 2021): against timm's own logits and attention recomputed by hand."""

import pytest
import timm
import torch
from torch import nn

from vit_ct.explain.attention import attention_modules, num_prefix_tokens, patch_grid, record_attention
from vit_ct.explain.maps import explain_gradient_rollout, explain_rollout
from vit_ct.explain.rollout import attention_rollout, fuse_heads, gradient_rollout

DEPTH, HEADS = 3, 2


def tiny_vit(**kwargs):
    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=8, in_chans=1, embed_dim=32, depth=DEPTH, num_heads=HEADS, num_classes=3)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**args, **kwargs}).eval()


@pytest.fixture
def vit():
    return tiny_vit()


@pytest.fixture
def images():
    return torch.randn(2, 1, 32, 32, generator=torch.Generator().manual_seed(1))


class Wrapper(nn.Module):
    """Stands in for a LightningModule that holds the timm model as an attribute."""

    def __init__(self, vit):
        super().__init__()
        self.model = vit

    def forward(self, x):
        return self.model(x)


def no_hooks(model):
    return all(not m.attn_drop._forward_pre_hooks and not m.attn_drop._forward_hooks for m in attention_modules(model))


def test_records_one_row_stochastic_tensor_per_block(vit, images):
    with record_attention(vit) as attentions:
        vit(images)
    assert len(attentions) == DEPTH
    for a in attentions:
        assert a.shape == (2, HEADS, 17, 17)  # 1 class token + 4 x 4 patches
        assert not a.requires_grad
        assert (a >= 0).all()
        torch.testing.assert_close(a.sum(-1), torch.ones(2, HEADS, 17))


def test_recorded_attention_equals_attention_recomputed_by_hand(vit, images):
    with record_attention(vit) as attentions:
        vit(images)
    tokens = vit.norm_pre(vit._pos_embed(vit.patch_embed(images)))  # (B, T, C)
    for block, recorded in zip(vit.blocks, attentions, strict=True):
        attn = block.attn
        B, T, C = tokens.shape
        qkv = attn.qkv(block.norm1(tokens)).reshape(B, T, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4)
        q, k, _ = qkv.unbind(0)  # (B, heads, T, head_dim)
        expected = (q @ k.transpose(-2, -1) * (C // HEADS) ** -0.5).softmax(-1)  # (B, heads, T, T)
        torch.testing.assert_close(recorded, expected.detach(), rtol=1e-5, atol=1e-6)
        tokens = block(tokens)


def test_logits_inside_equal_logits_outside(vit, images):
    assert all(m.fused_attn for m in attention_modules(vit)), "timm should default to fused attention"
    with torch.no_grad():
        outside = vit(images)
        with record_attention(vit):
            assert not any(m.fused_attn for m in attention_modules(vit))
            inside = vit(images)
    torch.testing.assert_close(inside, outside, rtol=1e-5, atol=1e-6)


def test_restores_flags_and_hooks_on_exit(vit, images):
    modules = attention_modules(vit)
    modules[1].fused_attn = False  # a mixed model gets its own flags back, not all True
    with record_attention(vit) as attentions:
        vit(images)
        vit(images)
    assert len(attentions) == 2 * DEPTH  # one per block per forward pass
    assert [m.fused_attn for m in modules] == [True, False, True]
    assert no_hooks(vit)


def test_restores_flags_and_hooks_after_an_exception(vit, images):
    with pytest.raises(RuntimeError, match="boom"), record_attention(vit):
        vit(images)
        raise RuntimeError("boom")
    assert all(m.fused_attn for m in attention_modules(vit))
    assert no_hooks(vit)


def test_keep_graph_gives_gradients(vit, images):
    with record_attention(vit, keep_graph=True) as attentions:
        logits = vit(images)
    logits[:, 1].sum().backward()
    for a in attentions:
        assert a.requires_grad and a.grad is not None and a.grad.shape == a.shape
        assert a.grad.abs().sum() > 0


@pytest.mark.parametrize("head_fusion", ["mean", "max", "min"])
def test_head_fusion_in_the_hook(vit, images, head_fusion):
    with record_attention(vit) as every_head:
        vit(images)
    with record_attention(vit, head_fusion=head_fusion) as fused:
        vit(images)
    assert [a.shape for a in fused] == [(2, 1, 17, 17)] * DEPTH
    for a, full in zip(fused, every_head, strict=True):
        torch.testing.assert_close(a, fuse_heads(full, head_fusion))


def test_bad_arguments_raise_value_error(vit):
    with pytest.raises(ValueError, match="head_fusion"), record_attention(vit, head_fusion="median"):
        pass
    with pytest.raises(ValueError, match="timm"), record_attention(nn.Linear(3, 3)):
        pass
    with pytest.raises(ValueError, match="img_size"):
        patch_grid(vit, (32, 48))
    assert no_hooks(vit)


def test_finds_the_vit_inside_a_wrapper(vit, images):
    wrapper = Wrapper(vit)
    with record_attention(wrapper) as attentions:
        wrapper(images)
    assert len(attentions) == DEPTH
    assert num_prefix_tokens(wrapper) == 1
    assert patch_grid(wrapper, images.shape) == (4, 4)


def test_register_tokens_count_as_prefix_tokens(images):
    vit = tiny_vit(reg_tokens=2)
    with record_attention(vit) as attentions:
        vit(images)
    assert num_prefix_tokens(vit) == 3
    assert attentions[0].shape == (2, HEADS, 19, 19)
    assert attention_rollout(attentions, num_prefix_tokens=num_prefix_tokens(vit)).shape == (2, 4, 4)


def test_non_square_input_with_dynamic_img_size():
    vit = tiny_vit(dynamic_img_size=True)
    images = torch.randn(2, 1, 32, 48)
    with record_attention(vit) as attentions:
        vit(images)
    grid = patch_grid(vit, images.shape)
    assert grid == (4, 6)
    assert attentions[0].shape == (2, HEADS, 25, 25)
    maps = attention_rollout(attentions, grid_size=grid)
    assert maps.shape == (2, 4, 6)
    torch.testing.assert_close(explain_rollout(vit, images), maps)


@pytest.mark.parametrize("discard_ratio", [0.0, 0.3])
def test_explain_rollout_equals_full_rollout(vit, images, discard_ratio):
    with record_attention(vit) as attentions:
        vit(images)
    expected = attention_rollout(attentions, head_fusion="max", discard_ratio=discard_ratio)
    maps = explain_rollout(vit, images, head_fusion="max", discard_ratio=discard_ratio)
    torch.testing.assert_close(maps, expected)
    assert no_hooks(vit)


def gradient_reference(vit, images, target):
    """Gradient rollout the plain way: keep_graph, backward, read .grad."""
    with record_attention(vit, keep_graph=True) as attentions:
        logits = vit(images)
    logits.gather(1, target[:, None]).sum().backward()
    return gradient_rollout([a.detach() for a in attentions], [a.grad for a in attentions])


def test_explain_gradient_rollout_equals_keep_graph_and_backward(vit, images):
    target = torch.tensor([2, 0])
    maps = explain_gradient_rollout(vit, images, target=target)
    assert maps.shape == (2, 4, 4) and (maps >= 0).all()
    torch.testing.assert_close(maps, gradient_reference(vit, images, target))
    # each image of the batch gets its own gradient
    torch.testing.assert_close(maps[1:], explain_gradient_rollout(vit, images[1:], target=0))


def test_explain_gradient_rollout_defaults_to_top_class(vit, images):
    top = vit(images).argmax(-1)
    torch.testing.assert_close(explain_gradient_rollout(vit, images), explain_gradient_rollout(vit, images, target=top))
    with pytest.raises(ValueError, match="target"):
        explain_gradient_rollout(vit, images, target=3)


def test_explain_gradient_rollout_inside_inference_mode_with_frozen_binary_model(images):
    vit = tiny_vit(num_classes=1)
    for p in vit.parameters():
        p.requires_grad_(False)
    with torch.inference_mode():
        maps = explain_gradient_rollout(Wrapper(vit), images)
    for p in vit.parameters():
        p.requires_grad_(True)
    assert all(p.grad is None for p in vit.parameters())  # autograd.grad leaves parameters alone
    torch.testing.assert_close(maps, gradient_reference(vit, images, torch.tensor([0, 0])))
