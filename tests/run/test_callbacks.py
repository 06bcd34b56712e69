"""RolloutOverlayCallback: W&B overlays of fixed validation slices and a test predictions table, on a tiny run."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import DEMO_LEVERS, quiet_trainer
from lightning.pytorch.loggers import WandbLogger
from PIL import Image

from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.run.wandb_media import RolloutOverlayCallback
from vit_ct.task import ViTClassifier

torch.set_num_threads(1)


@pytest.fixture
def manifest(tmp_path):
    """12 slices of 40 x 40 HU (.npy): a skull ring around brain, a bright bleed on odd rows, 4 per split."""
    y, x = np.mgrid[:40, :40]
    r = np.hypot(y - 19.5, x - 19.5)
    rows = []
    for i in range(12):
        hu = np.full((40, 40), -1000.0, dtype=np.float32)
        hu[r < 17] = 1000.0  # skull
        hu[r < 15] = 30.0 + i  # brain (each slice its own: identical files would be copies of one image)
        label = i % 2
        mask = (np.hypot(y - 12 - i % 3, x - 14) < 4) & (label == 1)
        hu[mask] = 75.0  # acute blood
        np.save(tmp_path / f"slice{i}.npy", hu)
        np.save(tmp_path / f"mask{i}.npy", mask.astype(np.uint8))
        split = ("train", "val", "test")[i // 4]
        rows.append(
            {"image": f"slice{i}.npy", "label": label, "patient_id": f"p{i}", "split": split, "mask": f"mask{i}.npy"}
        )
    pd.DataFrame(rows).to_csv(tmp_path / "manifest.csv", index=False)
    return tmp_path / "manifest.csv"


def _fit_and_test(manifest, logger, callback):
    torch.manual_seed(0)
    data = CTSliceDataModule(str(manifest), img_size=32, batch_size=4, num_workers=0, augment=False)
    model = ViTClassifier.from_hparams(**DEMO_LEVERS, img_size=32, in_chans=2, embed_dim=32, depth=2, num_heads=2)
    trainer = quiet_trainer(
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=1,
        limit_test_batches=1,
        num_sanity_val_steps=0,
        logger=logger,
        callbacks=[callback],
    )
    trainer.fit(model, datamodule=data)
    fit_metrics = dict(trainer.callback_metrics)
    trainer.test(model, datamodule=data)
    return fit_metrics, dict(trainer.callback_metrics), model, data


def _staged_files(data_dir):
    """Files W&B staged for its artifacts (a table holding images is logged as one)."""
    return [p for p in (data_dir / "artifacts" / "staging").rglob("*") if p.is_file()]


@pytest.mark.medium
def test_overlays_and_table_reach_the_wandb_run(manifest, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))  # where the table artifact is staged
    logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="vit-ct-test")
    callback = RolloutOverlayCallback(n_slices=1, n_negatives=1)
    try:
        val, test, model, data = _fit_and_test(manifest, logger, callback)
        run_dir = Path(logger.experiment.dir)
    finally:
        logger.experiment.finish()
    # val rows 4..7 are dataset indices 0..3: the first positive with a mask (1) and the first negative (0)
    assert callback.val_indices == [0, 1]
    overlays = sorted((run_dir / "media" / "images" / "val").glob("rollout_overlays_*.png"))
    masks = sorted((run_dir / "media" / "images" / "mask" / "val").glob("rollout_overlays_*.mask.png"))
    assert len(overlays) == 2 and len(masks) == 2
    assert Image.open(overlays[0]).size == (32, 32) and Image.open(overlays[0]).mode == "RGB"
    assert len(list((run_dir / "media" / "table" / "test").glob("predictions_*.table.json"))) == 1
    # the table itself, with its overlay images, is staged as the run's artifact
    staged = _staged_files(tmp_path / "wandb-data")
    tables = [json.loads(p.read_text()) for p in staged if p.read_bytes()[:1] == b"{"]
    table = next(t for t in tables if t.get("_type") == "table")
    assert table["columns"] == ["index", "image", "label", "probability", "overlay"]
    assert [row[:3] for row in table["data"]] == [
        [0, "slice8.npy", 0],
        [1, "slice9.npy", 1],
        [2, "slice10.npy", 0],
        [3, "slice11.npy", 1],
    ]
    assert all(row[4]["_type"] == "image-file" for row in table["data"])
    test_batch = next(iter(torch.utils.data.DataLoader(data.datasets["test"], batch_size=4)))  # the slices above
    with torch.no_grad():
        expected = model.eval().probabilities(model(test_batch["image"])).numpy()
    np.testing.assert_allclose([row[3] for row in table["data"]], expected, atol=5e-4)  # P(lesion), 3 decimals
    assert sum(p.read_bytes()[:4] == b"\x89PNG" for p in staged) == 4
    # the model's localisation metrics, logged beside them: 2 positive val slices with masks
    assert val["val/rollout_slices"] == 2 and "val/rollout_pointing" in val
    assert val["val/floor_head_pixel_auroc"] == pytest.approx(0.5)
    assert {"test/rollout_pixel_auroc", "test/floor_image_energy_ratio"} <= set(test)


def test_without_wandb_or_masks_nothing_happens(manifest):
    table = pd.read_csv(manifest)
    table.drop(columns="mask").to_csv(manifest, index=False)
    callback = RolloutOverlayCallback()
    val, test, _, _ = _fit_and_test(manifest, False, callback)
    assert callback.val_indices is None
    assert "val/auroc" in val
    localisation = [key for key in [*val, *test] if "pointing" in key or "floor" in key or "outside_head" in key]
    assert not localisation  # nothing to score a map against
    # the attention sink needs no mask: it is measured on every slice
    assert "val/rollout_air" in val and "test/cls_prefix_block0" in test


@pytest.mark.medium
def test_epoch_lines_show_validation_figures_only_on_the_epochs_that_measured_them(tmp_path, capsys):
    from npy_manifest import manifest_args, write_npy_manifest

    from vit_ct.cli import main

    data = write_npy_manifest(tmp_path / "data", train=4, val=3)
    main(["fit", *manifest_args(data), "--trainer.logger", "false", "--trainer.max_epochs", "3",
          "--trainer.check_val_every_n_epoch", "2", "--trainer.default_root_dir", str(tmp_path / "run"),
          "--trainer.enable_progress_bar", "false"])  # fmt: skip
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]
    assert ["val/auroc" in line for line in lines] == [False, True, False]
    assert all("train/loss" in line for line in lines)
