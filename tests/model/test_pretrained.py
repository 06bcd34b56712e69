"""`--model.pretrained TAG`: timm's pretrained loading through a Hugging Face cache built here (no network), adapted
to the model's windows, grid and head; a tag that is not cached offline is a clear error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from timm.layers import resample_abs_pos_embed
from timm.models import adapt_input_conv

pytestmark = pytest.mark.slow  # each check builds the model in a fresh process

TAG = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
ROOT = Path(__file__).resolve().parents[2]
# The real `vit-ct` parser and model, in a fresh process: the hub reads its cache folder when it is imported.
SCRIPT = """
import sys, torch
from vit_ct.cli import main
cli = main(["--config", "configs/demo.yaml", "--model.pretrained", sys.argv[1], *sys.argv[3:],
            "--data.init_args.img_size", "64", "--trainer.logger", "false"], run=False)
torch.save({"state": cli.model.state_dict(), "hparams": dict(cli.model.hparams)}, sys.argv[2])
"""


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> tuple[Path, dict]:
    """A Hugging Face cache holding ``TAG``'s file, laid out as the hub writes it (refs/main -> snapshot)."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / f"models--{timm.models.get_pretrained_cfg(TAG).hf_hub_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    torch.manual_seed(0)
    state = timm.create_model(TAG.split(".")[0], pretrained=False).state_dict()
    save_file(state, snapshot / "model.safetensors")
    return home, load_file(snapshot / "model.safetensors")


def _build(tag: str, home: Path, out: Path, *options: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-c", SCRIPT, tag, str(out), *options], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.parametrize("options", [("--model.network.stem", "patch"), ()], ids=["stem-patch", "stem-unset"])
def test_pretrained_tag_loads_from_the_hub_cache_adapted(hub_cache, tmp_path, options):
    """With ``--model.network.stem patch``, or without (the tag's linear patch embedding then builds the patch stem, in
    one line; the default conv stem would have started from scratch)."""
    home, saved = hub_cache
    result = _build(TAG, home, tmp_path / "model.pt", *options)
    assert result.returncode == 0, result.stderr[-3000:]
    saved_model = torch.load(tmp_path / "model.pt", weights_only=False)
    hparams = saved_model["hparams"]  # a checkpoint rebuilds the tag's architecture without the hub
    assert hparams["arch"] == TAG.split(".")[0] and hparams["depth"] is None and "pretrained" not in hparams
    vit = {k.removeprefix("vit."): v for k, v in saved_model["state"].items() if k.startswith("vit.")}
    for name, value in saved.items():
        if name.startswith(("head.", "patch_embed.proj.weight", "pos_embed")):
            continue
        torch.testing.assert_close(vit[name], value, rtol=0, atol=0, msg=name)
    # demo windows: brain + subdural, 2 channels from RGB by timm's rule; 64 px: a 4 x 4 grid from 14 x 14
    torch.testing.assert_close(vit["patch_embed.proj.weight"], adapt_input_conv(2, saved["patch_embed.proj.weight"]))
    grid = resample_abs_pos_embed(saved["pos_embed"], new_size=(4, 4), num_prefix_tokens=1)
    torch.testing.assert_close(vit["pos_embed"], grid)
    assert vit["head.weight"].shape == (2, 192)  # a new head for the two classes
    assert hparams["stem"] == "patch"
    said = f"--model.pretrained {TAG} holds timm's linear patch embedding: the network is built with stem 'patch'"
    assert (said in result.stderr) == (not options)
    fresh = f"--model.pretrained {TAG}: 4 tensors start from a fresh initialisation: the classifier head (2 outputs"
    assert f"{fresh} here, 1000 in the weights); the patch head (not in the weights)" in result.stderr


def test_a_tag_not_in_the_cache_offline_is_a_clear_error(hub_cache, tmp_path):
    home, _ = hub_cache
    result = _build("vit_small_patch16_224.augreg_in21k_ft_in1k", home, tmp_path / "model.pt")
    assert result.returncode != 0
    assert "--model.pretrained vit_small_patch16_224.augreg_in21k_ft_in1k" in result.stderr
    assert "Hugging Face cache" in result.stderr and str(home) in result.stderr
    unknown = _build("vit_nonexistent_patch16.foo", home, tmp_path / "model.pt")
    assert unknown.returncode != 0 and "not a timm pretrained tag" in unknown.stderr
