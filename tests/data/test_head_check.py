"""A slice that is not an axial head CT (pydicom's CT_small.dcm, a vertebra; a header naming another body part) is
flagged in predictions.csv and said in one line; real and simulated head slices are not."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pydicom
import pytest
from conftest import DEMO, MANIFEST, TINY_MODEL_ARGS, run_vit_ct
from pydicom.data import get_testdata_file

from vit_ct import load_ct_slice
from vit_ct.data.io.head_check import ENCLOSED_SHARE, enclosed_share, head_check
from vit_ct.sim.phantom import PhantomConfig
from vit_ct.sim.synthetic import simulate_patient

HEAD = "693_UNCI.dcm"  # pydicom-data's head CT slice


def test_a_vertebra_is_flagged_and_a_real_head_slice_is_not():
    vertebra, head = get_testdata_file("CT_small.dcm"), get_testdata_file(HEAD)
    assert "no skull around the brain" in head_check(vertebra, load_ct_slice(vertebra))
    assert head_check(head, load_ct_slice(head)) == ""
    assert enclosed_share(load_ct_slice(head)) > 2 * ENCLOSED_SHARE


def test_simulated_head_slices_at_every_level_are_not_flagged():
    for index in range(3):
        for simulated in simulate_patient(3, index, 12, PhantomConfig(size=128, pixel_spacing_mm=1.8)):
            assert enclosed_share(simulated.hu) > 2 * ENCLOSED_SHARE


def _ring(size: int = 128, gap_px: int = 0, inside_hu: float = 30.0) -> np.ndarray:
    """An elliptic head: soft tissue, a 3-pixel skull with a gap of ``gap_px`` pixels at the top, ``inside_hu``
    within, air outside."""
    rows, cols = np.mgrid[:size, :size]
    r = np.hypot((rows - size / 2) / 0.45, (cols - size / 2) / 0.38) / size
    hu = np.where(r < 1.0, 1000.0, -1000.0)
    hu[r < 1.0 - 3 * 2 / (0.83 * size)] = inside_hu
    hu[: size // 2, size // 2 : size // 2 + gap_px] = np.where(r < 1.0, 40.0, -1000.0)[: size // 2, :gap_px]
    return hu


def test_a_skull_with_a_narrow_gap_still_encloses_the_brain_and_a_wide_opening_does_not():
    closed = enclosed_share(_ring())
    assert closed > 2 * ENCLOSED_SHARE
    assert enclosed_share(_ring(gap_px=2)) == pytest.approx(closed, abs=0.02)  # a suture, partial volume
    assert enclosed_share(_ring(gap_px=40)) < ENCLOSED_SHARE  # a craniectomy: a third of the skull is gone


def test_bone_around_air_is_not_a_head():
    chest = _ring(inside_hu=-850.0)  # a closed rib cage around lung
    chest[54:74, 54:74] = 40.0  # the mediastinum
    assert head_check("chest.npy", chest).startswith("air fills")
    assert head_check("head.npy", _ring()) == ""


def test_a_header_naming_another_body_part_is_flagged(tmp_path):
    dataset = pydicom.dcmread(get_testdata_file(HEAD))
    for part, flagged in (("CHEST", True), ("HEAD", False), ("Brain", False), ("", False)):
        dataset.BodyPartExamined = part
        path = tmp_path / f"{part or 'none'}.dcm"
        dataset.save_as(path)
        assert (head_check(path, load_ct_slice(path)) == f"not a head: BodyPartExamined is {part}") == flagged


@pytest.mark.slow
def test_predict_flags_the_slices_that_are_not_a_head_and_says_so(tiny_checkpoint, tmp_path):  # noqa: F811
    vertebra, head = get_testdata_file("CT_small.dcm"), get_testdata_file(HEAD)
    manifest = tmp_path / "m.csv"
    pd.DataFrame({"image": [vertebra, head], "label": [0, 0]}).to_csv(manifest, index=False)
    out = tmp_path / "out"
    run = run_vit_ct("predict", "--config", DEMO, "--config", MANIFEST, *TINY_MODEL_ARGS, "--data.init_args.img_size",
                  "32", "--data.manifest", str(manifest), "--ckpt_path", str(tiny_checkpoint), "--output_dir", str(out),
                  cwd=tmp_path)  # fmt: skip
    table = pd.read_csv(out / "predictions.csv", keep_default_na=False)
    assert table["outside_domain"].str.startswith("no skull around the brain").tolist() == [True, False]
    assert table.loc[1, "outside_domain"] == ""
    assert "1 of 2 slices do not look like an axial head CT" in run.stdout
