"""ViTClassifier: the timm network it wraps, its losses, optimiser groups, schedule and weight loading."""

from pathlib import Path

import pytest
import timm
import torch
from conftest import DEMO_LEVERS
from timm.layers import DropPath

from vit_ct import CTSliceDataModule
from vit_ct.cli import main
from vit_ct.task import ViTClassifier
from vit_ct.task.losses import patch_loss
from vit_ct.task.optim import warmup_cosine

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")
TINY = {**DEMO_LEVERS, "img_size": 32, "in_chans": 1, "embed_dim": 32, "depth": 2, "num_heads": 2}


def test_default_is_a_plain_vit_as_timm_builds_its_arch():
    model = ViTClassifier()  # seeing as the data modules' defaults do: 192 x 192, two windows
    plain = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=2, img_size=192)
    vit = model.vit
    shapes = {k: v.shape for k, v in vit.state_dict().items() if not k.startswith("patch_embed.")}
    assert shapes == {k: v.shape for k, v in plain.state_dict().items() if not k.startswith("patch_embed.")}
    assert vit.patch_embed.grid_size == (12, 12) and vit.patch_embed.proj[0].in_channels == 2
    assert len(vit.blocks) == 12 and vit.num_prefix_tokens == 1 and vit.cls_token is not None
    assert isinstance(vit.pos_embed, torch.nn.Parameter) and vit.pos_embed.requires_grad  # learnable
    assert vit.blocks[0].norm1 is not None  # pre-norm blocks
    assert vit.blocks[0].attn.scale == pytest.approx(vit.blocks[0].attn.head_dim ** -0.5)  # 1/sqrt(d_k)
    assert all(isinstance(block.drop_path1, torch.nn.Identity) for block in vit.blocks)  # no stochastic depth
    # the classification loss alone: no patch head, no attention recorded for a loss
    assert model.patch_head is None and model.patch_losses.attention_weight == 0.0


def test_the_demo_config_builds_the_demo_model():
    """configs/demo.yaml states its recipe: 6 blocks at 192 x 192 with the data module's brain and subdural windows,
    stochastic depth, the patch head and the attention loss on the masks."""
    model = main(["--config", DEMO, "--trainer.logger", "false"], run=False).model
    vit = model.vit
    assert len(vit.blocks) == 6 and vit.embed_dim == 192 and vit.pos_embed.shape == (1, 145, 192)  # 12 x 12 patches
    assert vit.patch_embed.proj[0].in_channels == 2 and model.hparams.stem == "conv"
    assert model.patch_head is not None and model.patch_losses.attention_weight == 1.0
    assert isinstance(vit.blocks[-1].drop_path1, DropPath) and vit.blocks[-1].drop_path1.drop_prob == pytest.approx(0.1)
    data = CTSliceDataModule("m.csv")  # the data module's defaults prepare the demo model's input
    assert (data.img_size, data.num_channels) == (model.hparams.img_size, model.hparams.in_chans) == (192, 2)
    assert data.windows == [(40.0, 80.0), (80.0, 200.0)]


def test_logits_equal_timm_own_model():
    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(
        **{**TINY, "in_chans": 3, "drop_path_rate": 0.0}, stem="patch", num_classes=4
    ).eval()
    reference = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        num_classes=4,
        in_chans=3,
        img_size=32,
        embed_dim=32,
        depth=2,
        num_heads=2,
    ).eval()
    reference.load_state_dict(model.vit.state_dict())
    x = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(model(x), reference(x))


def test_attention_dropout_is_after_softmax():
    model = ViTClassifier.from_hparams(**TINY, attn_drop_rate=0.25)
    assert model.vit.blocks[0].attn.attn_drop.p == 0.25


