"""Each slice's neighbours in its scan: chosen by distance in mm (not index) from positions the manifest or the files
give, padded where a scan ends, and read as further channels on every data path (files, memory, disk cache)."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pandas as pd
import pydicom
import pytest
import torch
from pydicom.data import get_testdata_file
from pydicom.uid import generate_uid

from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.data.manifests.neighbours import neighbour_rows, slice_places, table_neighbours
from vit_ct.data.transforms.model_input import HEAD_HU, apply_windows


def rows_of(scans, positions, context_mm):
    return neighbour_rows(np.asarray(scans), np.asarray(positions, dtype=float), context_mm)


def test_neighbours_are_chosen_by_distance_within_each_scan_whatever_the_row_order():
    # scan 0 at 0, 5, 10, 15 mm given out of order; scan 1 at the same positions must never be mixed in
    scans = [0, 0, 0, 0, 1, 1]
    positions = [10.0, 0.0, 15.0, 5.0, 0.0, 5.0]
    found = rows_of(scans, positions, 5.0)
    assert found.rows.tolist() == [[3, 2], [1, 3], [0, 2], [1, 0], [4, 5], [4, 5]]
    # the slice at 0 mm has none below, the one at 15 none above; each scan of two has one end each
    assert (found.padded, found.alone, found.same_place) == (4, 0, 0)


def test_a_thin_series_reads_the_slice_nearest_the_distance_not_the_next_index():
    positions = np.arange(40) * 0.625  # a thin series: 0.625 mm apart
    found = rows_of(np.zeros(40, dtype=int), positions, 5.0)
    assert found.rows[20].tolist() == [12, 28]  # 8 slices = 5 mm either way
    # between two slices as near as each other, the one nearer the slice
    found = rows_of([0, 0, 0, 0], [0.0, 2.0, 4.0, 6.0], 3.0)
    assert found.rows[1].tolist() == [0, 2] and found.rows[2].tolist() == [1, 3]


def test_a_thick_series_reads_the_next_slice_and_a_gap_beyond_twice_the_distance_pads():
    found = rows_of([0, 0, 0], [0.0, 5.0, 10.0], 2.5)
    assert found.rows[1].tolist() == [0, 2]  # 5 mm away: within twice 2.5 mm
    found = rows_of([0, 0, 0], [0.0, 5.0, 20.0], 5.0)
    assert found.rows[1].tolist() == [0, 1]  # 15 mm above is beyond 10 mm: the slice itself
    assert found.padded == 3


def test_slices_without_a_scan_or_a_position_read_themselves_and_are_counted():
    found = rows_of([-1, 0, 0, 0], [0.0, np.nan, 0.0, 5.0], 5.0)
    assert found.rows[:2].tolist() == [[0, 0], [1, 1]]
    assert found.rows[2:].tolist() == [[2, 3], [2, 3]]
    assert found.alone == 2
    line = found.describe("m.csv (test)")
    assert line.startswith("m.csv (test): context 5 mm") and "2 with no scan or position" in line


def test_two_slices_at_one_position_are_said():
    found = rows_of([0, 0, 0], [0.0, 0.0, 5.0], 5.0)
    assert found.same_place == 2 and "share a position" in found.describe()


def test_a_distance_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="context_mm must be a distance > 0"):
        rows_of([0], [0.0], 0.0)


def series(folder, positions, *, orientation=(1, 0, 0, 0, 1, 0), patient="p1"):
    """A DICOM series made from pydicom's real CT_small.dcm, one file per position (LPS mm)."""
    folder.mkdir(parents=True, exist_ok=True)
    uid = generate_uid()
    paths = []
    for k, position in enumerate(positions):
        ds = pydicom.dcmread(get_testdata_file("CT_small.dcm"))
        ds.SeriesInstanceUID, ds.SOPInstanceUID, ds.PatientID = uid, generate_uid(), patient
        ds.ImagePositionPatient = list(position)
        ds.ImageOrientationPatient = list(orientation)
        ds.InstanceNumber = len(positions) - k  # instance numbers run against the positions: never read
        path = folder / f"{k}.dcm"
        ds.save_as(path)
        paths.append(str(path))
    return paths


