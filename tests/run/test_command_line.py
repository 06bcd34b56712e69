"""What the ``vit-ct`` command says and how fast it answers: the overview and each subcommand's own options, a missing
option named before any model is built, a fit's figures printed once, true lines about shipped weights, and the
commands that need no torch importing none (the mechanism behind the start-up figures of benchmarks/startup.py)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pytest
import torch
from conftest import DEMO_LEVERS, quiet_trainer
from npy_manifest import DEMO, MANIFEST, manifest_args, write_npy_manifest
from wandb_records import history_and_config

from vit_ct.cli import main
from vit_ct.run.learning_rate import _rates_by_schedule
from vit_ct.run.summary import metric_lines, report
from vit_ct.task.classifier import ViTClassifier

ROOT = Path(__file__).resolve().parents[2]
VIT_CT = str(Path(sys.executable).with_name("vit-ct"))
HEAVY = ("torch", "lightning", "timm", "monai", "wandb", "pandas")  # what a help text must not wait for
NO_LOGGER = ["--trainer.logger", "false"]


def _run(*command: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", **env}
    return subprocess.run(list(command), cwd=cwd, env=environment, capture_output=True, text=True, timeout=600)


def _imported(*command: str) -> set[str]:
    """The top-level packages a command imported: read from ``python -X importtime``'s report of the real process."""
    run = _run(sys.executable, "-X", "importtime", *command)
    assert run.returncode == 0, run.stderr[-3000:]
    return {line.split("|")[-1].strip().split(".")[0] for line in run.stderr.splitlines() if "|" in line}