def _batch(B=4, size=32, lesion=True):
    mask = torch.zeros(B, 1, size, size)
    label = torch.tensor([1, 0] * (B // 2))
    if lesion:
        mask[label == 1, :, 2:6, 2:6] = 1
    return {
        "image": torch.rand(B, 1, size, size),
        "mask": mask,
        "has_mask": torch.ones(B, dtype=torch.bool),
        "label": label,
        "index": torch.arange(B),
        "source_shape": torch.tensor([[size, size]] * B),
    }


def _patch_loss(batch: dict, logit: float) -> torch.Tensor | None:
    """The patch loss of ``batch`` with every patch's logit at ``logit`` (2 x 2 patches of 16 px per slice)."""
    logits = torch.full((len(batch["label"]), 4), logit)
    return patch_loss(logits, batch["mask"], batch["has_mask"], batch["label"], patch_size=16)


def test_patch_loss_targets_the_lesion_patches():
    batch = _batch()
    # All patch logits 0 -> BCE = log 2 whatever the target.
    assert _patch_loss(batch, 0.0).item() == pytest.approx(torch.log(torch.tensor(2.0)).item(), rel=1e-5)
    # every patch says "no blood": lesion and lesion-free patches weigh half each, the 2 lesion patches cost 20 each,
    # the 14 others ~0
    assert _patch_loss(batch, -20.0).item() == pytest.approx(0.5 * 20.0, rel=1e-3)


def test_patch_loss_skips_positive_slices_without_mask():
    batch = _batch()
    batch["has_mask"][:] = False
    assert _patch_loss(batch, -20.0).item() < 1e-6  # only the lesion-free (empty-mask) slices count
    batch["label"][:] = 1
    assert _patch_loss(batch, -20.0) is None


def test_the_model_adds_its_patch_head_loss_weighted():
    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(
        **{**TINY, "patch_loss_weight": 0.5, "attention_loss_weight": 0.0, "drop_path_rate": 0.0}
    )
    batch = _batch()
    total, logits, parts = model.losses(batch)
    tokens = model.vit.forward_features(batch["image"])
    patch_logits = model.patch_head(tokens[:, 1:]).squeeze(-1)
    expected = patch_loss(patch_logits, batch["mask"], batch["has_mask"], batch["label"], 16)
    torch.testing.assert_close(parts["patch_loss"], expected.detach())
    torch.testing.assert_close(total, parts["cls_loss"] + 0.5 * parts["patch_loss"])


def test_no_weight_decay_on_norms_biases_and_embeddings():
    model = ViTClassifier.from_hparams(**TINY)
    groups = model.param_groups()
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert id(model.vit.pos_embed) not in decayed and id(model.vit.cls_token) not in decayed
    assert id(model.vit.blocks[0].norm1.weight) not in decayed and id(model.vit.head.bias) not in decayed
    assert id(model.vit.blocks[0].attn.qkv.weight) in decayed
    n_params = sum(len(g["params"]) for g in groups)
    assert n_params == len(list(model.parameters()))


def test_layer_decay_scales_early_blocks_down():
    model = ViTClassifier.from_hparams(**TINY, layer_decay=0.5, lr=1.0)
    lrs = {id(p): g.get("lr", 1.0) for g in model.param_groups() for p in g["params"]}
    assert lrs[id(model.vit.head.weight)] == pytest.approx(1.0)
    assert lrs[id(model.vit.blocks[1].attn.qkv.weight)] == pytest.approx(0.5)
    assert lrs[id(model.vit.blocks[0].attn.qkv.weight)] == pytest.approx(0.25)


def test_the_neighbours_kernels_of_a_model_with_context_step_at_the_peak_rate_whatever_the_layer_decay():
    """With context the first convolution's kernels are two tensors (the slice's own, the neighbours'): the slice's
    at the stem's layer-decayed rate, the neighbours' at the peak rate. Adam's first step moves every element with a
    gradient by its group's rate, which the step below checks; the network is still the one convolution."""
    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(**{**TINY, "in_chans": 3, "context_mm": 2.0}, layer_decay=0.5, lr=1e-3,
                                       weight_decay=0.0)  # fmt: skip
    first = model.vit.patch_embed.proj[0]
    assert (first.own.shape[1], first.neighbours.shape[1], first.weight.shape[1]) == (1, 2, 3)
    stored = {k for k in model.state_dict() if k.startswith("vit.patch_embed.proj.0.")}
    assert stored == {"vit.patch_embed.proj.0.weight"}  # one convolution's tensor, as before
    groups = model.param_groups()
    rates = {id(p): g.get("lr", 1e-3) for g in groups for p in g["params"]}
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    assert rates[id(first.neighbours)] == pytest.approx(1e-3)
    assert rates[id(first.own)] == pytest.approx(1e-3 * 0.5**3)  # below block 0 of 2: 0.5 ** (2 + 1)
    before = first.own.detach().clone(), first.neighbours.detach().clone()
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    image = torch.rand(4, 3, 32, 32)
    torch.nn.functional.cross_entropy(model(image), torch.tensor([0, 1, 0, 1])).backward()
    optimizer.step()
    for tensor, start, rate in ((first.own, before[0], 1e-3 / 8), (first.neighbours, before[1], 1e-3)):
        moved = (tensor.detach() - start).abs()
        torch.testing.assert_close(moved[moved > 0], torch.full_like(moved[moved > 0], rate), rtol=1e-3, atol=0)
        assert (moved > 0).float().mean() > 0.9


def test_warmup_cosine_schedule():
    f = warmup_cosine(4, 14)
    assert [round(f(s), 3) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.5)
    assert f(14) == pytest.approx(0.0, abs=1e-12)


def test_probabilities_by_task():
    logits = torch.tensor([[0.0, 0.0], [0.0, 2.0]])
    binary = ViTClassifier.from_hparams(**TINY)
    torch.testing.assert_close(binary.probabilities(logits), torch.tensor([0.5, torch.sigmoid(torch.tensor(2.0))]))
    multilabel = ViTClassifier.from_hparams(**TINY, multilabel=True)
    torch.testing.assert_close(multilabel.probabilities(logits), logits.sigmoid())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_classes": 1}, "num_classes"),
        ({"img_size": 40}, "multiple of patch_size"),
        ({"class_names": ["a"]}, "class_names"),
        ({"class_weights": [1.0, 2.0, 3.0]}, "class_weights"),
        ({"arch": "resnet18"}, "not a timm Vision Transformer"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ViTClassifier.from_hparams(**{**TINY, **kwargs})


def saved_timm_vit(tmp_path, **kwargs):
    """A tiny timm ViT (seeded) and the path of its state dict saved with torch.save, as a user's timm file."""
    torch.manual_seed(0)
    source = timm.create_model("vit_tiny_patch16_224", pretrained=False, embed_dim=32, depth=2, num_heads=2, **kwargs)
    path = tmp_path / "timm.pth"
    torch.save(source.state_dict(), path)
    return source, path


def test_weights_from_timm_state_dict_adapt_channels_grid_and_head(tmp_path):
    source, path = saved_timm_vit(tmp_path, num_classes=1000, in_chans=3, img_size=64)
    model = ViTClassifier.from_hparams(**TINY, stem="patch", num_classes=2, weights=str(path))
    state = source.state_dict()
    torch.testing.assert_close(model.vit.blocks[1].mlp.fc1.weight, state["blocks.1.mlp.fc1.weight"])
    # RGB kernels summed into one channel
    torch.testing.assert_close(model.vit.patch_embed.proj.weight, state["patch_embed.proj.weight"].sum(1, keepdim=True))
    assert model.vit.pos_embed.shape == (1, 5, 32)  # 4x4 grid -> 2x2 grid, class token kept
    torch.testing.assert_close(model.vit.pos_embed[:, 0], state["pos_embed"][:, 0])
    assert model.vit.head.weight.shape == (2, 32)  # 1000-class head re-initialised


def test_weights_from_vit_ct_checkpoint_and_bad_files(tmp_path):
    torch.manual_seed(0)
    trained = ViTClassifier.from_hparams(**TINY)
    ckpt = tmp_path / "model.ckpt"
    torch.save({"state_dict": trained.state_dict(), "hyper_parameters": dict(trained.hparams)}, ckpt)
    fresh = ViTClassifier.from_hparams(**TINY, weights=str(ckpt)).eval()
    x = torch.randn(2, 1, 32, 32)
    torch.testing.assert_close(fresh(x), trained.eval()(x))
    torch.testing.assert_close(fresh.patch_head.weight, trained.patch_head.weight)
    with pytest.raises(ValueError, match="does not exist"):
        ViTClassifier.from_hparams(**TINY, weights=str(tmp_path / "missing.ckpt"))
    other = tmp_path / "other.ckpt"
    torch.save(ViTClassifier.from_hparams(**{**TINY, "embed_dim": 64}).state_dict(), other)
    with pytest.raises(ValueError, match="does not fit"):
        ViTClassifier.from_hparams(**TINY, weights=str(other))


def test_weights_never_execute_pickled_code(tmp_path):
    class Payload:
        def __reduce__(self):
            return (exec, ("import pathlib; pathlib.Path('%s').write_text('pwned')" % (tmp_path / "pwned"),))

    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": ViTClassifier.from_hparams(**TINY).state_dict(), "payload": Payload()}, path)
    with pytest.raises(ValueError, match="cannot read"):
        ViTClassifier.from_hparams(**TINY, weights=str(path))
    assert not (tmp_path / "pwned").exists()


def test_conv_stem_keeps_the_token_grid_and_loads_timm_blocks(tmp_path):
    source, path = saved_timm_vit(tmp_path, num_classes=2, in_chans=1, img_size=32)
    model = ViTClassifier.from_hparams(**TINY, stem="conv", weights=str(path))
    assert model.vit.patch_embed.grid_size == (2, 2) and model.vit.patch_embed.patch_size == (16, 16)
    tokens = model.vit.patch_embed(torch.randn(3, 1, 32, 32))
    assert tokens.shape == (3, 4, 32)  # one token per 16x16 patch, as the linear embedding
    # Everything but the (different) patch embedding comes from the file.
    torch.testing.assert_close(model.vit.blocks[0].attn.qkv.weight, source.blocks[0].attn.qkv.weight)
    torch.testing.assert_close(model.vit.pos_embed, source.pos_embed)


def test_label_weights_need_multilabel_outputs_of_the_same_number():
    with pytest.raises(ValueError, match="label_weights"):
        ViTClassifier.from_hparams(
            embed_dim=32, depth=1, num_heads=2, img_size=32, label_weights=[1.0, 2.0]
        )  # not multi-label
    with pytest.raises(ValueError, match="label_weights"):
        ViTClassifier.from_hparams(embed_dim=32, depth=1, num_heads=2, img_size=32, multilabel=True, num_classes=3,
                      label_weights=[1.0, 2.0])  # fmt: skip
    model = ViTClassifier.from_hparams(embed_dim=32, depth=1, num_heads=2, img_size=32, multilabel=True, num_classes=2,
                          label_weights=[1.0, 2.0])  # fmt: skip
    assert "weighted_log_loss" in model.metrics["val"]
    assert "weighted_log_loss" not in ViTClassifier.from_hparams(embed_dim=32, depth=1, num_heads=2, img_size=32,
                                                        multilabel=True, num_classes=2).metrics["val"]  # fmt: skip
