"""RSNA 2019 as it really downloads: its wrapped 12-bit slices read as the Hounsfield units they hold (air near -1000,
not 3096), counted in one line per run, and a slice of that header whose values cannot be told refused by name."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pydicom
import pytest
from rsna_files import phantom_hu, write_ct_dicom

from vit_ct.data.datasets.rsna_manifest import RSNA_LABELS
from vit_ct.data.io.dicom import UNWRAPPED, WRAP_PERIOD
from vit_ct.data.io.reader import load_ct_slice, read_ct_slice
from vit_ct.data.loading.datamodule import say_read_notes
from vit_ct.data.manifests.manifest_files import validate_manifest_files


def head_hu(size: int = 64, seed: int = 0) -> np.ndarray:
    """Air around a head: fat (-100 HU) under the skin, a skull (1200 HU), brain (35 HU) with noise: every value a
    wrapped slice stores differently (air, fat: wrapped; brain, bone: as they are). No value below -1000 HU: the
    scanners that wrote RSNA's wrapped slices clip there (their air is the mode at 3096), and a wrap of 4096 with
    the published shift of 1000 cannot hold less."""
    rng = np.random.default_rng(seed)
    radius = np.hypot(*(np.mgrid[:size, :size] - (size - 1) / 2)) / size
    hu = np.select([radius < 0.33, radius < 0.37, radius < 0.42], [35.0, 1200.0, -100.0], -1000.0)
    return np.maximum(hu + rng.normal(0, 4, hu.shape).round(), -1000.0)


def write_rsna_wrapped(path: Path, hu: np.ndarray, *, intercept: float = 0.0) -> None:
    """A slice as RSNA 2019's faulty ones are: unsigned 12-bit (BitsStored 12, HighBit 11, PixelRepresentation 0),
    RescaleIntercept near 0, slope 1, stored values HU modulo 4096 (air stored as 3096)."""
    write_ct_dicom(path, hu, "ID_wrapped")  # a plain CT file, then its pixel module made RSNA's faulty one
    ds = pydicom.dcmread(path)
    ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 12, 11, 0
    ds.RescaleSlope, ds.RescaleIntercept = 1, intercept
    ds.PixelData = (np.round(hu).astype(np.int64) % WRAP_PERIOD).astype("<u2").tobytes()
    ds.save_as(path)


@pytest.mark.parametrize("intercept", [0.0, 1.0, -50.0])
def test_a_wrapped_12_bit_slice_reads_within_1_hu_of_its_true_values(tmp_path, intercept):
    truth = head_hu()
    path = tmp_path / "ID_wrapped.dcm"
    write_rsna_wrapped(path, truth, intercept=intercept)
    hu, note = read_ct_slice(path)
    assert note == UNWRAPPED
    assert np.abs(hu - truth).max() <= 1  # air near -1000, not 3096
    assert hu.min() < -990 and hu.max() < 1300
    np.testing.assert_array_equal(load_ct_slice(path), hu)  # the one reader every path uses


def test_the_header_pattern_without_the_pixels_showing_a_wrap_is_read_as_it_says(tmp_path):
    inside = np.full((32, 32), 35.0)  # a field of view inside the head: no air, nothing wrapped
    inside[8:12, 8:12] = 1500.0
    path = tmp_path / "inside.dcm"
    write_rsna_wrapped(path, inside)
    hu, note = read_ct_slice(path)
    assert note == "" and np.array_equal(hu, inside.astype(np.float32))


def test_a_slice_too_little_wrapped_to_tell_is_refused_by_name(tmp_path):
    inside = np.full((64, 64), 35.0)  # a field of view inside the head, but for a corner of air (0.2% of it)
    inside[:3, :3] = -1000.0
    path = tmp_path / "ID_unsure.dcm"
    write_rsna_wrapped(path, inside)
    with pytest.raises(ValueError, match=r"ID_unsure\.dcm.*0\.22% of the pixels .*cannot be trusted"):
        load_ct_slice(path)


def test_the_check_counts_the_corrected_slices_and_the_run_says_so_in_one_line(tmp_path, caplog):
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"ID_w{i}.dcm")
        write_rsna_wrapped(paths[-1], head_hu(seed=i))
    plain = tmp_path / "ID_plain.dcm"
    write_rsna_wrapped(plain, np.full((32, 32), 35.0))
    table = pd.DataFrame({"image": [*map(str, paths), str(plain), str(paths[0])], "label": [0, 1, 0, 0, 0]})
    good, bad = validate_manifest_files(table, progress=False, workers=1)
    assert bad == [] and good.attrs["read_notes"] == {UNWRAPPED: 3}  # each slice once, the repeated row too
    with caplog.at_level(logging.INFO):
        say_read_notes("rsna.csv", good)
    lines = [r.getMessage() for r in caplog.records if "rsna.csv" in r.getMessage()]
    assert lines == [
        f"rsna.csv: 3 slices with {UNWRAPPED} (RSNA 2019's known fault: unsigned 12-bit values with RescaleIntercept"
        " above -100 that store air as 3096; read as (stored + 1000) mod 4096 - 1000 HU)"
    ]


KAGGLE = "rsna-intracranial-hemorrhage-detection"


@pytest.fixture
def kaggle_download(tmp_path) -> Path:
    """Kaggle's zip as it unpacks, `rsna-intracranial-hemorrhage-detection/` twice, in a downloads folder: 6 plain
    slices of 3 patients, 2 wrapped ones and the set's truncated file `ID_6431af929.dcm`."""
    root = tmp_path / "downloads" / KAGGLE / KAGGLE
    images = root / "stage_2_train"
    images.mkdir(parents=True)
    rows = []
    for i in range(9):
        sop = "ID_6431af929" if i == 8 else f"ID_{i:09x}"
        if i < 6 or i == 8:
            write_ct_dicom(images / f"{sop}.dcm", phantom_hu(64, i), f"ID_patient{i % 3}")
        else:
            write_rsna_wrapped(images / f"{sop}.dcm", head_hu(seed=i))
        labels = [0, 0, 0, 0, i % 2, i % 2]
        rows += [f"{sop}_{name},{v}" for name, v in zip(RSNA_LABELS, labels, strict=True)]
    data = (images / "ID_6431af929.dcm").read_bytes()
    (images / "ID_6431af929.dcm").write_bytes(data[: len(data) - 3000])  # short pixel data, as the real one
    (root / "stage_2_train.csv").write_text("\n".join(["ID,Label", *rows]) + "\n")
    return tmp_path / "downloads"


