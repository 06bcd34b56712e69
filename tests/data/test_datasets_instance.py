"""INSTANCE 2022 by name: a fixture in the training set's layout (train_2/data/NNN.nii.gz, train_2/label/NNN.nii.gz,
0 = background, 1 = bleed), converted; slice labels from the masks by hand, masks checked against the CT through
vit-ct's readers, a case without its label volume refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from head_volumes import DCM2NIIX_AFFINE, TILTED_AFFINE, bleed_pixels_agree, head_hu, write_volume

from vit_ct.data.datasets import write_dataset_manifest
from vit_ct.data.manifests.manifest import read_manifest, validate_manifest_files

CASES = {  # name: (affine, slices, bleed voxels, their label values)
    "001": (DCM2NIIX_AFFINE, 4, [(5, 5, 1), (5, 6, 1), (9, 12, 2)], [1, 1, 1]),
    "002": (TILTED_AFFINE, 3, [], []),
    "017": (DCM2NIIX_AFFINE, 5, [(14, 3, 0), (11, 11, 4)], [2, 1]),  # two bleed values: not binary for load_mask
}


@pytest.fixture
def instance_root(tmp_path) -> Path:
    root = tmp_path / "INSTANCE2022"
    for name, (affine, depth, bleeds, values) in CASES.items():
        hu, label = head_hu((22, 18, depth), seed=int(name)), np.zeros((22, 18, depth), np.uint8)
        for voxel, value in zip(bleeds, values, strict=True):
            hu[voxel], label[voxel] = 75, value
        write_volume(root / "train_2" / "data" / f"{name}.nii.gz", hu, affine)
        write_volume(root / "train_2" / "label" / f"{name}.nii.gz", label, affine)
    (root / "evaluation").mkdir()  # the validation images, without labels: not read
    return root


def test_slice_labels_come_from_the_masks(instance_root, tmp_path):
    out = tmp_path / "instance.csv"
    written = write_dataset_manifest("instance2022", instance_root, out, progress=False, scan_labels=True)
    table = pd.read_csv(out, keep_default_na=False)
    assert list(table["scan"]) == ["INSTANCE-001"] * 4 + ["INSTANCE-002"] * 3 + ["INSTANCE-017"] * 5
    assert list(table["slice"]) == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]
    assert list(table["label"]) == [0, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1]
    assert list(table["mask_pixels"]) == [0, 2, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1]
    assert list(table.groupby("scan")["scan_label"].max()) == [1, 0, 1]
    assert not set(table.columns) & {"epidural", "subdural"}  # INSTANCE has no subtypes
    assert table["image"][0] == "INSTANCE2022/train_2/data/001.nii.gz"  # below the manifest's folder: relative
    # 001 and 002 name the dataset's masks; 017's two bleed values are written again as a binary mask
    assert set(table["mask"][:7]) == {f"INSTANCE2022/train_2/label/{n}.nii.gz" for n in ("001", "002")}
    assert set(table["mask"][7:]) == {"instance_masks/INSTANCE-017.nii.gz"}
    assert any("017.nii.gz (labels other than 0 and one lesion value)" in note for note in written.notes)

    df = read_manifest(out)
    good, bad = validate_manifest_files(df, progress=False, workers=1)
    assert bad == [] and len(good) == 12
    for row in df.itertuples():
        assert bleed_pixels_agree(Path(row.image), Path(row.mask), row.slice), (row.image, row.slice)


def test_a_case_without_its_label_volume_is_named(instance_root, tmp_path):
    (instance_root / "train_2" / "label" / "002.nii.gz").unlink()
    with pytest.raises(ValueError, match=r"data/002\.nii\.gz \(no .*label/002\.nii\.gz\)"):
        write_dataset_manifest("instance", instance_root, tmp_path / "m.csv", progress=False)
    written = write_dataset_manifest("instance", instance_root, tmp_path / "m.csv", progress=False, on_missing="skip")
    assert set(written.table["scan"]) == {"INSTANCE-001", "INSTANCE-017"}
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ValueError, match=r"lacks data, label, and no folder .* holds data and label; expected data/NNN"
    ):
        write_dataset_manifest("instance", tmp_path / "empty", tmp_path / "n.csv", progress=False)
    # from a folder further up, as a download tree leaves it: the one folder holding data/ and label/ is read
    above = write_dataset_manifest("instance", tmp_path, tmp_path / "n.csv", progress=False, on_missing="skip")
    assert set(above.table["scan"]) == {"INSTANCE-001", "INSTANCE-017"}
    with pytest.raises(ValueError, match=r"instance has no option\(s\) \['min_thickness_mm'\]"):
        write_dataset_manifest("instance", instance_root, tmp_path / "n.csv", min_thickness_mm=3)


def test_a_label_volume_on_another_grid_is_refused(instance_root, tmp_path):
    label = instance_root / "train_2" / "label" / "001.nii.gz"
    write_volume(label, np.zeros((22, 18, 3), np.uint8), DCM2NIIX_AFFINE)  # 3 slices for a 4-slice CT
    with pytest.raises(ValueError, match=r"001\.nii\.gz has shape \(22, 18, 3\) but its CT .* has \(22, 18, 4\)"):
        write_dataset_manifest("instance", instance_root, tmp_path / "m.csv", progress=False)
    assert not (tmp_path / "m.csv").exists() and not (tmp_path / "m_masks").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left
