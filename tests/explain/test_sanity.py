"""The model-randomisation sanity check (Adebayo et al. 2018): the rank correlation against hand-computed values, the
cascade against timm's own initialisation, the verdict on the shipped weights' rollout (passes) and on maps that do not
read the weights (fail), the caller's model untouched, the numbers repeatable, the command's files."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from conftest import quiet_trainer
from npy_manifest import write_npy_manifest

from vit_ct import ViTClassifier
from vit_ct.data.transforms.model_input import apply_windows, grid_hu
from vit_ct.explain.cascade import cascade, cascade_steps, reinitialise
from vit_ct.explain.maps import explain_rollout
from vit_ct.explain.sanity import maximum_patch, model_randomisation, on_grid, rank_correlation
from vit_ct.review import sanity_command
from vit_ct.sim.cohort import simulate_cohort_patient

SHIPPED = "vit-ct/headct-tiny-256"  # trained: ViT-Ti/16, 6 blocks, conv stem, 256 x 256, two windows


@pytest.fixture(scope="module")
def shipped():
    """The shipped weights and four simulated slices of two patients as the weights read them (image, head)."""
    model = ViTClassifier.from_hparams(pretrained=SHIPPED).eval()
    slices = [s for patient in range(2) for s in simulate_cohort_patient(0, patient, 2, acquire=False)]
    hu = torch.stack([grid_hu(s.hu, 256) for s in slices])  # (4, 1, 256, 256)
    return model, apply_windows({"hu": hu}, model.input_contract.windows)


@pytest.fixture(scope="module")
def rollout_check(shipped):
    model, batch = shipped
    return model_randomisation(model, batch["image"], region=batch["head"], examples=(0, 1))


def test_rank_correlation_of_hand_computed_cases():
    a = torch.tensor([[1.0, 2.0, 2.0, 3.0]])
    assert rank_correlation(a, a).item() == 1.0  # the same map
    assert rank_correlation(a, -a).item() == pytest.approx(-1.0)
    # ranks (1, 2.5, 2.5, 4) and (1, 3, 2, 4): covariance 4.5, variances 4.5 and 5 -> 4.5 / sqrt(22.5)
    assert rank_correlation(a, torch.tensor([[1.0, 3.0, 2.0, 4.0]])).item() == pytest.approx(4.5 / 22.5**0.5)
    # only the region is ranked: outside it the maps disagree
    region = torch.tensor([[True, True, True, False]])
    assert rank_correlation(a, torch.tensor([[1.0, 2.0, 2.0, -9.0]]), region).item() == 1.0
    flat = torch.ones(1, 4)
    assert rank_correlation(flat, flat).item() == 1.0  # both constant: ranked alike
    assert rank_correlation(flat, a).item() == 0.0  # no order to share


def test_maximum_patch_on_a_pixel_map_names_the_patch_holding_it():
    maps = torch.zeros(1, 4, 4)
    maps[0, 3, 0] = 1.0  # pixel (3, 0) of a 2 x 2 patch grid: patch row 1, column 0
    assert maximum_patch(maps, (2, 2)).tolist() == [2]
    region = torch.ones(1, 4, 4, dtype=torch.bool)
    region[0, 3, 0] = False  # outside the region the maximum does not count: the first of the tied rest
    assert maximum_patch(maps, (2, 2), region).tolist() == [0]


def test_a_region_on_a_coarser_grid_holds_a_patch_with_any_pixel_inside():
    head = torch.zeros(1, 1, 4, 4)
    head[0, 0, 1, 1] = 1.0
    assert on_grid(head, (2, 2)).tolist() == [[[True, False], [False, False]]]
    assert on_grid(torch.zeros(1, 4, 4), (2, 2)).all()  # nothing inside: every cell


def test_the_cascade_goes_top_down_and_reaches_every_parameter_once(shipped):
    model, _ = shipped
    steps = cascade_steps(model)
    assert [s.name for s in steps] == ["head", *[f"block {i}" for i in range(5, -1, -1)], "patch embedding",
                                       "position embedding"]  # fmt: skip
    names = [p for s in steps for p in s.parameters(model)]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


def test_a_bare_timm_vit_goes_through_the_cascade_too():
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, embed_dim=32, depth=2, num_heads=2, num_classes=2)
    steps = cascade_steps(vit)
    assert [s.name for s in steps] == ["head", "block 1", "block 0", "patch embedding", "position embedding"]
    assert sorted(p for s in steps for p in s.parameters(vit)) == sorted(n for n, _ in vit.named_parameters())
    check = model_randomisation(vit.eval(), torch.rand(3, 3, 32, 32), explain_rollout)
    assert check.maps.shape == (6, 1, 2, 2)  # steps, examples, patch grid
    # a module beside the ViT in the network (vit-ct's patch head) is re-initialised with the head
    model = ViTClassifier.from_hparams(
        img_size=32, in_chans=1, embed_dim=32, depth=2, num_heads=2, patch_loss_weight=1.0
    )
    assert cascade_steps(model)[0].modules == ("vit.norm", "vit.head", "patch_head")


def test_the_fully_randomised_copy_is_as_timm_initialises_and_the_caller_keeps_its_weights(shipped):
    model, _ = shipped
    before = {k: v.clone() for k, v in model.state_dict().items()}
    *_, (name, randomised) = cascade(model, seed=0)
    assert name == "position embedding"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the caller's weights
    trained, vit = model.vit, randomised.vit
    assert not any(torch.equal(p, q) for p, q in zip(trained.parameters(), vit.parameters(), strict=True))
    # timm's init_weights: LayerNorm weight 1, bias 0; linear biases 0, weights normal std 0.02 (timm truncates at +-2)
    assert torch.equal(vit.blocks[0].norm1.weight, torch.ones(192)) and torch.equal(vit.norm.bias, torch.zeros(192))
    assert torch.equal(vit.blocks[3].attn.qkv.bias, torch.zeros(3 * 192))
    assert vit.blocks[3].mlp.fc1.weight.std().item() == pytest.approx(0.02, abs=0.001)  # cut at +-2, not at 2 std
    assert vit.pos_embed.std().item() == pytest.approx(0.02, abs=0.002) and vit.cls_token.abs().max() < 1e-5
    stem_bn = vit.patch_embed.proj[1]
    assert torch.equal(stem_bn.running_var, torch.ones_like(stem_bn.running_var))  # batch-norm statistics reset


def test_the_cascade_redraws_both_kernels_of_a_model_that_reads_neighbours():
    """With context the first convolution holds its kernels as two tensors: the patch-embedding step redraws both, as
    ``nn.Conv2d`` draws the one convolution (uniform within 1 / sqrt(fan in))."""
    with pytest.warns(UserWarning, match="neighbours 5 mm below and above"):
        model = ViTClassifier.from_hparams(pretrained=SHIPPED, context_mm=5.0).eval()
    first = model.vit.patch_embed.proj[0]
    assert not first.neighbours.any()  # the shipped weights read single slices: zeros on the neighbours
    *_, (_, randomised) = cascade(model, seed=0)
    drawn = randomised.vit.patch_embed.proj[0]
    bound = 1 / (6 * 9) ** 0.5  # 6 channels x 3 x 3
    for trained, fresh in ((first.own, drawn.own), (first.neighbours, drawn.neighbours)):
        assert not torch.equal(trained, fresh) and fresh.abs().max() <= bound and fresh.std() > bound / 3


def test_reinitialising_is_seeded_and_leaves_the_random_state_alone(shipped):
    model, _ = shipped
    head = cascade_steps(model)[1]  # block 5
    copies = [ViTClassifier.from_hparams(pretrained=SHIPPED) for _ in range(3)]
    state = torch.random.get_rng_state()
    for copy, seed in zip(copies, (3, 3, 4), strict=True):
        reinitialise(copy, head, seed=seed)
    assert torch.equal(torch.random.get_rng_state(), state)
    first, again, other = (c.vit.blocks[5].attn.qkv.weight for c in copies)
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_the_rollout_of_trained_weights_passes(rollout_check):
    summary = rollout_check.to_dict()
    assert summary["verdict"] == "PASS" and rollout_check.passed
    trained, last = summary["steps"][0], summary["steps"][-1]
    assert trained["spearman_mean"] == 1.0 and trained["moved"] == 0.0
    assert last["spearman_mean"] < 0.5 and last["moved"] >= 0.5
    # rollout reads no classifier: re-initialising the head alone leaves the map as it was
    assert summary["steps"][1]["step"] == "head" and summary["steps"][1]["spearman_mean"] == pytest.approx(1.0)
    assert json.loads(json.dumps(summary)) == summary  # JSON-able


def test_maps_that_do_not_read_the_weights_fail(shipped):
    model, batch = shipped
    for method, map_fn in (("image", lambda network, x: x[:, 0]), ("head", lambda network, x: batch["head"][:, 0])):
        check = model_randomisation(model, batch["image"], map_fn, region=batch["head"], method=method)
        assert not check.passed and check.first_changed is None, method
        assert all(s.spearman.eq(1.0).all() and not s.moved.any() for s in check.steps), method


def test_rollout_compared_with_the_air_fails_vit_cts_air_is_no_reading(shipped, rollout_check):
    """Outside the head the air-skipping ViT attends nowhere, trained or not: ranked with the air, rollout of a
    random model keeps most of the trained map's ranking, which is why the head is the region."""
    model, batch = shipped
    everywhere = model_randomisation(model, batch["image"])
    assert everywhere.steps[-1].spearman.mean() > rollout_check.steps[-1].spearman.mean() + 0.5


