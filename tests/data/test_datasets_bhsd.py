"""BHSD by name: fixtures in both of its layouts (label_192/images + 'ground truths', and the imagesTr/labelsTr +
imagesTs/labelsTs split of its dataset.json), with masks of the five values (1 epidural .. 5 subdural); slice labels
and subtypes by hand, the binary masks written beside the manifest checked against the CT through vit-ct's readers."""

from __future__ import annotations

import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pytest
from head_volumes import DCM2NIIX_AFFINE, TILTED_AFFINE, bleed_pixels_agree, head_hu, write_volume

from vit_ct.data.datasets import write_dataset_manifest
from vit_ct.data.manifests.manifest import read_manifest, validate_manifest_files

SUBTYPES = ["epidural", "intraparenchymal", "intraventricular", "subarachnoid", "subdural"]
VOLUMES = {  # RSNA PatientID_StudyInstanceUID: (affine, slices, {voxel: label value})
    "ID_0237f3c9_ID_40015688b9": (DCM2NIIX_AFFINE, 4, {(4, 6, 0): 5, (4, 7, 0): 5, (10, 9, 1): 2, (11, 9, 1): 3}),
    "ID_05331dc6_ID_47213b7e2e": (TILTED_AFFINE, 3, {(8, 8, 2): 1, (9, 12, 2): 4}),
    "ID_0237f3c9_ID_a4892e60ae": (DCM2NIIX_AFFINE, 2, {}),  # the same patient's second study, no bleed
}


def write_case(images: Path, labels: Path, name: str) -> None:
    affine, depth, bleeds = VOLUMES[name]
    hu, mask = head_hu((20, 26, depth), seed=len(name) + depth), np.zeros((20, 26, depth), np.uint8)
    for voxel, value in bleeds.items():
        hu[voxel], mask[voxel] = 75, value
    write_volume(images / f"{name}.nii.gz", hu, affine)
    write_volume(labels / f"{name}.nii.gz", mask, affine)


@pytest.fixture
def label_192(tmp_path) -> Path:
    """label_192.zip as unpacked: label_192/images and label_192/ground truths."""
    root = tmp_path / "downloads" / "label_192"
    for name in VOLUMES:
        write_case(root / "images", root / "ground truths", name)
    return root


def test_subtypes_come_from_the_mask_values(label_192, tmp_path):
    out = tmp_path / "work" / "bhsd.csv"
    written = write_dataset_manifest("bhsd", label_192.parent, out, progress=False, scan_labels=True)
    table = pd.read_csv(out, keep_default_na=False)
    names = list(VOLUMES)
    assert list(table["scan"]) == [names[0]] * 4 + [names[2]] * 2 + [names[1]] * 3  # files in name order
    assert list(table["patient_id"]) == ["ID_0237f3c9"] * 6 + ["ID_05331dc6"] * 3  # RSNA's PatientID
    assert list(table["study_uid"]) == ["ID_40015688b9"] * 4 + ["ID_a4892e60ae"] * 2 + ["ID_47213b7e2e"] * 3
    assert list(table["label"]) == [1, 1, 0, 0, 0, 0, 0, 0, 1]
    expected = {  # slices with each type: 5 subdural on 0/0, 2 and 3 on 0/1, 1 epidural and 4 subarachnoid on 1/2
        "subdural": [1, 0, 0, 0, 0, 0, 0, 0, 0],
        "intraparenchymal": [0, 1, 0, 0, 0, 0, 0, 0, 0],
        "intraventricular": [0, 1, 0, 0, 0, 0, 0, 0, 0],
        "epidural": [0, 0, 0, 0, 0, 0, 0, 0, 1],
        "subarachnoid": [0, 0, 0, 0, 0, 0, 0, 0, 1],
    }
    assert {t: list(table[t]) for t in SUBTYPES} == expected
    assert list(table["mask_pixels"]) == [2, 2, 0, 0, 0, 0, 0, 0, 2]
    scans = table.groupby("scan")[["scan_label", *(f"scan_{t}" for t in SUBTYPES)]].max()
    assert scans.loc[names[0]].tolist() == [1, 0, 1, 1, 0, 1] and scans.loc[names[2]].tolist() == [0] * 6
    # masks of several bleed values are written again, binary, beside the manifest; the one without a bleed (0 only)
    # is binary as it is and named where it lies
    assert (
        list(table["mask"])
        == [f"bhsd_masks/{names[0]}.nii.gz"] * 4
        + [(label_192 / "ground truths" / f"{names[2]}.nii.gz").as_posix()] * 2
        + [f"bhsd_masks/{names[1]}.nii.gz"] * 3
    )
    assert written.files == [out, out.parent / "bhsd_masks"]
    masks = sorted(p.name for p in (out.parent / "bhsd_masks").glob("*.nii.gz"))
    assert masks == [f"{names[0]}.nii.gz", f"{names[1]}.nii.gz"]
    for name in names[:2]:
        mask = nib.load(out.parent / "bhsd_masks" / f"{name}.nii.gz")
        assert set(np.unique(np.asanyarray(mask.dataobj))) <= {0, 1}
        assert np.allclose(mask.affine, VOLUMES[name][0], atol=1e-4)

    df = read_manifest(out, label_columns=["label", *SUBTYPES])
    good, bad = validate_manifest_files(df, progress=False, workers=1)
    assert bad == [] and len(good) == 9
    for row in df.itertuples():
        assert bleed_pixels_agree(Path(row.image), Path(row.mask), row.slice), (row.image, row.slice)


