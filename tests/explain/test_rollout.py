"""Attention rollout (Abnar & Zuidema 2020) and gradient rollout (Chefer et al. 2021) against hand-worked values."""

import pytest
import torch

from vit_ct.explain.rollout import (
    attention_rollout,
    class_token_rollout,
    fuse_heads,
    gradient_rollout,
    joint_attention,
    last_block_attention,
    per_block_maps,
    per_head_maps,
)

ROLLOUTS = [attention_rollout, class_token_rollout]


def random_attentions(blocks=3, B=2, heads=4, T=17, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(B, heads, T, T, generator=generator, dtype=dtype).mul(3).softmax(-1) for _ in range(blocks)]


@pytest.mark.parametrize("rollout", ROLLOUTS)
def test_identity_attention_gives_zero_map(rollout):
    # every token attends only to itself: the class token never reads a patch, so the map is all zeros
    attentions = [torch.eye(17).expand(2, 3, 17, 17) for _ in range(4)]
    torch.testing.assert_close(rollout(attentions), torch.zeros(2, 4, 4))
    torch.testing.assert_close(joint_attention(attentions), torch.eye(17).expand(2, 17, 17))


@pytest.mark.parametrize("rollout", ROLLOUTS)
def test_uniform_attention_gives_uniform_map(rollout):
    # each block is M = (J/T + I) / 2, so M^L = 2^-L I + (1 - 2^-L) J/T: every patch gets (1 - 2^-L) / T
    T, L = 10, 3
    attentions = [torch.full((1, 2, T, T), 1 / T, dtype=torch.float64) for _ in range(L)]
    expected = torch.full((1, 3, 3), (1 - 2**-L) / T, dtype=torch.float64)
    torch.testing.assert_close(rollout(attentions), expected)


@pytest.mark.parametrize("rollout", ROLLOUTS)
def test_two_blocks_worked_by_hand(rollout):
    # T = 3: class token + 2 patches on a 1 x 2 grid, 1 head
    a1 = torch.tensor([[0.2, 0.4, 0.4], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    a2 = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0], [0.5, 0.0, 0.5]])
    # with the identity added and rows renormalised (each row sums to 2, so halve):
    # M1 = [[0.6, 0.2, 0.2], [0, 1, 0], [0, 0, 1]]
    # M2 = [[0.5, 0.5, 0], [0.25, 0.75, 0], [0.25, 0, 0.75]]
    # row 0 of M2 @ M1 = 0.5 * M1[0] + 0.5 * M1[1] = [0.3, 0.6, 0.1]; the patches are [0.6, 0.1]
    attentions = [a1[None, None], a2[None, None]]
    torch.testing.assert_close(rollout(attentions, grid_size=(1, 2)), torch.tensor([[[0.6, 0.1]]]))
    joint = joint_attention(attentions)
    torch.testing.assert_close(joint[0, 0], torch.tensor([0.3, 0.6, 0.1]))


def test_first_block_is_applied_first():
    # reversing the blocks of the hand example changes the map: row 0 of M1 @ M2 = 0.6 M2[0] + 0.2 M2[1] + 0.2 M2[2]
    a1 = torch.tensor([[0.2, 0.4, 0.4], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    a2 = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0], [0.5, 0.0, 0.5]])
    reversed_map = attention_rollout([a2[None, None], a1[None, None]], grid_size=(1, 2))
    torch.testing.assert_close(reversed_map, torch.tensor([[[0.6 * 0.5 + 0.2 * 0.75, 0.2 * 0.75]]]))


@pytest.mark.parametrize("rollout", ROLLOUTS)
@pytest.mark.parametrize("head_fusion", ["mean", "max", "min"])
def test_batch_images_are_independent(rollout, head_fusion):
    attentions = random_attentions(B=3)
    batched = rollout(attentions, head_fusion=head_fusion, discard_ratio=0.3)
    for i in range(3):
        single = rollout([a[i : i + 1] for a in attentions], head_fusion=head_fusion, discard_ratio=0.3)
        torch.testing.assert_close(batched[i : i + 1], single)


def test_discard_zeroes_lowest_patch_weights_per_image_and_keeps_class_token():
    # T = 5: class token + 4 patches; the 16 patch-to-patch weights are distinct, the class token's are the lowest
    patch_block = torch.arange(1.0, 17.0).reshape(4, 4)
    a = torch.full((5, 5), 0.001)
    a[1:, 1:] = patch_block
    second = a.clone()
    second[1:, 1:] = patch_block.flip(0)  # another image: its lowest weights are elsewhere
    attentions = [torch.stack([a, second])[:, None]]
    joint = joint_attention(attentions, discard_ratio=0.25)  # 4 of 16 discarded
    for image, kept in ((0, patch_block > 4), (1, patch_block.flip(0) > 4)):
        off_diagonal = ~torch.eye(4, dtype=torch.bool)  # the identity refills the diagonal
        assert torch.equal(joint[image, 1:, 1:][off_diagonal] > 0, kept[off_diagonal])
        assert (joint[image, 0] > 0).all() and (joint[image, :, 0] > 0).all()