def test_positions_come_from_the_dicom_geometry_along_the_slice_normal(tmp_path):
    # a tilted gantry: rows along x, columns in the y-z plane; the normal is row x column
    column = np.array([0.0, np.cos(0.3), np.sin(0.3)])
    normal = np.cross([1.0, 0.0, 0.0], column)
    origin = np.array([5.0, 2.0, 0.0])
    positions = [origin + normal * z for z in (7.5, 0.0, 2.5)]
    a = series(tmp_path / "a", positions, orientation=(1, 0, 0, *column))
    b = series(tmp_path / "b", [(0, 0, 0), (0, 0, 2.5)])  # the same patient's second series: another scan
    table = pd.DataFrame({"image": a + b, "patient_id": ["p1"] * 5})
    scans, found = slice_places(table)
    offset = origin @ normal  # ImagePositionPatient on the normal: the origin's share too
    np.testing.assert_allclose(found, [7.5 + offset, offset, 2.5 + offset, 0.0, 2.5], atol=1e-6)
    assert scans[0] == scans[1] == scans[2] != scans[3] == scans[4]
    assert table_neighbours(table, 2.5).rows[:3].tolist() == [[2, 0], [1, 2], [1, 0]]


def test_the_manifests_position_column_comes_first_and_a_bad_cell_names_its_line(tmp_path):
    paths = series(tmp_path / "a", [(0, 0, 0), (0, 0, 5), (0, 0, 10)])
    table = pd.DataFrame({"image": paths, "scan": ["s"] * 3, "position_mm": ["10", "", "0"]})
    _, positions = slice_places(table)
    np.testing.assert_allclose(positions, [10.0, 5.0, 0.0])  # the empty cell from the file
    table["position_mm"] = ["1", "two", "3"]
    table["manifest_line"] = [2, 3, 4]
    table.attrs["manifest"] = "my.csv"
    with pytest.raises(ValueError, match=r"my.csv: column 'position_mm' must hold .* lines 3$"):
        slice_places(table)


def test_positions_of_a_volumes_slices_come_from_its_affine(tmp_path):
    affine = np.diag([0.5, 0.5, 2.5, 1.0])
    affine[:3, 3] = [-10, -10, 40]
    path = tmp_path / "v.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 4), np.int16), affine), path)
    table = pd.DataFrame({"image": [str(path)] * 4, "slice": [3, 0, 2, 1]})
    scans, positions = slice_places(table)
    np.testing.assert_allclose(positions, [47.5, 40.0, 45.0, 42.5])
    assert (scans == scans[0]).all() and scans[0] >= 0  # the volume is the scan (no patient_id)


def test_windows_of_three_slices_put_the_slices_own_first_and_take_the_head_from_it():
    hu = torch.tensor([40.0, -1000.0, 1000.0]).view(3, 1, 1).expand(3, 2, 2).clone()
    item = apply_windows({"hu": hu}, [(40.0, 80.0), (80.0, 200.0)])
    assert item["image"].shape == (6, 2, 2)
    assert item["image"][:, 0, 0].tolist() == pytest.approx([0.5, 0.3, 0.0, 0.0, 1.0, 1.0])
    assert item["head"].shape == (1, 2, 2) and bool((item["head"] == float(HEAD_HU < 40.0)).all())


@pytest.mark.parametrize("cache", [False, "memory", "disk"])
def test_items_with_context_are_the_slices_own_items_side_by_side_on_every_path(synthetic_set, tmp_path, cache):
    arguments = {"img_size": 32, "num_workers": 0, "batch_size": 4, "cache_dir": str(tmp_path)}
    alone = CTSliceDataModule(str(synthetic_set), cache=False, **arguments)
    alone.setup("fit")
    data = CTSliceDataModule(str(synthetic_set), cache=cache, context_mm=20.0, **arguments)
    data.setup("fit")
    assert data.num_channels == 6 and data.input_contract(16).context_mm == 20.0
    dataset = data.datasets["train"]
    # the synthetic set's slices of a patient are one DICOM series at increasing heights: no row is its own
    # neighbour on both sides, and a neighbour is always of the same patient
    table = dataset.table
    below, above = dataset.neighbours.T
    assert (table["patient_id"].to_numpy()[below] == table["patient_id"].to_numpy()).all()
    assert ((below != np.arange(len(table))) | (above != np.arange(len(table)))).all()
    batch = next(iter(data.train_dataloader()))
    batch = apply_windows(batch, data.windows) if "hu" in batch else batch
    reference = alone.datasets["train"]
    for i, row in enumerate(batch["index"].tolist()):
        expected = torch.cat([reference.load(int(r))["image"] for r in (row, below[row], above[row])])
        tolerance = 2e-3 if cache == "disk" else 0.0  # the disk cache holds float16 HU
        torch.testing.assert_close(batch["image"][i], expected, atol=tolerance, rtol=0)
        torch.testing.assert_close(batch["mask"][i].float(), reference.load(row)["mask"].float())
