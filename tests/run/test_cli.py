"""The ``vit-ct`` command: every config parses, bad input is named, and fit -> checkpoint -> predict round-trips."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import TINY_MODEL_ARGS, run_vit_ct, tiny_data_args
from PIL import Image
from wandb_records import history_and_config

from vit_ct import CTSliceDataModule, ViTClassifier, load_ct_slice
from vit_ct.cli import main
from vit_ct.data.io.reader import load_mask
from vit_ct.explain.overlay import render_overlay
from vit_ct.metrics.localisation import SCORES
from vit_ct.predict.writer import OVERLAY_MIN_WIDTH
from vit_ct.run.hardware import auto_precision

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
DEMO = str(ROOT / "configs" / "demo.yaml")
MANIFEST = str(ROOT / "configs" / "manifest.yaml")


def print_config(*args: str, capsys) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_parses_against_the_code(config, capsys):
    parsed = print_config("fit", "--config", str(config), capsys=capsys)
    assert "img_size" not in parsed["model"] and "in_chans" not in parsed["model"]  # linked from the data
    cli = main(["--config", str(config), "--trainer.logger", "false"], run=False)
    assert cli.model.hparams.img_size == cli.datamodule.img_size
    assert cli.model.hparams.in_chans == cli.datamodule.num_channels


def test_configs_compose_later_ones_winning(capsys, tmp_path):
    parsed = print_config(
        "fit",
        "--config",
        DEMO,
        "--config",
        MANIFEST,
        "--data.manifest",
        "my.csv",
        "--model.weights",
        "demo.ckpt",
        capsys=capsys,
    )
    assert parsed["data"]["class_path"].split(".")[-1] == "CTSliceDataModule"
    assert parsed["data"]["init_args"]["manifest"] == "my.csv"
    assert parsed["model"]["weights"] == "demo.ckpt"
    demo = yaml.safe_load(Path(DEMO).read_text())
    assert parsed["trainer"]["max_epochs"] == demo["trainer"]["max_epochs"]  # the demo model and recipe stay
    # and the demo's input: the code's defaults, which neither config overrides (one place says what the demo sees)
    assert parsed["data"]["init_args"]["windows"] == ["brain", "subdural"]
    assert parsed["data"]["init_args"]["img_size"] == 192
    assert "windows" not in demo["data"]["init_args"] and "img_size" not in demo["data"]["init_args"]


def test_unknown_config_key_is_an_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", DEMO, "--model.no_such_option", "1"])
    assert exit_info.value.code != 0
    assert "no_such_option" in capsys.readouterr().err


def test_bad_config_value_is_named(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", DEMO, "--model.network.depth", "deep"])
    assert exit_info.value.code != 0
    assert "depth" in capsys.readouterr().err


def fit_on_manifest(manifest) -> None:
    """`vit-ct fit` of the demo recipe on a user's manifest, as the README shows it (tiny model, no logger)."""
    main(["fit", "--config", DEMO, "--config", MANIFEST, "--data.manifest", str(manifest), *TINY_MODEL_ARGS,
          "--trainer.logger", "false"])  # fmt: skip


def test_missing_manifest_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="nope.csv"):
        fit_on_manifest(tmp_path / "nope.csv")


def test_manifest_without_image_column_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    manifest = tmp_path / "m.csv"
    manifest.write_text("path,label\na.dcm,0\n")
    with pytest.raises(ValueError, match="image"):
        fit_on_manifest(manifest)


def _run_files(folder: Path, timeout_s: float = 60.0) -> list[Path]:
    """The offline run file, which W&B's service process (not the command itself) writes and may finish after the
    command has returned."""
    deadline = time.monotonic() + timeout_s
    while not (files := list(folder.glob("run-*.wandb"))) and time.monotonic() < deadline:
        time.sleep(0.5)
    return files


