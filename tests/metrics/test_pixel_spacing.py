"""Slices without a pixel spacing (``.npy``): the manifest's ``pixel_spacing_mm`` column gives it, through every read
path (files, memory, disk cache); without it the distances are measured and named in pixels of the source slice
(pointing tolerance, ``hd95_px``), said in one line, never in mm of a guessed field of view."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import DEMO_LEVERS, quiet_trainer
from npy_manifest import write_npy_manifest
from pydicom.data import get_testdata_file

from vit_ct import CTSliceDataModule, ViTClassifier
from vit_ct.data.manifests.manifest import read_manifest
from vit_ct.explain.maps import localisation_maps
from vit_ct.metrics import localisation
from vit_ct.metrics.localisation import LocalisationMetrics, scores_per_slice
from vit_ct.predict.writer import PredictionWriter

SIZE = 40  # the test slices' rows and columns (npy_manifest); the model grid is 32 x 32
TINY = {**DEMO_LEVERS, "embed_dim": 32, "depth": 2, "num_heads": 2, "img_size": 32, "in_chans": 1}


def _with_spacing(manifest, values) -> None:
    table = pd.read_csv(manifest, dtype=str, keep_default_na=False)
    table["pixel_spacing_mm"] = values
    table.to_csv(manifest, index=False)


def test_the_manifest_column_reads_one_number_or_row_and_column(tmp_path):
    manifest = write_npy_manifest(tmp_path, train=2, val=1, test=0)
    _with_spacing(manifest, ["0.45", "0.5\\0.6", ""])
    spacing = read_manifest(manifest)["pixel_spacing_mm"].tolist()
    assert spacing[:2] == pytest.approx([0.45, 0.55]) and math.isnan(spacing[2])
    for bad in ("0", "-0.4", "0,45", "nan", "0.4\\0.4\\0.4"):
        _with_spacing(manifest, ["0.45", bad, "0.45"])
        with pytest.raises(ValueError, match=rf"{manifest}: column 'pixel_spacing_mm' must hold mm per pixel.*line"
                                             r"s? 3\b"):  # fmt: skip
            read_manifest(manifest)


@pytest.mark.parametrize("cache", [False, "memory", "disk"])
def test_batches_carry_the_manifests_spacing_where_the_file_has_none(tmp_path, cache):
    """A ``.npy`` row takes the column's mm; a DICOM row keeps its own PixelSpacing whatever the column says; an
    empty cell stays unknown (NaN): from the files, the in-memory cache and the disk cache alike."""
    manifest = write_npy_manifest(tmp_path, train=2, val=3, test=0)
    dicom = get_testdata_file("CT_small.dcm")  # 128 x 128 at 0.661468 mm
    table = pd.read_csv(manifest, dtype=str, keep_default_na=False)
    table.loc[3, ["image", "mask"]] = [dicom, ""]
    table["pixel_spacing_mm"] = ["", "", "0.5", "2.0", ""]
    table.to_csv(manifest, index=False)
    data = CTSliceDataModule(str(manifest), img_size=32, batch_size=3, num_workers=0, augment=False, cache=cache,
                             windows="brain")  # fmt: skip
    data.setup("validate")
    batch = next(iter(data.val_dataloader()))
    spacing = dict(zip(batch["index"].tolist(), batch["pixel_spacing_mm"].tolist(), strict=True))
    assert spacing[0] == pytest.approx(0.5 * SIZE / 32)  # mm per model-grid pixel: 40 source pixels over 32
    assert spacing[1] == pytest.approx(0.661468 * 128 / 32, rel=1e-5)  # the file's, not the column's 2.0
    assert math.isnan(spacing[2])


def _lesion_case():
    """One slice, 16 x 16 grid from a 64 x 64 source (4 source pixels per grid pixel), the map's maximum 2 grid pixels
    (8 source pixels) right of a lesion."""
    mask = torch.zeros(1, 16, 16)
    mask[0, 8, 4:7] = 1
    maps = torch.zeros(1, 16, 16)
    maps[0, 8, 8] = 1.0
    return maps, mask, torch.tensor([[64, 64]])


def test_without_a_spacing_the_tolerance_and_hd95_are_in_source_pixels():
    maps, mask, shape = _lesion_case()
    unknown = torch.tensor([math.nan])

    def scores(tolerance, spacing=unknown):
        metric = LocalisationMetrics(tolerance_mm=tolerance)
        metric.update(maps, mask, known=None, pixel_spacing_mm=spacing, source_shape=shape)
        return {name: float(value) for name, value in metric.compute().items()}

    assert scores(8.0)["pointing"] == 1 and scores(7.9)["pointing"] == 0  # 8 source pixels away
    assert scores(8.0)["pixel_slices"] == 1 and math.isnan(scores(8.0)["hd95_mm"])
    in_mm = scores(8.0, torch.tensor([1.25 * 4]))  # 1.25 mm source pixels: 5 mm per grid pixel, 10 mm away
    assert in_mm["pointing"] == 0 and in_mm["pixel_slices"] == 0 and math.isnan(in_mm["hd95_px"])
    # the same distance, once in source pixels and once in mm: 1.25 mm per source pixel
    assert in_mm["hd95_mm"] == pytest.approx(1.25 * scores(8.0)["hd95_px"], rel=1e-6)


def _validated(manifest, model):
    data = CTSliceDataModule(str(manifest), img_size=32, batch_size=4, num_workers=0, augment=False, windows="brain")
    trainer = quiet_trainer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (logged,) = trainer.validate(model, datamodule=data, verbose=False)
    return logged, [str(w.message) for w in caught if "pixel spacing" in str(w.message)]


def test_validation_names_its_units_and_the_column_turns_them_into_mm(tmp_path):
    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(**TINY).eval()
    manifest = write_npy_manifest(tmp_path / "npy", train=2, val=8)
    logged, said = _validated(manifest, model)
    scored = int(logged["val/rollout_slices"])
    assert scored == 4 and logged["val/rollout_pixel_slices"] == scored  # every other slice holds a lesion
    assert "val/rollout_hd95_mm" not in logged and logged["val/rollout_hd95_px"] > 0
    assert said == [
        f"val: {scored} of {scored} scored slices without a pixel spacing (a .npy file, and no pixel_spacing_mm"
        " column in the manifest) are scored in pixels of their source slice: a pointing tolerance of 5 pixels"
        " instead of 5 mm, and HD95 as hd95_px; a pixel_spacing_mm column (mm per pixel) scores them in mm"
    ]
    _with_spacing(manifest, "0.45")
    in_mm, said = _validated(manifest, model)
    assert not said and "val/rollout_hd95_px" not in in_mm and "val/rollout_pixel_slices" not in in_mm
    for source in ("rollout", "perfect_patch"):
        assert in_mm[f"val/{source}_hd95_mm"] == pytest.approx(0.45 * logged[f"val/{source}_hd95_px"], rel=1e-5)


def test_predictions_name_the_distance_they_measured(tmp_path):
    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(**TINY).eval()
    manifest = write_npy_manifest(tmp_path / "npy", train=0, val=0, test=4)
    written = {}
    for name, spacing in (("pixels", None), ("mm", "0.45")):
        if spacing:
            _with_spacing(manifest, spacing)
        data = CTSliceDataModule(str(manifest), img_size=32, batch_size=2, num_workers=0, windows="brain",
                                 predict_split="test")  # fmt: skip
        trainer = quiet_trainer(callbacks=[PredictionWriter(tmp_path / name)])
        trainer.predict(model, datamodule=data, return_predictions=False)
        written[name] = pd.read_csv(tmp_path / name / "predictions.csv")
    pixels, mm = written["pixels"], written["mm"]
    assert not any(c.endswith("_hd95_mm") for c in pixels) and not any(c.endswith("_hd95_px") for c in mm)
    lesion = pixels["label"] == 1
    assert pixels.loc[lesion, "rollout_hd95_px"].notna().all() and pixels.loc[~lesion, "rollout_hd95_px"].isna().all()
    np.testing.assert_allclose(mm["rollout_hd95_mm"], 0.45 * pixels["rollout_hd95_px"], rtol=1e-5)


def test_per_slice_scores_say_their_unit_once(monkeypatch):
    monkeypatch.setattr(localisation, "_SAID", set())  # as in a fresh process
    maps, mask, shape = _lesion_case()
    batch = {"mask": mask[:, None], "head": torch.ones_like(mask)[:, None], "has_mask": torch.tensor([True]),
             "pixel_spacing_mm": torch.tensor([math.nan]), "source_shape": shape}  # fmt: skip
    maps = localisation_maps(None, {**batch, "image": maps[:, None]}, rollout=maps[:, ::4, ::4])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # e.g. the review's batches
            scores = scores_per_slice(maps, batch, tolerance_mm=8.0)
    assert len(caught) == 1 and "a pointing tolerance of 8 pixels instead of 8 mm" in str(caught[0].message)
    assert scores["rollout_pointing"].isnan().tolist() == [False]
    assert math.isnan(scores["rollout_hd95_mm"][0]) and scores["rollout_hd95_px"][0] >= 0