def _run_file(folder: Path, timeout_s: float = 60.0) -> Path:
    """The offline run file, which W&B's service process writes and may finish after the command has returned."""
    deadline = time.monotonic() + timeout_s
    while not (files := sorted(folder.glob("run-*.wandb"))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert files, f"no W&B run file in {folder}"
    return files[0]


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_help_says_what_vit_ct_is_and_lists_every_subcommand_in_a_sentence():
    run = _run(VIT_CT, "--help")
    assert run.returncode == 0, run.stderr
    text = _one_line(run.stdout)
    assert "Lightning Trainer command line tool" not in text
    assert text.startswith("usage: vit-ct") and "vit-ct trains a Vision Transformer" in text
    rows = dict(re.findall(r"^ {4}(\w+) +(.*(?:\n {8,}.*)*)", run.stdout, flags=re.MULTILINE))
    assert list(rows) == ["fit", "validate", "test", "predict", "manifest", "report", "pacs"]
    for name, sentence in rows.items():  # a whole sentence each, not a docstring cut at its first line
        sentence = _one_line(sentence)
        assert sentence[0].isupper() and sentence.endswith(".") and len(sentence.split()) >= 12, (name, sentence)
    for option in ("--config", "--print_config", "--debug", "VIT_CT_DEBUG=1"):
        assert option in text
    assert _run(VIT_CT, "--config", "configs/demo.yaml", "-h").stdout == run.stdout  # help before a subcommand
    bare = _run(VIT_CT)
    assert bare.returncode == 2
    assert "choose a subcommand: fit, validate, test, predict, manifest, report, pacs" in bare.stderr


def test_help_and_the_commands_that_need_no_model_import_no_torch():
    """``vit-ct --help``, ``vit-ct manifest|report|pacs --help``, ``python -m vit_ct.model.shipped list`` and ``import
    vit_ct`` answer without torch, Lightning or timm (each ~2-4 s of imports on 2 cores); the shipped list
    without a RuntimeWarning about its module being imported twice."""
    for command in ([VIT_CT, "--help"], [VIT_CT, "manifest", "--help"], [VIT_CT, "report", "--help"],
                    [VIT_CT, "pacs", "--help"], ["-c", "import vit_ct"],
                    ["-W", "error::RuntimeWarning", "-m", "vit_ct.model.shipped", "list"]):  # fmt: skip
        imported = _imported(*command)
        assert "vit_ct" in imported and not imported & set(HEAVY), (command, imported & set(HEAVY))
    listed = _run(sys.executable, "-m", "vit_ct.model.shipped", "list")
    assert listed.returncode == 0 and listed.stdout.startswith("vit-ct/headct-tiny-256 - ") and not listed.stderr


@pytest.mark.medium
def test_the_start_up_benchmark_reads_which_packages_each_command_imports():
    """benchmarks/startup.py's import report: torch, Lightning and timm where the full parser is built, none for the
    overview (not timed: the figures are the benchmark's)."""
    from benchmarks import startup

    full, overview = startup.import_times("vit-ct fit --help", None), startup.import_times("vit-ct --help", None)
    assert all(full[package] > 0 for package in ("torch", "lightning", "timm")) and full["imports"] > full["torch"]
    assert overview["torch"] == overview["lightning"] == overview["timm"] == 0 and overview["imports"] > 0


@pytest.mark.medium
def test_the_public_names_load_on_first_use():
    code = (
        "import sys, vit_ct; assert 'torch' not in sys.modules and 'rich' not in sys.modules;"
        " from vit_ct import ViTClassifier, attention_rollout;"
        " from vit_ct.task.classifier import ViTClassifier as C; assert ViTClassifier is C;"
        " from vit_ct.data.loading.datamodule import CTSliceDataModule as D; assert vit_ct.CTSliceDataModule is D;"
        " ns = {}; exec('from vit_ct import *', ns);"
        " assert set(vit_ct.__all__) <= set(ns); print('ok')"
    )
    run = _run(sys.executable, "-c", code)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        import vit_ct

        vit_ct.NoSuchThing  # noqa: B018


@pytest.mark.medium
def test_each_subcommand_shows_only_its_own_options():
    fit, predict = _run(VIT_CT, "fit", "--help"), _run(VIT_CT, "predict", "--help")
    assert fit.returncode == predict.returncode == 0, fit.stderr[-2000:] + predict.stderr[-2000:]
    assert _one_line(fit.stdout).count("Train a model on the configured data") == 1
    assert "--test_after_fit" in fit.stdout and "--output_dir" not in fit.stdout and "--overwrite {" not in fit.stdout
    assert "--output_dir OUTPUT_DIR" in predict.stdout and "--overwrite {true,false}" in predict.stdout
    assert "--test_after_fit" not in predict.stdout and "(required, type: str)" in predict.stdout
    assert "Write P(lesion), an attention-rollout map and an overlay for every slice" in _one_line(predict.stdout)


@pytest.mark.medium
def test_a_config_for_every_subcommand_still_loads_in_each(tmp_path, capsys):
    """demo.yaml sets `test_after_fit` and a run's saved config.yaml holds `output_dir: null`: both load in every
    subcommand; an option of another subcommand typed on the command line is refused by name."""
    saved = tmp_path / "config.yaml"
    saved.write_text("test_after_fit: true\noutput_dir: null\noverwrite: false\n")
    for subcommand in ("fit", "validate", "test", "predict"):
        with pytest.raises(SystemExit) as printed:
            main([subcommand, "--config", DEMO, "--config", str(saved), "--output_dir", "out", "--print_config"])
        assert printed.value.code in (0, None)
    capsys.readouterr()
    manifest = write_npy_manifest(tmp_path / "data", train=2, val=2)
    with pytest.raises(ValueError, match=r"--test_after_fit is an option of `vit-ct fit`, not of `vit-ct test`"):
        main(["test", *manifest_args(manifest), *NO_LOGGER, "--test_after_fit", "true"])


@pytest.fixture
def built_models(monkeypatch) -> list:
    """Every ViTClassifier that builds its network from here on (the test's spy; the models are built as usual)."""
    built = []
    original = ViTClassifier.configure_models

    def spy(self) -> None:
        built.append(self)
        original(self)

    monkeypatch.setattr(ViTClassifier, "configure_models", spy)
    return built


@pytest.mark.medium
def test_a_missing_required_option_fails_before_any_model_is_built(tmp_path, capsys, built_models):
    manifest = write_npy_manifest(tmp_path / "data", train=2, val=2)
    with pytest.raises(SystemExit) as refused:
        main(["predict", *manifest_args(manifest), *NO_LOGGER])
    assert refused.value.code == 2 and not built_models
    assert capsys.readouterr().err.strip() == (
        "vit-ct predict: error: --output_dir is required: the folder to write the outputs into"
        " (`vit-ct predict --help` lists the options)"
    )
    with pytest.raises(ValueError, match=r"data.manifest is not set: pass --data.manifest PATH.csv"):
        main(["fit", "--config", DEMO, "--config", MANIFEST, *NO_LOGGER])
    assert not built_models
    main([*manifest_args(manifest), *NO_LOGGER], run=False)
    assert len(built_models) == 1  # the spy sees a model that is built
    run = _run(VIT_CT, "predict", *manifest_args(manifest), *NO_LOGGER, cwd=tmp_path)  # the real command
    assert run.returncode == 2 and run.stderr.startswith("vit-ct predict: error: --output_dir is required")


def test_shipped_weights_are_named_as_such_and_a_none_that_changes_nothing_is_not_said(tmp_path, caplog):
    manifest = write_npy_manifest(tmp_path / "data", train=2, val=2)
    finetune = ["--config", str(ROOT / "configs" / "finetune.yaml"), "--data.manifest", str(manifest), *NO_LOGGER]

    def said(*args: str) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            main([*finetune, *args], run=False)
        return [r.getMessage() for r in caplog.records if "follows the" in r.getMessage()]

    size = "input follows the shipped weights: data.img_size: 256 x 256 (as vit-ct/headct-tiny-256 was trained; the"
    size += " config said 192 x 192)"
    assert said("--model.network.embed_dim", "192", "--model.network.num_heads", "3") == [
        size
    ]  # ViT-Ti's own: nothing changes
    weights = "(the network of the weights vit-ct/headct-tiny-256; the config said"
    assert said("--model.network.embed_dim", "32", "--model.network.depth", "2", "--model.network.num_heads", "2") == [
        f"network follows the shipped weights: model.network.embed_dim: 192, vit_tiny_patch16_224's own {weights} 32)",
        f"network follows the shipped weights: model.network.depth: 6 {weights} 2)",
        f"network follows the shipped weights: model.network.num_heads: 3, vit_tiny_patch16_224's own {weights} 2)",
        size,
    ]


@pytest.mark.medium
def test_test_and_validate_print_their_figures_once(tmp_path, capsys, monkeypatch):
    """Lightning's ~50-row table is off (``--verbose true`` brings it back); vit-ct lists the figures once. Without a
    logger there is no run folder: the working folder's own config.yaml is left as it is."""
    monkeypatch.chdir(tmp_path)
    users = tmp_path / "config.yaml"
    users.write_text("# the user's own\n")
    manifest = write_npy_manifest(tmp_path / "data", train=2, val=2)
    checkpoint = tmp_path / "model.ckpt"
    trainer = quiet_trainer()
    trainer.strategy.connect(
        ViTClassifier.from_hparams(**DEMO_LEVERS, embed_dim=32, depth=2, num_heads=2, img_size=32, in_chans=1)
    )
    trainer.save_checkpoint(checkpoint)
    for subcommand, stage in (("test", "test"), ("validate", "val")):
        main([subcommand, *manifest_args(manifest), *NO_LOGGER, "--ckpt_path", str(checkpoint)])
        out = capsys.readouterr().out
        assert len(re.findall(rf"^{stage} +auroc ", out, flags=re.MULTILINE)) == 1, out
        assert "metric" not in out and "DataLoader 0" not in out, out
        assert users.read_text() == "# the user's own\n"


def test_the_figures_of_a_stage_are_listed_once_in_a_table_of_maps():
    metrics = {"test/auroc": 0.9, "test/loss": 0.25, "test/rollout_pointing": 0.5, "test/rollout_slices": 4.0,
               "test/floor_head_pointing": 0.125, "test/cls_air_block0": 0.0, "val/auroc": 0.7}  # fmt: skip
    assert metric_lines(metrics, "test") == [
        "test  auroc 0.9000  loss 0.2500",
        "  map             pointing    slices",
        "  rollout           0.5000         4",
        "  floor_head        0.1250         -",
        "  cls_air_block0 0.0000",
    ]
    assert metric_lines(metrics, "val") == ["val   auroc 0.7000"] and metric_lines({}, "test") == []


def test_one_learning_rate_series_per_schedule():
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(4)]
    scales = [1.0, 0.75, 0.75**2, 0.75**3]  # layer decay: a fixed scale per group, one schedule
    optimizer = torch.optim.AdamW([{"params": [p], "lr": 1e-3 * s} for p, s in zip(params, scales, strict=True)])
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    assert _rates_by_schedule(optimizer.param_groups, "lr") == {"lr": pytest.approx(5e-4)}
    other = torch.optim.AdamW([{"params": [p], "lr": 1e-3} for p in params[:2]])
    torch.optim.lr_scheduler.LambdaLR(other, [lambda step: 0.5, lambda step: 0.1])  # a group of its own schedule
    assert _rates_by_schedule(other.param_groups, "lr") == {"lr": pytest.approx(5e-4), "lr-pg1": pytest.approx(1e-4)}


