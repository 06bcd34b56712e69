"""vit_ct.data.manifests.manifest: reading and checking the CSV, the seeded split by patient, and the file check."""

import shutil
import textwrap

import numpy as np
import pandas as pd
import pytest
from pydicom.data import get_testdata_file

from vit_ct.data.manifests.manifest import BadFile, assign_splits, read_manifest, validate_manifest_files


def write_csv(folder, text, name="manifest.csv"):
    path = folder / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


@pytest.fixture
def slices(tmp_path):
    """A data folder with .npy slices (4x5 HU), a 3-slice stack, two real DICOMs, and masks."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        np.save(data / f"s{i}.npy", np.full((4, 5), 10.0 * i, np.float32))
    np.save(data / "stack.npy", np.zeros((4, 5, 3), np.float32))
    np.save(data / "mask.npy", np.eye(4, 5, dtype=np.uint8))
    np.save(data / "wrong_mask.npy", np.zeros((3, 3), np.uint8))
    for name in ["CT_small.dcm", "693_UNCR.dcm"]:
        path = get_testdata_file(name)
        if path is None:
            pytest.skip(f"{name} is not in the installed pydicom test files")
        shutil.copy(path, data / name.replace(".dcm", ""))  # DICOM without extension, detected by content
    return data


def test_read_manifest_resolves_paths_and_types(tmp_path, slices):
    path = write_csv(
        tmp_path,
        f"""
        image,label,patient_id,split,mask,slice,site
        data/s0.npy,0,p1,train,data/mask.npy,,A
        data/stack.npy,1,p2, VAL ,,2,B
        {slices / "CT_small"},2,,,,,C
        """,
    )
    df = read_manifest(path)
    assert df["image"].tolist() == [str(slices / "s0.npy"), str(slices / "stack.npy"), str(slices / "CT_small")]
    assert df["image_ref"].tolist() == ["data/s0.npy", "data/stack.npy", str(slices / "CT_small")]
    assert df["label"].dtype == "Int64" and df["label"].tolist() == [0, 1, 2]
    assert df["split"].tolist() == ["train", "val", None]
    assert df["patient_id"].tolist() == ["p1", "p2", None]
    assert df["mask"].tolist() == [str(slices / "mask.npy"), None, None]
    assert df["mask_ref"].tolist() == ["data/mask.npy", None, None]
    assert df["slice"].dtype == "Int64" and pd.isna(df["slice"][0]) and df["slice"][1] == 2
    assert df["manifest_line"].tolist() == [2, 3, 4]
    assert df["site"].tolist() == ["A", "B", "C"]
    assert df.attrs["label_columns"] is None


def test_read_manifest_relative_to_csv_folder_not_cwd(tmp_path, slices, monkeypatch):
    sub = tmp_path / "lists"
    sub.mkdir()
    path = write_csv(sub, "image,label\n../data/s1.npy,1\n")
    monkeypatch.chdir(slices)
    assert read_manifest(path)["image"].tolist() == [str(slices / "s1.npy")]


def test_multilabel_columns(tmp_path):
    path = write_csv(tmp_path, "image,epidural,subdural\na.npy,0,1\nb.npy,1,1\nc.npy,0,0\n")
    df = read_manifest(path, label_columns=["epidural", "subdural"])
    assert df["subdural"].tolist() == [1, 1, 0] and df.attrs["label_columns"] == ["epidural", "subdural"]
    with pytest.raises(ValueError, match="lacks the 'intraventricular' column"):
        read_manifest(path, label_columns=["epidural", "intraventricular"])
    bad = write_csv(tmp_path, "image,epidural\na.npy,0\nb.npy,2\n", "bad.csv")
    with pytest.raises(ValueError, match=r"'epidural' must hold 0 or 1; bad value on lines 3"):
        read_manifest(bad, label_columns=["epidural"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "is empty"),
        ("\n\n", "is empty"),
        ("image,label\n", "has a header but no data rows"),
        ("path,label\na.npy,1\n", "lacks the 'image' column"),
        ("image\na.npy\n", "lacks the 'label' column"),
        ("image;label\na.npy;1\n", "is the file comma-separated"),
        ("image,label\na.npy,1\n,0\n", "empty 'image' on lines 3"),
        (
            "image,label\na.npy,1\nb.npy,-1\nc.npy,x\nd.npy,1.5\ne.npy,\n",
            "integers >= 0; bad value on lines 3, 4, 5, 6",
        ),
        ("image,label,split\na.npy,1,train\nb.npy,0,training\nc.npy,0,Test\n", "bad on lines 3"),
        ("image,label,slice\na.npy,1,-2\n", "'slice' must hold integers >= 0; bad value on lines 2"),
        ("image,label\na.npy,1,extra\n", "lines 2 have more fields than the header"),
        ("image,label,label\na.npy,1,1\n", "appear more than once"),
        ("image,label\n\n\na.npy,1\n\nb.npy,x\n", "bad value on lines 6"),  # blank lines keep line numbers true
    ],
)
def test_read_manifest_errors(tmp_path, text, message):
    path = write_csv(tmp_path, text)
    with pytest.raises(ValueError, match=message) as error:
        read_manifest(path)
    assert str(path) in str(error.value)


def test_read_manifest_missing_and_unlabelled(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        read_manifest(tmp_path / "nope.csv")
    path = write_csv(tmp_path, "image\na.npy\n")
    assert read_manifest(path, require_labels=False)["label"].isna().all()
    path = write_csv(tmp_path, "image,label\na.npy,\nb.npy,1\n", "some.csv")
    assert read_manifest(path, require_labels=False)["label"].tolist()[1] == 1


def test_patient_in_two_splits(tmp_path):
    path = write_csv(
        tmp_path, "image,label,patient_id,split\na.npy,1,p7,train\nb.npy,0,p7,test\nc.npy,0,p8,val\nd.npy,0,p8,val\n"
    )
    with pytest.raises(ValueError, match=r"patient 'p7': test \(lines 3\), train \(lines 2\)"):
        read_manifest(path)


# ---------------------------------------------------------------------------------------------------- splits


def table(n_patients=40, slices_per_patient=3, positive_every=4, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(n_patients):
        for s in range(slices_per_patient):
            label = int(p % positive_every == 0 and rng.random() < 0.8)
            rows.append({"image": f"/x/p{p}_{s}.npy", "label": label, "patient_id": f"p{p}", "split": None})
    return pd.DataFrame(rows)


def test_assign_splits_by_patient_deterministic_and_stratified():
    df = table()
    a = assign_splits(df, seed=1)
    b = assign_splits(df, seed=1)
    pd.testing.assert_frame_equal(a, b)
    assert not assign_splits(df, seed=2)["split"].equals(a["split"])
    assert a.groupby("patient_id")["split"].nunique().max() == 1  # no patient in two splits
    counts = a["split"].value_counts()
    assert set(counts.index) == {"train", "val", "test"}
    assert abs(counts["train"] / len(a) - 0.7) < 0.1
    positives = a[a["label"] > 0]["split"].value_counts()
    assert set(positives.index) == {"train", "val", "test"}  # every split gets lesions


def test_assign_splits_keeps_given_and_joins_patient():
    df = table(n_patients=10)
    df.loc[0, "split"] = "test"  # p0's first slice: the other p0 slices follow it
    df.loc[df["patient_id"] == "p1", "split"] = "val"
    out = assign_splits(df, seed=0)
    assert (out.loc[df["patient_id"] == "p0", "split"] == "test").all()
    assert (out.loc[df["patient_id"] == "p1", "split"] == "val").all()
    assert df["split"].isna().sum() > 0  # input untouched


def test_assign_splits_rows_without_patient_are_their_own_patient():
    df = pd.DataFrame({"image": [f"{i}.npy" for i in range(9)], "label": [1, 0, 1, 0, 1, 0, 0, 0, 0]})
    out = assign_splits(df, fractions=(0.6, 0.2, 0.2), seed=3)
    assert out["split"].notna().all()
    assert set(out.loc[out["label"] == 1, "split"]) == {"train", "val", "test"}  # 3 positives, one per split


def test_assign_splits_zero_fraction_and_bad_fractions():
    out = assign_splits(table(n_patients=8), fractions=(0.8, 0.2, 0.0))
    assert "test" not in set(out["split"])
    for bad in [(0.5, 0.5), (0.7, 0.2, 0.2), (1.2, -0.1, -0.1)]:
        with pytest.raises(ValueError, match="fractions must be"):
            assign_splits(table(), fractions=bad)


def test_assign_splits_multilabel_from_attrs(tmp_path):
    lines = ["image,patient_id,epidural,subdural"] + [f"{i}.npy,p{i},{int(i < 3)},0" for i in range(12)]
    path = write_csv(tmp_path, "\n".join(lines) + "\n")
    out = assign_splits(read_manifest(path, label_columns=["epidural", "subdural"]))
    assert set(out.loc[out["epidural"] == 1, "split"]) == {"train", "val", "test"}


# ---------------------------------------------------------------------------------------------------- files


def test_validate_manifest_files_good(tmp_path, slices):
    path = write_csv(
        tmp_path,
        """
        image,label,mask,slice
        data/s0.npy,0,data/mask.npy,
        data/stack.npy,1,data/mask.npy,2
        data/CT_small,1,,
        data/693_UNCR,0,,
        """,
    )
    good, bad = validate_manifest_files(read_manifest(path), progress=False)
    assert bad == [] and len(good) == 4


def test_validate_manifest_files_lists_every_bad_row(tmp_path, slices):
    (slices / "empty.dcm").write_bytes(b"")
    (slices / "notes.txt").write_text("hello")
    path = write_csv(
        tmp_path,
        """
        image,label,mask,slice
        data/s0.npy,0,,
        data/missing.npy,1,,
        data/empty.dcm,0,,
        data/notes.txt,1,,
        data/stack.npy,0,,
        data/stack.npy,0,,5
        data/s1.npy,0,data/wrong_mask.npy,
        data/s2.npy,0,data/no_mask.png,
        data/CT_small,1,data/mask.npy,
        data/s3.npy,1,,
        """,
    )
    df = read_manifest(path)
    with pytest.raises(ValueError) as error:
        validate_manifest_files(df, progress=False)
    message = str(error.value)
    assert "8 of 10 manifest rows" in message and str(path) in message
    for line, text in [
        (3, "file not found"),
        (4, "file is empty"),
        (5, "not a DICOM file"),
        (6, "holds 3 slices"),
        (7, "frame 5 is out of range"),
        (8, "mask is 3x3 but the slice is 4x5"),
        (9, "no_mask.png: file not found"),
        (10, "mask is 4x5 but the slice is 128x128"),
    ]:
        assert f"line {line}: " in message and text in message, (line, text)
        assert text in message.split(f"line {line}: ")[1].split("\n")[0], (line, text)
    assert "line 2:" not in message and "line 11:" not in message

    good, bad = validate_manifest_files(df, on_bad_file="skip", progress=True)
    assert good["image_ref"].tolist() == ["data/s0.npy", "data/s3.npy"]
    assert [b.line for b in bad] == [3, 4, 5, 6, 7, 8, 9, 10]
    assert all(isinstance(b, BadFile) for b in bad)
    assert bad[5].column == "mask" and bad[5].path == str(slices / "wrong_mask.npy")
    assert bad[0].column == "image" and bad[0].path == str(slices / "missing.npy")


def test_validate_manifest_files_argument_and_plain_table(slices):
    df = pd.DataFrame({"image": [str(slices / "s0.npy"), str(slices / "nothing.npy")]})
    with pytest.raises(ValueError, match="on_bad_file must be"):
        validate_manifest_files(df, on_bad_file="ignore")
    with pytest.raises(ValueError, match=r"row = 1-based row\):\n  row 2: image"):
        validate_manifest_files(df, progress=False)


# ------------------------------------------------------------------------------------ what the loaders would refuse


def test_file_check_sees_what_the_loader_sees(tmp_path, slices):
    """NaN in a mask .npy or a NIfTI slice, values that are not HU, non-CT DICOM, a slice without pixels, soft and
    multi-valued masks, an empty mask on a lesion slice: each found before the run, by CSV line, and skippable."""
    import nibabel as nib

    nan_mask = np.eye(4, 5, dtype=np.float32)
    nan_mask[0, 1] = np.nan
    np.save(slices / "nan_mask.npy", nan_mask)
    volume = np.zeros((5, 4, 2), np.float32)
    volume[2, 1, 1] = np.nan
    nib.save(nib.Nifti1Image(volume, np.eye(4)), slices / "nan.nii.gz")
    np.save(slices / "empty.npy", np.zeros((0, 40), np.float32))
    np.save(slices / "soft.npy", np.resize(np.array([0, 0.5, 1.0], np.float32), (4, 5)))
    np.save(slices / "multi.npy", np.resize(np.array([0, 1, 2], np.uint8), (4, 5)))
    np.save(slices / "none.npy", np.zeros((4, 5), np.uint8))
    np.save(slices / "dose.npy", np.full((4, 5), 1e6, np.float32))
    shutil.copy(get_testdata_file("MR_small.dcm"), slices / "mr.dcm")
    path = write_csv(
        tmp_path,
        """
        image,label,mask,slice
        data/s0.npy,1,data/mask.npy,
        data/s1.npy,1,data/nan_mask.npy,
        data/nan.nii.gz,0,,1
        data/nan.nii.gz,0,,0
        data/empty.npy,0,,
        data/s2.npy,1,data/soft.npy,
        data/s3.npy,1,data/multi.npy,
        data/s4.npy,1,data/none.npy,
        data/s5.npy,0,data/none.npy,
        data/dose.npy,0,,
        data/mr.dcm,0,,
        """,
    )
    df = read_manifest(path)
    with pytest.raises(ValueError) as error:
        validate_manifest_files(df, progress=False)
    message = str(error.value)
    assert "8 of 11 manifest rows" in message
    for line, text in [
        (3, "nan_mask.npy: 1 pixel(s) are NaN or infinite"),
        (4, "nan.nii.gz: 1 pixel(s) are NaN or infinite"),
        (6, "shape (0, 40): no pixels"),
        (7, "mask holds 3 distinct values (0, 0.5, 1)"),
        (8, "mask holds 3 distinct values (0, 1, 2)"),
        (9, "mask has no lesion pixel but the slice is labelled with a lesion"),
        (11, "only 0% of the pixels lie in the CT range"),
        (12, "DICOM has Modality MR"),
    ]:
        assert text in message.split(f"line {line}: ")[1].split("\n")[0], (line, text)
    for line in (2, 5, 10):  # a lesion mask on a lesion slice, the NaN-free NIfTI slice, an empty mask on label 0
        assert f"line {line}: " not in message

    good, bad = validate_manifest_files(df, on_bad_file="skip", progress=False)
    assert good["manifest_line"].tolist() == [2, 5, 10]
    assert [b.line for b in bad] == [3, 4, 6, 7, 8, 9, 11, 12]
    with pytest.warns(UserWarning, match=r"1 of 5 slices are not CT \(MR 1\), accepted by modalities=None"):
        good, bad = validate_manifest_files(df, on_bad_file="skip", progress=False, modalities=None)
    assert 12 not in [b.line for b in bad] and 11 not in [b.line for b in bad]  # any modality, values as they are


# ------------------------------------------------------------------------------------ duplicates


def test_duplicates_by_path_and_content_are_reported_and_conflicting_labels_refused(tmp_path, slices):
    shutil.copy(slices / "s1.npy", slices / "copy_of_s1.npy")
    path = write_csv(
        tmp_path,
        """
        image,label,slice
        data/s0.npy,0,
        data/s0.npy,0,
        data/s1.npy,1,
        data/copy_of_s1.npy,1,
        data/stack.npy,0,0
        data/stack.npy,0,1
        """,
    )
    with pytest.warns(UserWarning) as record:
        good, _ = validate_manifest_files(read_manifest(path), progress=False)
    message = " ".join(str(w.message) for w in record)
    assert "1 images listed more than once by the same path (lines 2, 3)" in message
    assert "1 images stored as identical files under other names (lines 4, 5)" in message
    assert "lines 6" not in message  # two slices of one volume are two images
    assert good["image_digest"].nunique() == 3  # s0, s1 (and its copy), the stack

    conflict = write_csv(tmp_path, "image,label\ndata/s0.npy,0\ndata/s2.npy,1\ndata/s0.npy,1\n", "conflict.csv")
    with pytest.raises(ValueError, match=r"lines 2, 4 list one image with different labels"):
        validate_manifest_files(read_manifest(conflict), progress=False)
    renamed = write_csv(tmp_path, "image,label\ndata/s1.npy,1\ndata/copy_of_s1.npy,0\n", "renamed.csv")
    with pytest.raises(ValueError, match=r"renamed.csv: copies of an image disagree .*\n  lines 2, 3 list one"):
        validate_manifest_files(read_manifest(renamed), progress=False)
    split = write_csv(tmp_path, "image,label,split\ndata/s1.npy,1,train\ndata/copy_of_s1.npy,1,test\n", "split.csv")
    with pytest.raises(ValueError, match=r"lines 2, 3 list one image in different splits"):
        validate_manifest_files(read_manifest(split), progress=False)


def test_automatic_split_keeps_every_copy_of_an_image_in_one_split(tmp_path):
    """The issue's case: no patient_id, 14 duplicated images (7 by path, 7 identical files under other names)."""
    data = tmp_path / "data"
    data.mkdir()
    rows = ["image,label"]
    for i in range(40):
        np.save(data / f"s{i}.npy", np.full((4, 5), float(i), np.float32))
        rows.append(f"data/s{i}.npy,{i % 2}")
    for i in range(7):
        rows.append(f"data/s{i}.npy,{i % 2}")
        shutil.copy(data / f"s{10 + i}.npy", data / f"renamed{i}.npy")
        rows.append(f"data/renamed{i}.npy,{i % 2}")
    path = write_csv(tmp_path, "\n".join(rows) + "\n")
    with pytest.warns(UserWarning, match="7 images listed more than once .* 7 images stored as identical files"):
        good, _ = validate_manifest_files(read_manifest(path), progress=False)
    for seed in range(5):
        out = assign_splits(good, seed=seed)
        assert out.groupby("image_digest")["split"].nunique().max() == 1, seed
        assert set(out["split"]) == {"train", "val", "test"}


def test_a_copy_that_joins_two_patients_with_given_splits_is_refused(tmp_path, slices):
    shutil.copy(slices / "s1.npy", slices / "copy_of_s1.npy")
    path = write_csv(
        tmp_path,
        """
        image,label,patient_id,split
        data/s1.npy,1,p1,train
        data/s2.npy,0,p2,val
        data/copy_of_s1.npy,1,p2,
        """,
    )
    with pytest.warns(UserWarning, match="identical files under other names"):
        good, _ = validate_manifest_files(read_manifest(path), progress=False)
    with pytest.raises(ValueError, match=r"copies of one image\) are given different splits, on lines 2, 3, 4"):
        assign_splits(good)