@pytest.mark.parametrize("rollout", ROLLOUTS)
def test_discard_leaves_class_token_row_alone(rollout):
    # one block: the map is the class token's row, which discarding must not touch, however small its weights
    attentions = random_attentions(blocks=1, heads=1)
    attentions[0][:, :, 0] = torch.softmax(torch.tensor([9.0] + [0.0] * 16, dtype=torch.float64), 0)
    torch.testing.assert_close(rollout(attentions, discard_ratio=0.9), rollout(attentions))


@pytest.mark.parametrize("head_fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("discard_ratio", [0.0, 0.5])
def test_intermediate_rollouts_are_row_stochastic(head_fusion, discard_ratio):
    attentions = random_attentions(blocks=4)
    for blocks in range(1, 5):
        joint = joint_attention(attentions[:blocks], head_fusion=head_fusion, discard_ratio=discard_ratio)
        assert (joint >= 0).all()
        torch.testing.assert_close(joint.sum(-1), torch.ones(2, 17, dtype=torch.float64))


def test_head_fusion_by_hand():
    heads = torch.tensor([[[0.5, 0.5], [0.1, 0.9]], [[0.9, 0.1], [0.3, 0.7]]])[None]  # (1, 2, 2, 2)
    torch.testing.assert_close(fuse_heads(heads, "mean"), torch.tensor([[[[0.7, 0.3], [0.2, 0.8]]]]))
    torch.testing.assert_close(fuse_heads(heads, "max"), torch.tensor([[[[0.9, 0.5], [0.3, 0.9]]]]))
    torch.testing.assert_close(fuse_heads(heads, "min"), torch.tensor([[[[0.5, 0.1], [0.1, 0.7]]]]))
    with pytest.raises(ValueError, match="head_fusion"):
        fuse_heads(heads, "median")


@pytest.mark.parametrize("rollout", ROLLOUTS)
@pytest.mark.parametrize("head_fusion", ["mean", "max", "min"])
def test_fused_heads_in_equal_fusing_in_rollout(rollout, head_fusion):
    # what record_attention(head_fusion=...) stores gives the same map as keeping every head
    attentions = random_attentions()
    prefused = [fuse_heads(a, head_fusion) for a in attentions]
    torch.testing.assert_close(rollout(prefused, head_fusion=head_fusion), rollout(attentions, head_fusion=head_fusion))


def test_max_fusion_by_hand():
    # one block, T = 2 (class token + 1 patch). Row 0: max over heads [0.4, 0.7], + I -> [1.4, 0.7] / 2.1;
    # min over heads [0.3, 0.6], + I -> [1.3, 0.6] / 1.9
    heads = torch.tensor([[0.4, 0.6], [0.5, 0.5]]), torch.tensor([[0.3, 0.7], [0.5, 0.5]])
    attentions = [torch.stack(heads)[None]]
    torch.testing.assert_close(attention_rollout(attentions, head_fusion="max"), torch.tensor([[[0.7 / 2.1]]]))
    torch.testing.assert_close(attention_rollout(attentions, head_fusion="min"), torch.tensor([[[0.6 / 1.9]]]))


@pytest.mark.parametrize("head_fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("discard_ratio", [0.0, 0.2])
@pytest.mark.parametrize("num_prefix_tokens", [1, 3])
def test_class_token_path_equals_full_rollout(head_fusion, discard_ratio, num_prefix_tokens):
    # T = 65 = 1 class token + 64 patches (or 3 prefix tokens + 62 patches on a 2 x 31 grid), float32
    grid = (8, 8) if num_prefix_tokens == 1 else (2, 31)
    attentions = random_attentions(blocks=6, heads=3, T=65, dtype=torch.float32)
    kwargs = dict(head_fusion=head_fusion, discard_ratio=discard_ratio, num_prefix_tokens=num_prefix_tokens)
    full = attention_rollout(attentions, grid_size=grid, **kwargs)
    lean = class_token_rollout(attentions, grid_size=grid, **kwargs)
    assert full.shape == (2, *grid)
    torch.testing.assert_close(lean, full, rtol=1e-5, atol=1e-7)


def test_half_precision_is_rolled_out_in_float32():
    attentions = random_attentions(dtype=torch.float32)
    half = attention_rollout([a.bfloat16() for a in attentions])
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, attention_rollout(attentions), rtol=0.05, atol=1e-3)


def test_gradient_rollout_worked_by_hand():
    # the rule only sees grad * A, so A = 1 and the gradients carry the products; T = 3 on a 1 x 2 grid
    ones = torch.ones(1, 1, 3, 3)
    g1 = torch.zeros(1, 1, 3, 3)
    g1[0, 0, 0] = torch.tensor([0.1, 0.2, -0.3])  # relu drops -0.3
    g1[0, 0, 1, 2] = 0.5
    g2 = torch.zeros(1, 1, 3, 3)
    g2[0, 0, 0, 1] = 0.4
    # R1 = I + A1_bar = [[1.1, 0.2, 0], [0, 1, 0.5], [0, 0, 1]]
    # R2 = R1 + A2_bar @ R1, row 0: [1.1, 0.2, 0] + 0.4 * [0, 1, 0.5] = [1.1, 0.6, 0.2]
    maps = gradient_rollout([ones, ones], [g1, g2], grid_size=(1, 2))
    torch.testing.assert_close(maps, torch.tensor([[[0.6, 0.2]]]))
    # a second head whose products are all negative halves every A_bar (mean over heads after relu):
    # R1 = [[1.05, 0.1, 0], [0, 1, 0.25], [0, 0, 1]]; row 0 of R2 = R1[0] + 0.2 * R1[1] = [1.05, 0.3, 0.05]
    two_heads = [torch.ones(1, 2, 3, 3)] * 2
    negative = -torch.ones(1, 1, 3, 3)
    maps = gradient_rollout(two_heads, [torch.cat([g1, negative], 1), torch.cat([g2, negative], 1)], grid_size=(1, 2))
    torch.testing.assert_close(maps, torch.tensor([[[0.3, 0.05]]]))


def test_gradient_rollout_batch_is_independent_and_non_negative():
    attentions = random_attentions(B=3)
    gradients = [torch.randn_like(a) for a in attentions]
    batched = gradient_rollout(attentions, gradients)
    assert (batched >= 0).all()
    for i in range(3):
        single = gradient_rollout([a[i : i + 1] for a in attentions], [g[i : i + 1] for g in gradients])
        torch.testing.assert_close(batched[i : i + 1], single)


def test_review_maps_read_the_class_token_row():
    attentions = random_attentions(blocks=3, heads=4, T=10)  # 1 class token + 9 patches
    per_head = per_head_maps(attentions)
    assert per_head.shape == (2, 4, 3, 3)
    torch.testing.assert_close(per_head, attentions[-1][:, :, 0, 1:].reshape(2, 4, 3, 3))
    torch.testing.assert_close(per_head_maps(attentions, block=0), attentions[0][:, :, 0, 1:].reshape(2, 4, 3, 3))
    per_block = per_block_maps(attentions, head_fusion="max")
    assert per_block.shape == (2, 3, 3, 3)
    for b, a in enumerate(attentions):
        torch.testing.assert_close(per_block[:, b], a[:, :, 0, 1:].amax(1).reshape(2, 3, 3))
    torch.testing.assert_close(last_block_attention(attentions), attentions[-1][:, :, 0, 1:].mean(1).reshape(2, 3, 3))


def test_register_tokens_are_dropped_from_the_map():
    attentions = random_attentions(T=20)  # 1 class token + 3 registers + 16 patches
    maps = attention_rollout(attentions, num_prefix_tokens=4)
    torch.testing.assert_close(maps, joint_attention(attentions, num_prefix_tokens=4)[:, 0, 4:].reshape(2, 4, 4))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(), "square grid"),
        (dict(grid_size=(2, 2)), "grid_size"),
        (dict(grid_size=(2, 3), discard_ratio=1.0), "discard_ratio"),
        (dict(grid_size=(2, 3), head_fusion="median"), "head_fusion"),
        (dict(grid_size=(2, 3), num_prefix_tokens=0), "num_prefix_tokens"),
    ],
)
@pytest.mark.parametrize("rollout", ROLLOUTS)
def test_bad_arguments_raise_value_error(rollout, kwargs, message):
    attentions = random_attentions(T=7)  # 6 patches: not a square
    with pytest.raises(ValueError, match=message):
        rollout(attentions, **kwargs)


def test_bad_attention_shapes_raise_value_error():
    with pytest.raises(ValueError, match="empty"):
        attention_rollout([])
    with pytest.raises(ValueError, match="expected"):
        attention_rollout([torch.ones(2, 17, 17)])
    with pytest.raises(ValueError, match="attentions\\[1\\]"):
        attention_rollout([torch.ones(2, 1, 17, 17), torch.ones(2, 1, 10, 10)])
    with pytest.raises(ValueError, match="gradients"):
        gradient_rollout(random_attentions(), random_attentions()[:2])