def test_the_split_layout_of_dataset_json_is_read(tmp_path):
    root = tmp_path / "bhsd"
    names = list(VOLUMES)
    write_case(root / "imagesTr", root / "labelsTr", names[0])
    write_case(root / "imagesTs", root / "labelsTs", names[1])
    table = write_dataset_manifest("bhsd", root, tmp_path / "m.csv", progress=False).table
    assert list(table["official_split"]) == ["train"] * 4 + ["test"] * 3
    assert "split" not in table.columns  # vit-ct's own split (train/val/test by patient) stays the user's


def test_test_images_released_without_their_labels_are_said_not_dropped_silently(tmp_path):
    root = tmp_path / "downloads" / "BHSD"
    names = list(VOLUMES)
    write_case(root / "imagesTr", root / "labelsTr", names[0])
    write_case(root / "imagesTs", root / "labelsTs", names[1])
    shutil.rmtree(root / "labelsTs")
    written = write_dataset_manifest("bhsd", tmp_path / "downloads", tmp_path / "m.csv", progress=False)  # found below
    assert list(written.table["official_split"]) == ["train"] * 4
    assert f"1 volume(s) in {root / 'imagesTs'} without labelsTs/ beside it: unlabelled, left out" in written.notes


def test_unknown_mask_values_and_missing_files_are_refused_by_name(label_192, tmp_path):
    name = list(VOLUMES)[1]
    write_volume(label_192 / "ground truths" / f"{name}.nii.gz", np.full((20, 26, 3), 6, np.uint8), TILTED_AFFINE)
    with pytest.raises(ValueError, match=rf"{name}\.nii\.gz holds the values \[6\]; expected 0 or 1 \(epidural\)"):
        write_dataset_manifest("bhsd", label_192, tmp_path / "m.csv", progress=False)
    (label_192 / "ground truths" / f"{name}.nii.gz").unlink()
    with pytest.raises(ValueError, match=rf"images/{name}\.nii\.gz \(no .*ground truths/{name}\.nii\.gz\)"):
        write_dataset_manifest("bhsd", label_192, tmp_path / "m.csv", progress=False)
    with pytest.raises(
        ValueError,
        match=r"nor a folder up to 5 levels below it holds one of the layouts; expected images/ and 'ground truths/'",
    ):
        write_dataset_manifest("bhsd", label_192 / "images", tmp_path / "m.csv", progress=False)
    assert not (tmp_path / "m.csv").exists() and not (tmp_path / "m_masks").exists()