@pytest.mark.slow
def test_fit_then_predict_through_the_real_command(synthetic_set, tmp_path):
    common = ["--config", DEMO, *tiny_data_args(synthetic_set), *TINY_MODEL_ARGS]
    fit = run_vit_ct("fit", *common, "--trainer.max_epochs", "2", "--trainer.log_every_n_steps", "1", cwd=tmp_path)

    summary = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())
    best, last = Path(summary["best_checkpoint"]), Path(summary["last_checkpoint"])
    assert best.is_file() and last.name == "last.ckpt" and last.is_file()
    # last.ckpt is the final epoch's state, whether or not that epoch was the best
    assert torch.load(last, map_location="cpu", weights_only=True)["epoch"] == 1
    assert "test/auroc" in summary["metrics"]  # demo.yaml tests the best checkpoint after fitting
    assert str(best) in fit.stdout.replace("\n", "")
    run_dir = Path(summary["run_dir"])
    saved_config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved_config["model"]["network"]["depth"] == 2
    # demo.yaml's `precision: auto` is resolved for this machine, and the run records what it used
    assert summary["precision"] == saved_config["trainer"]["precision"] == auto_precision("cpu")[0]

    # The offline W&B run holds the metrics and the full CLI config.
    run_files = _run_files(Path(summary["wandb_dir"]))
    assert len(run_files) == 1
    history, config = history_and_config(run_files[0])
    keys = set().union(*history)
    assert {"train/loss_step", "val/auroc", "val/loss", "test/auroc", "trainer/global_step"} <= keys
    assert config["model"]["network"]["depth"] == 2 and config["data"]["init_args"]["img_size"] == 32
    assert config["trainer"]["max_epochs"] == 2

    out = tmp_path / "predictions"
    predict = ["--ckpt_path", str(best), "--data.init_args.predict_split", "test", "--output_dir", str(out)]
    # fp32 here (the demo trains in bf16), so that the reference below can match to 1e-5
    run = run_vit_ct("predict", *common, *predict, "--trainer.precision", "32-true", cwd=tmp_path)
    assert "dirpath has changed" not in run.stdout + run.stderr  # predict restores no checkpoint callback
    table = pd.read_csv(out / "predictions.csv")
    data = CTSliceDataModule(str(synthetic_set), img_size=32)  # the demo's windows: the defaults
    test_rows = data.split_table("test")
    assert list(table["image"]) == list(test_rows["image_ref"])
    assert list(table["label"]) == list(test_rows["label"])
    sink = ["rollout_air", "rollout_outside_head", "cls_prefix_b0", "cls_prefix_b1", "cls_air_b0", "cls_air_b1"]
    # every slice has a pixel spacing (DICOM): no HD95 in pixels
    # predict reads the maps over 2 x 2 shifted grids unless told: prob_tta beside prob, and the finer grid's ceiling
    ceilings = ("rollout", "perfect_patch", "perfect_grid")
    scores = [f"{source}_{name}" for source in ceilings for name in SCORES if name != "hd95_px"]
    where = ["scan", "mask"]  # the slice's scan (patient_id here) and mask, for a review of OUT without the model
    columns = ["image", "prob", "prob_tta", "label", "rollout", "overlay", *where, "outside_domain", *sink, *scores]
    assert list(table.columns) == columns
    assert table["outside_domain"].isna().all()  # every simulated slice looks like an axial head CT
    lesion = table["label"] == 1  # every synthetic positive has its mask: scored; negatives are not
    assert table.loc[lesion, "rollout_dice"].between(0, 1).all() and table.loc[~lesion, "rollout_dice"].isna().all()
    assert table.loc[lesion, "perfect_patch_hd95_mm"].ge(0).all()
    info = json.loads((out / "run.json").read_text())
    assert info["task"] == "binary" and Path(info["checkpoint"]) == best.resolve()
    # air (no pixel above -300 HU) is below both windows, so the model masks it as keys: no attention to it. (Read
    # over shifted grids, an 8-pixel cell of air can lie in a patch that held tissue in a shifted pass, so the map's
    # own share on air cells, rollout_air, is 0 at one pass only.)
    assert (table[["cls_air_b0", "cls_air_b1"]] == 0).all().all() and table["rollout_air"].between(0, 1).all()
    assert ((table["cls_prefix_b0"] > 0) & (table["cls_prefix_b0"] < 1)).all()

    # The checkpoint loads back into ViTClassifier and predicts what the command wrote.
    model = ViTClassifier.load_from_checkpoint(best, map_location="cpu").eval()
    data.setup("test")
    batch = next(iter(data.test_dataloader()))
    with torch.no_grad():
        probs = model.probabilities(model(batch["image"]))
    np.testing.assert_allclose(table["prob"].to_numpy()[: len(probs)], probs.numpy(), atol=1e-5)

    for _, row in table.iterrows():
        manifest_row = test_rows.set_index("image_ref").loc[row["image"]]
        source = load_ct_slice(manifest_row["image"])
        heat = np.load(out / row["rollout"])
        assert heat.dtype == np.float32 and heat.shape == source.shape and (heat >= 0).all() and heat.max() > 0
        overlay = np.asarray(Image.open(out / row["overlay"]))
        # the overlay itself, enlarged by a whole factor, then a caption band naming the case below it
        scale = -(-OVERLAY_MIN_WIDTH // source.shape[1])
        rows, cols = source.shape[0] * scale, source.shape[1] * scale
        assert overlay.shape[1:] == (cols, 3) and overlay.shape[0] > rows
        mask = load_mask(manifest_row["mask"]) if isinstance(manifest_row["mask"], str) else None
        picture = render_overlay(source, heat, mask)
        np.testing.assert_array_equal(overlay[:rows], picture.repeat(scale, axis=0).repeat(scale, axis=1))
        assert (overlay[rows:] == 255).all(axis=-1).any()  # white text on the band


@pytest.mark.medium
def test_predict_and_test_read_the_maps_finer_than_fits_validation_unless_told(capsys):
    from vit_ct.explain.map_reading import MapReading
    from vit_ct.explain.shifted import READ_SHIFTS
    from vit_ct.run.options import map_reading

    assert READ_SHIFTS > 1
    for subcommand, shifts in (("fit", 1), ("validate", 1), ("test", READ_SHIFTS), ("predict", READ_SHIFTS)):
        extra = ["--output_dir", "out"] if subcommand == "predict" else []
        parsed = print_config(subcommand, "--config", MANIFEST, "--data.manifest", "my.csv", *extra, capsys=capsys)
        assert "map_shifts" not in parsed["model"] and map_reading(subcommand, parsed).shifts == shifts, subcommand
    told = print_config("test", "--config", MANIFEST, "--map_shifts", "1", "--map_pixels", "true", capsys=capsys)
    assert map_reading("test", told) == MapReading(shifts=1, pixels=True)
    with pytest.raises(ValueError, match="map_shifts"):
        map_reading("test", {"map_shifts": 0})
