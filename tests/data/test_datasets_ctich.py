"""PhysioNet CT-ICH v1.3.1 by name: a fixture in the dataset's layout (ct_scans/NNN.nii, masks/NNN.nii, the
per-slice diagnosis CSV with a byte-order mark, SliceNumber from 1), converted and checked row by row against the
hand-made truth, the masks against the CT through vit-ct's own readers, and bad folders refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from head_volumes import DCM2NIIX_AFFINE, bleed_pixels_agree, head_hu, write_volume

from vit_ct.data.datasets import write_dataset_manifest
from vit_ct.data.io.reader import load_mask
from vit_ct.data.manifests.manifest import read_manifest, validate_manifest_files

SUBTYPES = ["epidural", "intraparenchymal", "intraventricular", "subarachnoid", "subdural"]
HEADER = ("PatientNumber,SliceNumber,Intraventricular,Intraparenchymal,Subarachnoid,Epidural,Subdural,No_Hemorrhage,"
          "Fracture_Yes_No")  # fmt: skip
# (patient, slice from 1) -> (IVH, IPH, SAH, EDH, SDH, No_Hemorrhage, Fracture), in the CSV's column order
DIAGNOSIS = {
    (49, 1): (0, 0, 0, 0, 0, 1, 0), (49, 2): (0, 1, 0, 0, 0, 0, 0), (49, 3): (1, 1, 0, 0, 0, 0, 1),
    (49, 4): (0, 0, 0, 0, 0, 1, 1),
    (50, 1): (0, 0, 0, 0, 0, 1, 0), (50, 2): (0, 0, 0, 0, 0, 1, 0), (50, 3): (0, 0, 0, 0, 0, 1, 0),
    (66, 1): (0, 0, 0, 0, 1, 0, 0), (66, 2): (0, 0, 0, 0, 0, 1, 0), (66, 3): (0, 0, 0, 1, 0, 0, 0),
    (66, 4): (0, 0, 0, 0, 0, 0, 0), (66, 5): (0, 0, 0, 0, 0, 1, 0),
}  # fmt: skip
BLEEDS = {  # voxels (i, j, k) of each patient's volume
    49: [(6, 8, 1), (7, 8, 1), (12, 10, 2), (10, 10, 3)], 50: [], 66: [(3, 9, 0), (4, 9, 0), (15, 4, 3)]
}  # fmt: skip


@pytest.fixture
def ctich_root(tmp_path) -> Path:
    """The archive as unpacked: a top folder holding ct_scans/, masks/, the CSVs and the ReadMe."""
    root = tmp_path / "computed-tomography-images-for-intracranial-hemorrhage-detection-and-segmentation-1.3.1"
    for n, depth in ((49, 4), (50, 3), (66, 5)):
        hu, lesion = head_hu((24, 20, depth), seed=n), np.zeros((24, 20, depth), np.uint8)
        for voxel in BLEEDS[n]:
            hu[voxel], lesion[voxel] = 75, 1
        # 050 stores HU + 1024 with an intercept; 066's mask is 0/255 and saved without the CT's affine
        write_volume(root / "ct_scans" / f"{n:03d}.nii", hu, DCM2NIIX_AFFINE, stored_plus_1024=n == 50)
        write_volume(root / "masks" / f"{n:03d}.nii", lesion * (255 if n == 66 else 1), np.eye(4) if n == 66
                     else DCM2NIIX_AFFINE)  # fmt: skip
    rows = [f"{p},{s}," + ",".join(map(str, v)) for (p, s), v in DIAGNOSIS.items()]
    (root / "hemorrhage_diagnosis_raw_ct.csv").write_text("\n".join([HEADER, *rows]) + "\n", encoding="utf-8-sig")
    (root / "Patient_demographics.csv").write_text("Patient Number,Age\n49,30\n50,20\n66,41\n")
    return root


def test_rows_follow_the_diagnosis_csv_and_the_masks(ctich_root, tmp_path):
    out = tmp_path / "out" / "ctich.csv"
    written = write_dataset_manifest("ctich", ctich_root.parent, out, progress=False)
    table = pd.read_csv(out, keep_default_na=False)
    assert len(table) == 12 and list(table["scan"].unique()) == ["CT-ICH-049", "CT-ICH-050", "CT-ICH-066"]
    assert (table["patient_id"] == table["scan"]).all()
    assert list(table["slice"]) == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]  # SliceNumber - 1
    # label: a subtype or No_Hemorrhage = 0; 066 slice 4 says neither (a disagreement, counted) and is a bleed
    assert list(table["label"]) == [0, 1, 1, 0, 0, 0, 0, 1, 0, 1, 1, 0]
    assert list(table["intraparenchymal"]) == [0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    assert list(table["intraventricular"]) == [0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    assert list(table["subdural"]) == [0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]
    assert list(table["epidural"]) == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0]
    assert list(table["fracture"]) == [0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    assert list(table["mask_pixels"]) == [0, 2, 1, 1, 0, 0, 0, 2, 0, 0, 1, 0]
    # 049 and 050 name the dataset's binary masks; 066's (no CT affine) is rewritten on the CT's grid; the slices
    # labelled with a bleed but empty in the mask (066 slice 3) get no mask
    masks = list(table["mask"])  # the dataset lies outside the manifest's folder: absolute paths
    given = ctich_root / "masks"
    assert masks[:7] == [(given / "049.nii").as_posix()] * 4 + [(given / "050.nii").as_posix()] * 3
    assert masks[7:] == ["ctich_masks/CT-ICH-066.nii.gz", "ctich_masks/CT-ICH-066.nii.gz", "",
                         "ctich_masks/CT-ICH-066.nii.gz", "ctich_masks/CT-ICH-066.nii.gz"]  # fmt: skip
    assert written.files == [out, out.parent / "ctich_masks"]
    notes = " | ".join(written.notes)
    assert "1 CSV row(s) where No_Hemorrhage disagrees" in notes and "lines 12" in notes
    assert "1 slice(s) labelled with a bleed have an empty mask" in notes
    assert "1 slice(s) labelled without a bleed have mask voxels" in notes  # 049 slice 4: kept, mask_pixels says so
    assert "066.nii (an affine other than its CT's)" in notes


def test_masks_land_on_the_ct_pixels_and_the_manifest_passes_the_checks(ctich_root, tmp_path):
    out = tmp_path / "ctich.csv"
    write_dataset_manifest("ctich", ctich_root, out, progress=False, scan_labels=True)
    df = read_manifest(out, label_columns=["label", *SUBTYPES])
    good, bad = validate_manifest_files(df, progress=False, workers=1)
    assert bad == [] and len(good) == 12
    for row in df[df["mask"].notna()].itertuples():
        assert bleed_pixels_agree(Path(row.image), Path(row.mask), row.slice), (row.image, row.slice)
    # a bleed voxel (i, j) of the volume is displayed at (j, i): this affine puts rows along voxel axis 1
    lesion = load_mask(df["mask"].iloc[1], 1)
    assert lesion.shape == (20, 24) and lesion[8, 6] and lesion[8, 7] and lesion.sum() == 2
    scans = pd.read_csv(out).groupby("scan")[["scan_label", "scan_subdural", "scan_intraparenchymal"]].max()
    assert scans.to_dict("index") == {
        "CT-ICH-049": {"scan_label": 1, "scan_subdural": 0, "scan_intraparenchymal": 1},
        "CT-ICH-050": {"scan_label": 0, "scan_subdural": 0, "scan_intraparenchymal": 0},
        "CT-ICH-066": {"scan_label": 1, "scan_subdural": 1, "scan_intraparenchymal": 0},
    }


def test_a_patient_of_the_csv_without_its_volume_is_named(ctich_root, tmp_path):
    (ctich_root / "ct_scans" / "050.nii").unlink()
    with pytest.raises(ValueError, match=r"ct_scans/050\.nii \(patient 50\).*on_missing='skip'"):
        write_dataset_manifest("ctich", ctich_root, tmp_path / "m.csv", progress=False)
    assert not (tmp_path / "m.csv").exists()
    written = write_dataset_manifest("ctich", ctich_root, tmp_path / "m.csv", progress=False, on_missing="skip")
    assert set(written.table["scan"]) == {"CT-ICH-049", "CT-ICH-066"}
    assert any("050.nii (patient 50)" in note for note in written.notes)


def test_bad_folders_and_tables_are_refused_by_name(ctich_root, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"lacks ct_scans, masks, hemorrhage_diagnosis_raw_ct\.csv"):
        write_dataset_manifest("ctich", empty, tmp_path / "m.csv", progress=False)
    with pytest.raises(ValueError, match=r"folder .*nowhere not found"):
        write_dataset_manifest("ctich", tmp_path / "nowhere", tmp_path / "m.csv", progress=False)
    csv = ctich_root / "hemorrhage_diagnosis_raw_ct.csv"
    text = csv.read_text(encoding="utf-8-sig")
    csv.write_text(text.replace("66,5,0,0,0,0,0,1,0", "66,5,0,0,0,0,0,2,0"), encoding="utf-8-sig")
    with pytest.raises(ValueError, match=r"No_Hemorrhage must hold 0 or 1; bad on lines 13"):
        write_dataset_manifest("ctich", ctich_root, tmp_path / "m.csv", progress=False)
    csv.write_text("\n".join(text.splitlines()[:-1]) + "\n", encoding="utf-8-sig")  # 066 loses its last slice's row
    with pytest.raises(ValueError, match=r"patient 66 has 4 rows.*066\.nii has 5 slices; expected SliceNumber 1\.\.5"):
        write_dataset_manifest("ctich", ctich_root, tmp_path / "m.csv", progress=False)
    shutil.rmtree(ctich_root / "masks")
    with pytest.raises(ValueError, match="lacks masks"):
        write_dataset_manifest("ctich", ctich_root, tmp_path / "m.csv", progress=False)


def test_physionets_wget_tree_is_read_from_the_folder_wget_ran_in_and_two_copies_are_named(ctich_root, tmp_path):
    """`wget -r -N -c -np https://physionet.org/files/ct-ich/1.3.1/` (PhysioNet's own command) lays the set out as
    physionet.org/files/ct-ich/1.3.1/ below the folder it ran in: found from there."""
    downloads = tmp_path / "downloads"
    tree = downloads / "physionet.org" / "files" / "ct-ich" / "1.3.1"
    tree.parent.mkdir(parents=True)
    shutil.copytree(ctich_root, tree)
    written = write_dataset_manifest("ctich", downloads, tmp_path / "m.csv", progress=False)
    assert set(written.table["scan"]) == {"CT-ICH-049", "CT-ICH-050", "CT-ICH-066"}
    assert all((tmp_path / image).is_relative_to(tree) for image in written.table["image"])  # beside m.csv
    shutil.copytree(ctich_root, downloads / "an older copy")
    with pytest.raises(ValueError, match=r"2 folders under .*downloads hold ct_scans and masks and .*an older copy;"
                       r" .*1\.3\.1; pass the one to read"):  # fmt: skip
        write_dataset_manifest("ctich", downloads, tmp_path / "n.csv", progress=False)