def test_the_kaggle_download_is_found_its_broken_file_left_out_and_listed(kaggle_download, tmp_path, capsys):
    from vit_ct.cli import main

    main(["manifest", "--dataset", "rsna", str(kaggle_download), "--output", str(tmp_path / "rsna.csv")])
    said = capsys.readouterr().out
    table = pd.read_csv(tmp_path / "rsna.csv")
    assert len(table) == 8 and not table["image"].str.contains("ID_6431af929").any()
    assert table["image"].map(lambda p: (tmp_path / p).is_relative_to(kaggle_download / KAGGLE / KAGGLE)).all()
    left_out = pd.read_csv(tmp_path / "rsna.left_out.csv")
    assert list(left_out["file"].map(lambda p: Path(p).name)) == ["ID_6431af929.dcm"]
    assert left_out["reason"].str.startswith("pixel data is truncated").all()
    assert "1 slice file(s) whose pixel data cannot be decoded, left out: ID_6431af929.dcm" in said
    assert "rsna.left_out.csv" in said
    wrapped = [tmp_path / p for p in table["image"] if Path(p).stem in ("ID_000000006", "ID_000000007")]
    assert len(wrapped) == 2
    for path in wrapped:  # read through the manifest as every run reads it: air near -1000
        seed = int(path.stem[-1], 16)
        assert np.abs(load_ct_slice(path) - head_hu(seed=seed)).max() <= 1


@pytest.mark.slow
def test_finetune_runs_on_the_rsna_converters_manifest_with_default_options(kaggle_download, tmp_path):
    from conftest import TINY_MODEL_ARGS, run_vit_ct

    from vit_ct.cli import main

    main(["manifest", "--dataset", "rsna", str(kaggle_download), "--output", str(tmp_path / "rsna.csv")])
    (tmp_path / "configs").symlink_to(Path(__file__).resolve().parents[2] / "configs")
    fit = run_vit_ct("fit", "--config", "configs/finetune.yaml", "--data.manifest", "rsna.csv", *TINY_MODEL_ARGS,
                  "--data.init_args.batch_size", "4", "--data.init_args.num_workers", "0", "--trainer.max_epochs",
                  "1", cwd=tmp_path)  # fmt: skip
    assert f"rsna.csv: 2 slices with {UNWRAPPED} (RSNA 2019's known fault" in fit.stdout + fit.stderr


def test_a_short_file_is_found_with_or_without_pydicoms_deferred_elements(tmp_path, monkeypatch):
    from pydicom.dataset import Dataset

    from vit_ct.data.io.dicom import pixel_bytes_problem

    whole, short = tmp_path / "whole.dcm", tmp_path / "short.dcm"
    write_ct_dicom(whole, phantom_hu(64, 0), "ID_p")
    short.write_bytes(whole.read_bytes()[:-3000])
    assert pixel_bytes_problem(whole) is None
    assert pixel_bytes_problem(short) == "pixel data is truncated (the file ends 3000 bytes before it does)"
    real = Dataset.get_item

    def older(self, key, **kwargs):  # a pydicom whose get_item takes no keep_deferred
        if kwargs:
            raise TypeError("get_item() got an unexpected keyword argument 'keep_deferred'")
        return real(self, key)

    monkeypatch.setattr(Dataset, "get_item", older)
    assert pixel_bytes_problem(whole) is None
    assert pixel_bytes_problem(short).startswith("pixel data is truncated")
