"""CTSliceDataModule on the user's own manifest: multi-label end to end, class balance, bad input stopped before a
run starts (or skipped and reported), unlabelled prediction, and per-rank caching under DDP."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TINY_MODEL_ARGS
from npy_manifest import write_npy_manifest
from pydicom.data import get_testdata_file

from vit_ct.cli import main
from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.data.loading.distributed import MarkedPaddingSampler, decode_index
from vit_ct.run.runs import run_dir

LABELS = ["epidural", "subdural", "any"]


def write_slices(folder: Path, n: int, *, size: int = 32, seed: int = 0) -> list[str]:
    """`n` round "heads" in HU as .npy (brain 35 HU in air, noise 5 HU); returns their file names."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size] - (size - 1) / 2
    head = np.hypot(yy, xx) < 0.4 * size
    names = []
    for i in range(n):
        hu = np.where(head, 35.0, -1000.0) + rng.normal(0, 5, (size, size))
        np.save(folder / f"s{i:02d}.npy", hu.astype(np.float32))
        names.append(f"s{i:02d}.npy")
    return names


def write_csv(folder: Path, header: list[str], rows: list[list], name: str = "manifest.csv") -> Path:
    path = folder / name
    pd.DataFrame(rows, columns=header).to_csv(path, index=False)
    return path


def run_args(manifest: Path, *extra: str) -> list[str]:
    return [
        "fit", "--data.class_path", "vit_ct.CTSliceDataModule", "--data.init_args.manifest", str(manifest),
        "--data.init_args.img_size", "32", "--data.init_args.batch_size", "4", "--data.init_args.num_workers", "0",
        *TINY_MODEL_ARGS, "--model.losses.patch_loss_weight", "0", "--trainer.accelerator", "cpu",
        "--trainer.max_epochs", "1", *extra,
    ]  # fmt: skip


def test_multilabel_fit_through_the_cli_with_bad_rows_skipped_and_reported(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = write_slices(tmp_path, 12)
    rng = np.random.default_rng(1)
    rows = []
    for i, name in enumerate(names):
        labels = [int(v) for v in rng.integers(0, 2, 2)]
        split = "train" if i < 8 else "val"
        rows.append([name, *labels, int(any(labels)), f"p{i}", split])
    rows += [["missing.npy", 0, 0, 0, "p90", "train"], ["s00.npy.broken", 1, 0, 1, "p91", "val"]]
    (tmp_path / "s00.npy.broken").write_bytes(b"not a slice")
    manifest = write_csv(tmp_path, ["image", *LABELS, "patient_id", "split"], rows)

    cli = main(
        run_args(manifest, "--data.init_args.label_columns", str(LABELS), "--data.init_args.on_bad_file", "skip",
                 "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", "logs")
    )  # fmt: skip
    model = cli.model
    assert model.task == "multilabel" and model.hparams.num_classes == 3 and model.class_names == LABELS
    metrics = cli.trainer.callback_metrics
    assert {"val/auroc", *(f"val/auroc_{name}" for name in LABELS)} <= set(metrics)
    assert "val/weighted_log_loss" not in metrics  # only with --model.labels.label_weights

    assert cli.datamodule.bad_rows_report == run_dir(cli.trainer) / "bad_files.csv"
    report = pd.read_csv(cli.datamodule.bad_rows_report)
    assert report["line"].tolist() == [14, 15] and set(report["column"]) == {"image"}
    assert "file not found" in report["reason"][0]


def test_bad_rows_stop_fit_before_any_run_or_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = write_slices(tmp_path, 6)
    rows = [[name, i % 2, f"p{i}"] for i, name in enumerate(names)]
    rows[2][0], rows[4][0] = "gone.npy", "also_gone.dcm"
    manifest = write_csv(tmp_path, ["image", "label", "patient_id"], rows)
    with pytest.raises(ValueError) as error:
        main(run_args(manifest))  # the default W&B logger (offline in tests)
    message = str(error.value)
    assert "line 4: image" in message and "gone.npy" in message
    assert "line 6: image" in message and "also_gone.dcm" in message
    assert not (tmp_path / "runs").exists() and not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("wandb"))


def test_labels_beyond_num_classes_are_named_before_fit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = write_slices(tmp_path, 4)
    manifest = write_csv(tmp_path, ["image", "label"], [[name, [0, 1, 3, 2][i]] for i, name in enumerate(names)])
    with pytest.raises(ValueError, match=r"lines 4, 5; set --model.labels.num_classes 4"):
        main(run_args(manifest, "--trainer.logger", "false"))


def test_weighted_sampler_draws_classes_about_evenly(tmp_path):
    names = write_slices(tmp_path, 24, size=8)
    rows = [[name, int(i % 6 == 0), "train" if i < 20 else "val"] for i, name in enumerate(names)]  # 4 of 20: 1
    data = CTSliceDataModule(str(write_csv(tmp_path, ["image", "label", "split"], rows)), img_size=16,
                             weighted_sampler=True, cache=False, num_workers=0)  # fmt: skip
    data.setup("fit")
    loader = data.train_dataloader()
    labels = data.datasets["train"].table["label"].to_numpy()
    assert labels.mean() == pytest.approx(0.2)
    drawn = np.concatenate([labels[list(loader.sampler)] for _ in range(100)])  # 2,000 draws
    assert drawn.mean() == pytest.approx(0.5, abs=0.05)


