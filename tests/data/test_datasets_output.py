"""What a dataset converter leaves on disk: nothing of an earlier output is lost to bad input, ``overwrite`` replaces
the manifest and its mask folder together, and no staging folder survives."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from head_volumes import DCM2NIIX_AFFINE, head_hu, write_volume

from vit_ct.data.datasets import write_dataset_manifest
from vit_ct.files import OUTPUT_RECORD


def write_bhsd(root, name: str, values: list[int]) -> None:
    hu, labels = head_hu((12, 10, 2), seed=1), np.zeros((12, 10, 2), np.uint8)
    for i, value in enumerate(values):
        hu[3 + i, 4, 0], labels[3 + i, 4, 0] = 75, value
    write_volume(root / "images" / f"{name}.nii.gz", hu, DCM2NIIX_AFFINE)
    write_volume(root / "ground truths" / f"{name}.nii.gz", labels, DCM2NIIX_AFFINE)


def test_overwrite_replaces_the_manifest_and_its_masks_together_and_bad_input_keeps_both(tmp_path):
    first, second = tmp_path / "first" / "label_192", tmp_path / "second" / "label_192"
    write_bhsd(first, "ID_00000001_ID_0000000001", [2, 5])  # two bleed values: a binary mask is written
    write_bhsd(second, "ID_00000002_ID_0000000002", [1])  # one value: named where it lies, no mask folder
    out = tmp_path / "out" / "bhsd.csv"
    write_dataset_manifest("bhsd", first, out, progress=False)
    before = out.read_bytes()
    masks = sorted(p.name for p in (out.parent / "bhsd_masks").iterdir())
    assert masks == [OUTPUT_RECORD, "ID_00000001_ID_0000000001.nii.gz"]  # the masks, and the record of them

    with pytest.raises(ValueError, match="already exist"):
        write_dataset_manifest("bhsd", second, out, progress=False)
    (second / "ground truths" / "ID_00000002_ID_0000000002.nii.gz").write_bytes(b"not a NIfTI file")
    with pytest.raises(ValueError, match=r"ID_00000002_ID_0000000002\.nii\.gz is not a readable NIfTI file"):
        write_dataset_manifest("bhsd", second, out, progress=False, overwrite=True)
    assert out.read_bytes() == before and (out.parent / "bhsd_masks").is_dir()  # the earlier output, intact

    write_bhsd(second, "ID_00000002_ID_0000000002", [1])
    written = write_dataset_manifest("bhsd", second, out, progress=False, overwrite=True)
    assert set(pd.read_csv(out)["patient_id"]) == {"ID_00000002"}
    assert not (out.parent / "bhsd_masks").exists()  # the old masks went with the old manifest
    assert written.files == [out]
    assert sorted(p.name for p in out.parent.iterdir()) == ["bhsd.csv"]  # no staging or old folder left


def test_an_output_that_is_not_a_csv_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"expected a manifest file name ending in \.csv"):
        write_dataset_manifest("bhsd", tmp_path, tmp_path / "manifest.txt")


def test_overwrite_never_deletes_a_folder_or_file_of_the_users_that_has_the_outputs_name(tmp_path):
    root = tmp_path / "set" / "label_192"
    write_bhsd(root, "ID_00000001_ID_0000000001", [2, 5])
    out = tmp_path / "out" / "bhsd.csv"
    mine = out.parent / "bhsd_masks"
    mine.mkdir(parents=True)
    (mine / "my_segmentation.nii.gz").write_bytes(b"a user's own mask")
    with pytest.raises(ValueError, match=r"mask folder .*bhsd_masks .* did not write \(my_segmentation\.nii\.gz\)"):
        write_dataset_manifest("bhsd", root, out, progress=False, overwrite=True)
    assert (mine / "my_segmentation.nii.gz").read_bytes() == b"a user's own mask" and not out.exists()
    mine.rename(tmp_path / "elsewhere")

    out.write_text("patient,notes\n1,a spreadsheet of the user's\n")
    with pytest.raises(ValueError, match=r"bhsd\.csv exists and is not a manifest"):
        write_dataset_manifest("bhsd", root, out, progress=False, overwrite=True)
    assert out.read_text() == "patient,notes\n1,a spreadsheet of the user's\n"
    out.unlink()
    write_dataset_manifest("bhsd", root, out, progress=False)
    write_dataset_manifest("bhsd", root, out, progress=False, overwrite=True)  # its own earlier output: replaced
    assert sorted(p.name for p in out.parent.iterdir()) == ["bhsd.csv", "bhsd_masks"]