def test_counts_of_one_are_singular(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    pd.DataFrame({"image": ["a.dcm"], "prob": [0.5]}).to_csv(out / "predictions.csv", index=False)
    pd.DataFrame({"scan": ["s1"], "prob": [0.5]}).to_csv(out / "scans.csv", index=False)
    text = report(out, {"kept_checkpoint": "final weights", "best_checkpoint": "k.ckpt", "metrics": {}})
    assert ": 1 slice\n" in text and ": 1 scan\n" in text and "  final weights     k.ckpt" in text
    volume = tmp_path / "volume.nii.gz"
    nib.save(nib.Nifti1Image(np.full((16, 16, 3), 40, dtype=np.int16), np.diag([0.9, 0.9, 5.0, 1.0])), volume)
    main(["manifest", str(volume), "--output", str(tmp_path / "m.csv")])
    printed = capsys.readouterr().out
    assert "3 slices of 1 scan;" in printed and "1 scans" not in printed


@pytest.mark.slow
def test_a_fit_prints_its_figures_once_and_none_of_the_noise(tmp_path):
    """A bf16 fit with the default W&B logger and a test after it: vit-ct's list of figures alone (no Lightning table,
    no W&B run summary), no FLOPs it could not count, no bf16 model-summary or W&B git-root warning, one learning
    rate series, the final weights called so, and the test's maps read over shifted grids as `vit-ct test` reads
    them."""
    manifest = write_npy_manifest(tmp_path / "data", train=4, val=4)
    args = [*manifest_args(manifest), "--trainer.max_epochs", "2", "--test_after_fit", "true",
            "--trainer.precision", "bf16-mixed"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_SILENT", "WANDB_QUIET")}  # what a user sees
    run = subprocess.run([VIT_CT, "fit", *args], cwd=tmp_path, env={**env, "WANDB_MODE": "offline"},
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert len(re.findall(r"^test  auroc \d", run.stdout, flags=re.MULTILINE)) == 1
    assert "rollout_pointing" not in output and re.search(r"^  rollout +\d", run.stdout, flags=re.MULTILINE)
    # the test reads the maps as `vit-ct test` does, over shifted grids, and scores them against that grid's ceiling;
    # the fit's validation, one pass: no finer ceiling
    assert re.search(r"^  perfect_grid +\d", run.stdout, flags=re.MULTILINE)
    for noise in ("Test metric", "Run summary", "Run history", "FLOPs", "not supported by the model summary",
                  "git root", "best checkpoint"):  # fmt: skip
        assert noise not in output, noise
    summary = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())
    assert summary["kept_checkpoint"] == "final weights"
    assert f"final weights    {summary['best_checkpoint']}" in run.stdout
    history, _ = history_and_config(_run_file(Path(summary["wandb_dir"])))
    keys = set().union(*history)
    assert "lr" in keys and not [k for k in keys if k.startswith("lr-")] and "train/loss_epoch" in keys