def test_predict_on_an_unlabelled_manifest(tmp_path):
    names = write_slices(tmp_path, 3, size=8)
    manifest = write_csv(tmp_path, ["image", "patient_id"], [[name, f"p{i}"] for i, name in enumerate(names)])
    data = CTSliceDataModule(str(manifest), windows="brain", img_size=16, num_workers=0)
    with pytest.raises(ValueError, match="lacks the 'label' column"):
        data.check("fit")
    data.setup("predict")
    batch = next(iter(data.predict_dataloader()))
    assert batch["label"].tolist() == [-1, -1, -1] and batch["image"].shape == (3, 1, 16, 16)

    multi = write_csv(tmp_path, ["image", *LABELS], [[names[0], 1, "", 1], [names[1], "", "", ""]], name="m.csv")
    data = CTSliceDataModule(str(multi), img_size=16, num_workers=0, label_columns=LABELS, predict_split=None)
    data.setup("predict")
    assert next(iter(data.predict_dataloader()))["label"].tolist() == [[1, -1, 1], [-1, -1, -1]]


@pytest.mark.parametrize("rank", [0, 1])
def test_ddp_evaluation_cache_holds_only_the_ranks_shard(tmp_path, rank):
    names = write_slices(tmp_path, 9, size=8)
    rows = [[name, i % 2, "train" if i < 4 else "val"] for i, name in enumerate(names)]  # 5 val slices
    data = CTSliceDataModule(str(write_csv(tmp_path, ["image", "label", "split"], rows)), img_size=16, num_workers=0)
    ranks = {"num_replicas": 2, "rank": rank}
    data.trainer = SimpleNamespace(distributed_sampler_kwargs=ranks, lightning_module=None, is_global_zero=rank == 0)
    data.setup("fit")
    val = data.datasets["val"]
    shard = {decode_index(i)[0] for i in MarkedPaddingSampler(val, **ranks)}
    assert set(val._cache) == shard == ({0, 2, 4} if rank == 0 else {1, 3, 0})  # rank 1 pads with slice 0
    assert set(data.datasets["train"]._cache) == set(range(4))  # training shards change every epoch: all of it


def test_batches_carry_the_files_pixel_spacing_on_the_model_grid(synthetic_set):
    """The synthetic DICOM's PixelSpacing (0.9 mm at 256 x 256 in the demo settings), rescaled to the model grid."""
    import pydicom

    data = CTSliceDataModule(str(synthetic_set), img_size=32, batch_size=4, num_workers=0, augment=False)
    data.setup("fit")
    batch = next(iter(data.val_dataloader()))
    table = data.split_table("val")
    for i, index in enumerate(batch["index"].tolist()):
        ds = pydicom.dcmread(table.iloc[index]["image"], stop_before_pixels=True)
        rows, spacing = int(ds.Rows), [float(v) for v in ds.PixelSpacing]
        expected = sum(spacing) / 2 * max(rows, int(ds.Columns)) / 32
        assert float(batch["pixel_spacing_mm"][i]) == pytest.approx(expected, rel=1e-6)


def test_slices_without_spacing_carry_nan(tmp_path):
    manifest = write_npy_manifest(tmp_path, train=2, val=2)
    data = CTSliceDataModule(str(manifest), img_size=32, batch_size=2, num_workers=0, augment=False)
    data.setup("fit")
    assert torch.isnan(next(iter(data.val_dataloader()))["pixel_spacing_mm"]).all()


def test_npy_slices_load_without_the_not_writable_warning(tmp_path):
    names = write_slices(tmp_path, 4, size=8)
    data = CTSliceDataModule(str(write_csv(tmp_path, ["image", "label", "split"], [[n, 0, "train"] for n in names])),
                             windows="brain", img_size=16, cache=False, num_workers=0)  # fmt: skip
    data.setup("predict")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch: "The given NumPy array is not writable ..."
        batch = next(iter(data.predict_dataloader()))
    assert batch["image"].shape == (4, 1, 16, 16)


def test_accepted_modalities_reach_the_loader(tmp_path):
    shutil.copy(get_testdata_file("MR_small.dcm"), tmp_path / "mr.dcm")
    manifest = str(write_csv(tmp_path, ["image", "label", "split"], [["mr.dcm", 0, "train"]]))
    with pytest.raises(ValueError, match="line 2: image .*mr.dcm: DICOM has Modality MR"):
        CTSliceDataModule(manifest, img_size=16, num_workers=0).setup("predict")
    data = CTSliceDataModule(manifest, windows="brain", img_size=16, num_workers=0, modalities=["CT", "MR"])
    with pytest.warns(UserWarning, match=r"1 of 1 slices are not CT \(MR 1\), accepted by modalities=\('CT', 'MR'\)"):
        data.setup("predict")
    assert next(iter(data.predict_dataloader()))["image"].shape == (1, 1, 16, 16)