def test_the_check_repeats_exactly_and_draws_its_figure(shipped, rollout_check):
    model, batch = shipped
    again = model_randomisation(model, batch["image"], region=batch["head"], examples=(0, 1))
    assert again.to_dict() == rollout_check.to_dict()  # another seed draws other weights: see the test above
    figure = rollout_check.figure()
    assert len(figure.axes) == 2 * (len(rollout_check.steps) + 1)  # two example rows: the slice, then each step
    assert [ax.get_title().split("\n")[0] for ax in figure.axes[1:11]] == [s.name for s in rollout_check.steps]


def test_the_command_writes_the_numbers_and_the_figure(tmp_path, capsys):
    manifest = write_npy_manifest(tmp_path / "data", train=2, val=2, test=4)
    model = ViTClassifier.from_hparams(img_size=32, in_chans=1, embed_dim=32, depth=2, num_heads=2)
    trainer = quiet_trainer()
    trainer.strategy.connect(model)
    trainer.save_checkpoint(tmp_path / "tiny.ckpt")
    check = sanity_command.main([str(tmp_path / "tiny.ckpt"), "--manifest", str(manifest), "--output_dir",
                                 str(tmp_path / "out"), "--slices", "3"])  # fmt: skip
    written = json.loads((tmp_path / "out" / "sanity.json").read_text())
    assert written["slices"] == 3 and written["split"] == "test" and written["verdict"] == check.to_dict()["verdict"]
    assert [s["step"] for s in written["steps"]] == ["trained", "head", "block 1", "block 0", "patch embedding",
                                                     "position embedding"]  # fmt: skip
    assert (tmp_path / "out" / "sanity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"attention rollout: {written['verdict']} on 3 slices" in capsys.readouterr().out
