"""vit_ct.data.io.reader against pydicom's own values on real files, hand computations, and every kind of bad input."""

import io
import re
import shutil
import warnings
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
import torch
from PIL import Image
from pydicom.data import get_testdata_file
from pydicom.encaps import encapsulate
from pydicom.pixels import apply_modality_lut
from pydicom.sequence import Sequence
from pydicom.uid import MPEG2MPML, JPEGBaseline8Bit, RLELossless

from vit_ct.data.io.reader import (
    UnreadableFileError,
    load_ct_slice,
    load_mask,
    probe_ct_slice,
    probe_mask,
    read_pixel_spacing,
)


def pydicom_file(name: str) -> str:
    """Path of a pydicom / pydicom-data test file; skips (visibly) only if the installed data really lacks it."""
    path = get_testdata_file(name)
    if path is None:
        pytest.skip(f"{name} is not in the installed pydicom/pydicom-data test files")
    return path


def pydicom_hu(name: str, frame: int | None = None) -> np.ndarray:
    """Reference HU from pydicom itself: pixel_array -> apply_modality_lut, padding -> -1000."""
    ds = pydicom.dcmread(pydicom_file(name))
    stored = ds.pixel_array if frame is None else ds.pixel_array[frame]
    hu = apply_modality_lut(stored, ds).astype(np.float64)
    if "PixelPaddingValue" in ds:
        hu[stored == ds.PixelPaddingValue] = -1000.0
    return hu.astype(np.float32)


def read_options(path) -> dict:
    """These files test decoding: non-CT ones (MR, NM, secondary capture) are read with any modality accepted."""
    modality = pydicom.dcmread(path, stop_before_pixels=True).get("Modality")
    return {} if modality == "CT" else {"modalities": None}


def raises_for(path, reason: str):
    """The error is a ValueError naming the path and matching `reason`."""
    return pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + reason)


# ------------------------------------------------------------------------------------ DICOM: transfer syntaxes

SINGLE_FRAME = [
    "CT_small.dcm",  # CT, explicit VR little endian, PixelPaddingValue -2000
    "693_UNCR.dcm",  # head CT, explicit VR little endian
    "693_UNCI.dcm",
    "693_J2KR.dcm",  # JPEG 2000 lossless
    "693_J2KI.dcm",  # JPEG 2000 lossy
    "bad_sequence.dcm",  # CT, JPEG lossless process 14 SV1
    "explicit_VR-UN.dcm",  # CT, JPEG 2000 lossless, VR UN elements
    "J2K_pixelrep_mismatch.dcm",  # CT, J2K signedness differs from PixelRepresentation
    "MR_small.dcm",
    "MR_small_implicit.dcm",  # implicit VR little endian
    "MR_small_bigendian.dcm",  # explicit VR big endian
    "MR_small_expb.dcm",
    "MR_small_RLE.dcm",  # RLE lossless
    "MR_small_jpeg_ls_lossless.dcm",  # JPEG-LS lossless
    "MR_small_jp2klossless.dcm",
    "JPEG-LL.dcm",  # JPEG lossless
    "JPGExtended.dcm",  # JPEG extended (process 2 and 4)
    "JPEGLSNearLossless_16.dcm",  # JPEG-LS near-lossless
    "image_dfl.dcm",  # deflated explicit VR little endian
]


@pytest.mark.parametrize("name", SINGLE_FRAME)
def test_single_frame_matches_pydicom(name):
    ds = pydicom.dcmread(pydicom_file(name), stop_before_pixels=True)
    options = read_options(pydicom_file(name))
    hu = load_ct_slice(pydicom_file(name), **options)
    assert hu.dtype == np.float32 and hu.shape == (ds.Rows, ds.Columns)
    np.testing.assert_array_equal(hu, pydicom_hu(name))
    assert probe_ct_slice(pydicom_file(name), **options) == (ds.Rows, ds.Columns)


def test_head_ct_hand_computed():
    ds = pydicom.dcmread(pydicom_file("693_UNCR.dcm"))
    assert (float(ds.RescaleSlope), float(ds.RescaleIntercept), ds.PixelPaddingValue) == (1.0, -1024.0, -2000)
    stored = ds.pixel_array.astype(np.float64)
    expected = np.where(stored == -2000, -1000.0, stored - 1024.0)
    assert (stored == -2000).sum() > 1000  # the file really has padding outside the scan circle
    np.testing.assert_array_equal(load_ct_slice(pydicom_file("693_UNCR.dcm")), expected)


def test_lossless_syntaxes_agree_exactly():
    uncompressed = load_ct_slice(pydicom_file("693_UNCR.dcm"))
    np.testing.assert_array_equal(load_ct_slice(pydicom_file("693_J2KR.dcm")), uncompressed)
    mr = load_ct_slice(pydicom_file("MR_small.dcm"), modalities=None)
    for name in [
        "MR_small_implicit.dcm",
        "MR_small_bigendian.dcm",
        "MR_small_RLE.dcm",
        "MR_small_jpeg_ls_lossless.dcm",
    ]:
        np.testing.assert_array_equal(load_ct_slice(pydicom_file(name), modalities=None), mr, err_msg=name)


def test_lossy_jpeg2000_is_close():
    lossy = load_ct_slice(pydicom_file("693_J2KI.dcm"))
    np.testing.assert_array_equal(lossy, load_ct_slice(pydicom_file("693_UNCI.dcm")))  # UNCI: the reference decode
    original = load_ct_slice(pydicom_file("693_UNCR.dcm"))
    tissue = (original >= -100) & (original <= 200)
    error = np.abs(lossy - original)[tissue]
    assert 0 < np.median(error) < 25  # lossy, but a few HU-tens in soft tissue


@pytest.mark.parametrize(
    "name",
    [
        "emri_small_RLE.dcm",
        "emri_small_big_endian.dcm",
        "emri_small_jpeg_2k_lossless.dcm",
        "emri_small_jpeg_ls_lossless.dcm",
    ],
)
def test_multiframe_syntaxes_per_frame(name):
    for frame in (0, 3, 9):
        np.testing.assert_array_equal(
            load_ct_slice(pydicom_file(name), frame, modalities=None), pydicom_hu("emri_small.dcm", frame)
        )
    assert probe_ct_slice(pydicom_file(name), 9, modalities=None) == (64, 64)


def test_rle_and_jpeg_baseline_written_here(tmp_path):
    ds = pydicom.dcmread(pydicom_file("693_UNCR.dcm"))
    ds.compress(RLELossless)
    ds.save_as(tmp_path / "rle.dcm")
    np.testing.assert_array_equal(load_ct_slice(tmp_path / "rle.dcm"), load_ct_slice(pydicom_file("693_UNCR.dcm")))

    # JPEG baseline is 8-bit: store a brain-windowed slice with slope 80/255 so it maps back to 0..80 HU.
    ds = pydicom.dcmread(pydicom_file("693_UNCR.dcm"))
    grey = np.clip((ds.pixel_array - 1024.0) / 80 * 255, 0, 255).astype(np.uint8)
    jpeg = io.BytesIO()
    Image.fromarray(grey).save(jpeg, format="JPEG", quality=95)
    ds.PixelData = encapsulate([jpeg.getvalue()])
    ds["PixelData"].VR = "OB"
    ds.file_meta.TransferSyntaxUID = JPEGBaseline8Bit
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    ds.RescaleSlope, ds.RescaleIntercept = 80 / 255, 0
    del ds.PixelPaddingValue
    ds.save_as(tmp_path / "jpeg.dcm")
    decoded = np.asarray(Image.open(jpeg)).astype(np.float64)  # Pillow's own decode of the same bytes
    np.testing.assert_allclose(load_ct_slice(tmp_path / "jpeg.dcm"), decoded * 80 / 255, atol=80 / 255 + 1e-4)


def test_unsupported_transfer_syntax(tmp_path):
    ds = pydicom.dcmread(pydicom_file("693_J2KR.dcm"))
    ds.file_meta.TransferSyntaxUID = MPEG2MPML
    ds.save_as(tmp_path / "video.dcm")
    for read in (load_ct_slice, probe_ct_slice):
        with raises_for(tmp_path / "video.dcm", "no decoder installed"):
            read(tmp_path / "video.dcm")


# ------------------------------------------------------------------------------------ DICOM: rescale and padding


def test_enhanced_ct_shared_functional_groups():
    path = pydicom_file("eCT_Supplemental.dcm")
    ds = pydicom.dcmread(path)
    assert "RescaleSlope" not in ds  # only in the functional groups
    transform = ds.SharedFunctionalGroupsSequence[0].PixelValueTransformationSequence[0]
    assert (float(transform.RescaleSlope), float(transform.RescaleIntercept)) == (1.0, -1024.0)
    for frame in (0, 1):
        np.testing.assert_array_equal(load_ct_slice(path, frame), ds.pixel_array[frame] * 1.0 - 1024.0)
    assert not np.array_equal(load_ct_slice(path, 0), load_ct_slice(path, 1))
    assert probe_ct_slice(path, 1) == (512, 512)
    with raises_for(path, "holds 2 slices; choose one with frame="):
        load_ct_slice(path)
    with raises_for(path, "frame 2 is out of range"):
        load_ct_slice(path, 2)
    with raises_for(path, "frame -1 is out of range"):
        probe_ct_slice(path, -1)


def test_enhanced_ct_per_frame_wins_over_shared(tmp_path):
    ds = pydicom.dcmread(pydicom_file("eCT_Supplemental.dcm"))
    item = pydicom.Dataset()
    item.RescaleSlope, item.RescaleIntercept, item.RescaleType = 2, -500, "US"
    ds.PerFrameFunctionalGroupsSequence[1].PixelValueTransformationSequence = Sequence([item])
    ds.save_as(tmp_path / "eCT.dcm")
    stored = ds.pixel_array.astype(np.float64)
    np.testing.assert_array_equal(load_ct_slice(tmp_path / "eCT.dcm", 1), stored[1] * 2 - 500)
    np.testing.assert_array_equal(load_ct_slice(tmp_path / "eCT.dcm", 0), stored[0] - 1024)  # shared group


def test_padding_range_limit(tmp_path):
    ds = pydicom.dcmread(pydicom_file("CT_small.dcm"))
    stored = ds.pixel_array.astype(np.float64)
    low = int(stored.min())
    ds.PixelPaddingValue = low + 40
    ds.add_new("PixelPaddingRangeLimit", "SS", low)  # either order is allowed
    ds.save_as(tmp_path / "pad.dcm")
    padded = (stored >= low) & (stored <= low + 40)
    assert 0 < padded.sum() < stored.size
    expected = np.where(padded, -1000.0, stored * float(ds.RescaleSlope) + float(ds.RescaleIntercept))
    np.testing.assert_array_equal(load_ct_slice(tmp_path / "pad.dcm"), expected)


# ------------------------------------------------------------------------------------ NIfTI and .npy


def dicom_like(rows=5, cols=7) -> np.ndarray:
    """Distinct HU values, non-square so a transpose cannot pass; row r, column c holds 100 r + c."""
    return (100.0 * np.arange(rows)[:, None] + np.arange(cols)[None, :]).astype(np.float32)


def test_nifti_orientation_lps_ras_coronal(tmp_path):
    hu = dicom_like()  # rows toward posterior, columns toward patient left
    volume = np.stack([hu - 1, hu, hu + 1], axis=-1)  # (rows, cols, 3)
    # NIfTI voxel (i, j, k): i along DICOM columns, j along rows. LPS-style: i toward left, j toward posterior.
    lps = np.diag([-1.0, -1.0, 1.0, 1.0])
    nib.save(nib.Nifti1Image(volume.transpose(1, 0, 2), lps), tmp_path / "lps.nii.gz")
    # RAS: i toward right, j toward anterior, so the same picture is stored flipped in both axes.
    nib.save(nib.Nifti1Image(volume[::-1, ::-1].transpose(1, 0, 2), np.eye(4)), tmp_path / "ras.nii")
    # Coronal stack: i toward left, j toward inferior, k toward anterior; the display has rows S->I, columns R->L.
    coronal = np.array([[-1.0, 0, 0, 0], [0, 0, 1, 0], [0, -1, 0, 0], [0, 0, 0, 1]])
    nib.save(nib.Nifti1Image(volume.transpose(1, 0, 2), coronal), tmp_path / "cor.nii.gz")
    for name in ["lps.nii.gz", "ras.nii", "cor.nii.gz"]:
        np.testing.assert_array_equal(load_ct_slice(tmp_path / name, 1), hu, err_msg=name)
        assert probe_ct_slice(tmp_path / name, 2) == hu.shape
    with raises_for(tmp_path / "ras.nii", "holds 3 slices"):
        load_ct_slice(tmp_path / "ras.nii")
    with raises_for(tmp_path / "ras.nii", "frame 3 is out of range"):
        probe_ct_slice(tmp_path / "ras.nii", 3)


def test_nifti_from_real_dicom_geometry(tmp_path):
    """A NIfTI written from a DICOM's own position/orientation (LPS -> RAS) reads back as pixel_array."""
    ds = pydicom.dcmread(pydicom_file("CT_small.dcm"))
    row_dir, col_dir = np.array(ds.ImageOrientationPatient[:3]), np.array(ds.ImageOrientationPatient[3:])
    row_spacing, col_spacing = (float(v) for v in ds.PixelSpacing)
    affine_lps = np.eye(4)
    affine_lps[:3, 0] = row_dir * col_spacing  # voxel i = DICOM column index
    affine_lps[:3, 1] = col_dir * row_spacing  # voxel j = DICOM row index
    affine_lps[:3, 2] = np.cross(row_dir, col_dir) * 5.0
    affine_lps[:3, 3] = [float(v) for v in ds.ImagePositionPatient]
    affine_ras = np.diag([-1.0, -1.0, 1.0, 1.0]) @ affine_lps
    stored = ds.pixel_array.astype(np.int16)
    nib.save(nib.Nifti1Image(stored.T[:, :, None], affine_ras), tmp_path / "ct.nii")
    # nibabel picks its own scaling on save, so write the DICOM's into the header fields themselves.
    raw = bytearray((tmp_path / "ct.nii").read_bytes())
    raw[112:120] = np.array([2.0, -2048.0], "<f4").tobytes()  # NIfTI-1 scl_slope, scl_inter
    (tmp_path / "ct.nii").write_bytes(bytes(raw))
    expected = stored * 2.0 - 2048.0
    np.testing.assert_array_equal(load_ct_slice(tmp_path / "ct.nii"), expected)  # one slice: frame optional
    # A canonical (RAS+) copy of the same image reads the same.
    nib.save(nib.as_closest_canonical(nib.load(tmp_path / "ct.nii")), tmp_path / "canonical.nii.gz")
    np.testing.assert_allclose(load_ct_slice(tmp_path / "canonical.nii.gz", 0), expected, atol=0.05)


def test_nifti_2d_and_4d(tmp_path):
    hu = dicom_like()
    nib.save(nib.Nifti1Image(hu.T.copy(), np.diag([-1.0, -1.0, 1.0, 1.0])), tmp_path / "flat.nii")
    np.testing.assert_array_equal(load_ct_slice(tmp_path / "flat.nii"), hu)
    nib.save(nib.Nifti1Image(np.zeros((4, 4, 3, 2), np.float32), np.eye(4)), tmp_path / "4d.nii")
    with raises_for(tmp_path / "4d.nii", "expected a 2-D slice or a 3-D volume"):
        load_ct_slice(tmp_path / "4d.nii", 0)


def test_npy(tmp_path):
    hu = dicom_like()
    np.save(tmp_path / "a.npy", hu)
    np.save(tmp_path / "int.npy", hu.astype(np.int16))
    np.save(tmp_path / "stack.npy", np.stack([hu, hu + 5], axis=-1))
    np.testing.assert_array_equal(load_ct_slice(tmp_path / "a.npy"), hu)
    assert load_ct_slice(tmp_path / "int.npy").dtype == np.float32
    np.testing.assert_array_equal(load_ct_slice(tmp_path / "stack.npy", 1), hu + 5)
    assert probe_ct_slice(tmp_path / "stack.npy", 0) == hu.shape
    with raises_for(tmp_path / "stack.npy", "holds 2 slices"):
        load_ct_slice(tmp_path / "stack.npy")
    with raises_for(tmp_path / "a.npy", "frame 1 is out of range"):
        load_ct_slice(tmp_path / "a.npy", 1)


# ------------------------------------------------------------------------------------ input that is not HU


@pytest.mark.parametrize(
    ("name", "frame", "modality"),
    [
        ("MR_small.dcm", None, "MR"),
        ("MR2_J2KI.dcm", None, "MR"),
        ("JPGExtended.dcm", None, "NM"),
        ("rtdose.dcm", 0, "RTDOSE"),
    ],
)
def test_non_ct_dicom_is_refused_unless_its_modality_is_accepted(name, frame, modality):
    path = pydicom_file(name)
    for read in (load_ct_slice, probe_ct_slice):
        with raises_for(path, f"DICOM has Modality {modality} .*expected CT: its values are not Hounsfield units"):
            read(path, frame)
    ds = pydicom.dcmread(path)
    stored = ds.pixel_array if frame is None else ds.pixel_array[frame]
    expected = apply_modality_lut(stored, ds).astype(np.float32)  # pydicom's own output values
    np.testing.assert_array_equal(load_ct_slice(path, frame, modalities=None), expected)
    if modality == "RTDOSE":  # accepted by name, its values (~1e6) are still no HU
        with raises_for(path, r"only 0% of the pixels lie in the CT range -1100..3100 HU \(values 795000 to"):
            load_ct_slice(path, frame, modalities=("CT", "RTDOSE"))
    else:
        np.testing.assert_array_equal(load_ct_slice(path, frame, modalities=("CT", modality.lower())), expected)


def test_ct_without_rescale_is_refused_unless_stored_values_are_hu(tmp_path):
    ds = pydicom.dcmread(pydicom_file("CT_small.dcm"))
    del ds.RescaleSlope, ds.RescaleIntercept
    ds.save_as(tmp_path / "bare.dcm")
    for read in (load_ct_slice, probe_ct_slice):
        with raises_for(tmp_path / "bare.dcm", "CT without RescaleSlope/RescaleIntercept"):
            read(tmp_path / "bare.dcm")
    stored = ds.pixel_array.astype(np.float32)
    expected = np.where(stored == ds.PixelPaddingValue, -1000.0, stored)  # padding stays air
    np.testing.assert_array_equal(load_ct_slice(tmp_path / "bare.dcm", stored_values_are_hu=True), expected)


def test_values_outside_the_hu_range_are_refused(tmp_path):
    ds = pydicom.dcmread(pydicom_file("CT_small.dcm"))
    ds.RescaleSlope = 1000  # a rescale that cannot give HU
    ds.save_as(tmp_path / "slope.dcm")
    with raises_for(tmp_path / "slope.dcm", "of the pixels lie in the CT range -1100..3100 HU"):
        load_ct_slice(tmp_path / "slope.dcm")
    np.save(tmp_path / "dose.npy", np.full((4, 5), 1e6, np.float32))
    with raises_for(tmp_path / "dose.npy", r"only 0% of the pixels lie in the CT range"):
        load_ct_slice(tmp_path / "dose.npy")
    assert load_ct_slice(tmp_path / "dose.npy", modalities=None).max() == 1e6
    # Padding outside the scan circle at -3024 HU (a quarter of the slice) is still a CT slice.
    hu = np.full((8, 8), 40.0, np.float32)
    hu[:4, :4] = -3024
    np.save(tmp_path / "padded.npy", hu)
    np.testing.assert_array_equal(load_ct_slice(tmp_path / "padded.npy"), hu)


def test_slice_without_pixels_is_refused(tmp_path):
    np.save(tmp_path / "empty.npy", np.zeros((0, 40), np.float32))
    for read in (load_ct_slice, probe_ct_slice, load_mask, probe_mask):
        with raises_for(tmp_path / "empty.npy", r"shape \(0, 40\): no pixels"):
            read(tmp_path / "empty.npy")


def test_npy_slice_is_a_writable_copy(tmp_path):
    """torch.from_numpy warned "The given NumPy array is not writable" on every memory-mapped .npy slice."""
    np.save(tmp_path / "a.npy", dicom_like())
    hu = load_ct_slice(tmp_path / "a.npy")
    assert hu.flags.writeable and hu.flags.owndata
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.from_numpy(hu)


@pytest.mark.parametrize(
    ("values", "dtype"),
    [([0, 0.3, 0.7, 1.0], np.float32), ([0, 1, 2], np.uint8), ([0, -1], np.int16)],
)
def test_soft_multivalued_or_negative_masks_are_refused(tmp_path, values, dtype):
    mask = np.resize(np.array(values, dtype), (5, 7))
    np.save(tmp_path / "m.npy", mask)
    with raises_for(tmp_path / "m.npy", f"mask holds {len(values)} distinct values .*expected a binary mask"):
        load_mask(tmp_path / "m.npy")


def test_png_masks_must_be_binary(tmp_path):
    edge = np.zeros((5, 7), np.uint8)
    edge[1:3, 2:6], edge[3, 2:6] = 255, 128  # anti-aliased edge
    (tmp_path / "soft.png").write_bytes(_png_bytes(edge))
    with raises_for(tmp_path / "soft.png", r"mask holds 3 distinct values \(0, 128, 255\)"):
        load_mask(tmp_path / "soft.png")
    two = np.zeros((5, 7, 3), np.uint8)
    two[1, 1], two[3, 3] = (255, 0, 0), (0, 255, 0)  # two labels in two colours
    (tmp_path / "two.png").write_bytes(_png_bytes(two))
    with raises_for(tmp_path / "two.png", "mask holds 3 distinct values"):
        load_mask(tmp_path / "two.png")
    one = np.zeros((5, 7, 3), np.uint8)
    one[1:3, 2:6] = (0, 255, 0)
    (tmp_path / "one.png").write_bytes(_png_bytes(one))
    np.testing.assert_array_equal(load_mask(tmp_path / "one.png"), one[..., 1] > 0)
    (tmp_path / "white.png").write_bytes(_png_bytes(np.full((5, 7, 3), 255, np.uint8)))  # no black: all lesion
    assert load_mask(tmp_path / "white.png").all()


# ------------------------------------------------------------------------------------ bad inputs


@pytest.fixture
def bad_files(tmp_path):
    """name -> (path, expected reason) for every way a slice can be unusable."""
    src = pydicom_file("693_UNCR.dcm")
    data = Path(src).read_bytes()
    files = {}

    def write(name, content, reason):
        path = tmp_path / name
        path.write_bytes(content)
        files[name] = (path, reason)

    write("empty.dcm", b"", "file is empty")
    write("half.dcm", data[: len(data) // 2], r"pixel data is truncated|less than expected")
    write("header_only.dcm", data[:1000], "no pixel data.*truncated")
    j2k = Path(pydicom_file("693_J2KR.dcm")).read_bytes()
    write("j2k_half.dcm", j2k[: len(j2k) // 2], "truncated")
    write("notes.txt", b"image,label\nslice.dcm,1\n", "not a DICOM file")
    write("random", np.random.default_rng(0).bytes(4096), "not a DICOM file")
    files["missing.dcm"] = (tmp_path / "missing.dcm", "file not found")
    files["folder"] = (tmp_path, "not a file")

    ds = pydicom.dcmread(src)
    del ds.PixelData
    ds.save_as(tmp_path / "nopixels.dcm")
    files["nopixels.dcm"] = (tmp_path / "nopixels.dcm", "no pixel data")

    ds = pydicom.dcmread(src)
    rgb = np.repeat(ds.pixel_array.astype(np.uint8)[..., None], 3, axis=-1)
    ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, "RGB", 0
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    ds.PixelData = rgb.tobytes()
    ds.save_as(tmp_path / "colour.dcm")
    files["colour.dcm"] = (tmp_path / "colour.dcm", "colour image")

    nan = dicom_like()
    nan[1, 2] = np.nan
    np.save(tmp_path / "nan.npy", nan)
    files["nan.npy"] = (tmp_path / "nan.npy", "NaN or infinite")
    inf = dicom_like()
    inf[0, 0] = np.inf
    nib.save(nib.Nifti1Image(inf.T.copy(), np.eye(4)), tmp_path / "inf.nii")
    files["inf.nii"] = (tmp_path / "inf.nii", "NaN or infinite")
    np.save(tmp_path / "line.npy", np.zeros(10))
    files["line.npy"] = (tmp_path / "line.npy", "expected \\(rows, columns\\)")
    np.save(tmp_path / "cube4.npy", np.zeros((2, 2, 2, 2)))
    files["cube4.npy"] = (tmp_path / "cube4.npy", "expected \\(rows, columns\\)")
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    files["objects.npy"] = (tmp_path / "objects.npy", "not a readable .npy|dtype object")
    write("fake.npy", b"not numpy at all", "not a readable .npy")
    noise = np.random.default_rng(0).integers(-1000, 1000, (64, 64, 1), dtype=np.int16)  # does not compress away
    nib.save(nib.Nifti1Image(noise, np.eye(4)), tmp_path / "vol.nii.gz")
    gz = (tmp_path / "vol.nii.gz").read_bytes()
    write("cut_header.nii.gz", gz[:60], "not a readable NIfTI")
    write("cut_data.nii.gz", gz[: len(gz) // 2], "NIfTI data cannot be read, file truncated")
    write("image.png", _png_bytes(np.zeros((4, 4), np.uint8)), "not HU")
    shutil.copy(pydicom_file("MR_truncated.dcm"), tmp_path / "MR_truncated.dcm")
    files["MR_truncated.dcm"] = (tmp_path / "MR_truncated.dcm", "truncated|less than expected")
    return files


def _png_bytes(arr: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(arr).save(buffer, format="PNG")
    return buffer.getvalue()


def test_bad_inputs_raise_value_error_naming_file(bad_files):
    for name, (path, reason) in bad_files.items():
        with pytest.raises(ValueError) as error:
            load_ct_slice(path)
        assert isinstance(error.value, UnreadableFileError), name
        assert str(path) in str(error.value), name
        assert re.search(reason, str(error.value)), (name, str(error.value))


def test_probe_catches_what_it_can_without_decoding(bad_files):
    """probe_ct_slice rejects every bad file except those whose problem is only visible in decoded pixels."""
    needs_decoding = {"inf.nii": True, "cut_data.nii.gz": True}  # NIfTI probing reads the header only
    for name, (path, reason) in bad_files.items():
        if needs_decoding.get(name):
            probe_ct_slice(path)
            continue
        with pytest.raises(ValueError, match=re.escape(str(path))) as error:
            probe_ct_slice(path)
        assert re.search(reason, str(error.value)), (name, str(error.value))


def test_frame_must_be_integer(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((3, 3, 2)))
    with raises_for(tmp_path / "a.npy", "frame must be an integer"):
        load_ct_slice(tmp_path / "a.npy", 1.0)


# ------------------------------------------------------------------------------------ masks


def test_masks(tmp_path):
    lesion = np.zeros((5, 7), bool)
    lesion[1:3, 2:6] = True
    (tmp_path / "grey.png").write_bytes(_png_bytes(lesion.astype(np.uint8) * 255))
    rgba = np.zeros((5, 7, 4), np.uint8)
    rgba[..., 3] = 255  # opaque everywhere: alpha must not count as lesion
    rgba[lesion, 0] = 200
    (tmp_path / "rgba.png").write_bytes(_png_bytes(rgba))
    np.save(tmp_path / "mask.npy", lesion.astype(np.uint8))
    np.save(tmp_path / "masks.npy", np.stack([~lesion, lesion], axis=-1))
    nib.save(
        nib.Nifti1Image(lesion.astype(np.uint8).T[:, :, None], np.diag([-1.0, -1.0, 1.0, 1.0])), tmp_path / "m.nii"
    )
    for name, frame in [("grey.png", None), ("rgba.png", 4), ("mask.npy", 3), ("masks.npy", 1), ("m.nii", None)]:
        mask = load_mask(tmp_path / name, frame)  # a single-slice mask ignores `frame`
        assert mask.dtype == bool, name
        np.testing.assert_array_equal(mask, lesion, err_msg=name)
        assert probe_mask(tmp_path / name, frame) == (5, 7), name
    with raises_for(tmp_path / "masks.npy", "frame 2 is out of range"):
        load_mask(tmp_path / "masks.npy", 2)
    (tmp_path / "cut.png").write_bytes((tmp_path / "grey.png").read_bytes()[:40])
    for read in (load_mask, probe_mask):
        with raises_for(tmp_path / "cut.png", "not a readable PNG"):
            read(tmp_path / "cut.png")
        with raises_for(tmp_path / "nothing.png", "file not found"):
            read(tmp_path / "nothing.png")
        with raises_for(pydicom_file("CT_small.dcm"), "unsupported mask format"):
            read(pydicom_file("CT_small.dcm"))


def test_pixel_spacing_is_read_from_every_kind_of_file(tmp_path):
    """DICOM PixelSpacing as pydicom reads it, enhanced CT's functional groups, NIfTI voxel sizes; .npy has none."""
    ds = pydicom.dcmread(pydicom_file("CT_small.dcm"))
    assert read_pixel_spacing(pydicom_file("CT_small.dcm")) == tuple(float(v) for v in ds.PixelSpacing)
    enhanced = pydicom.dcmread(pydicom_file("eCT_Supplemental.dcm"), stop_before_pixels=True)
    assert "PixelSpacing" not in enhanced  # only in the functional groups
    groups = enhanced.get("PerFrameFunctionalGroupsSequence") or []
    measures = [g.get("PixelMeasuresSequence") for g in groups if g.get("PixelMeasuresSequence")]
    measures = measures or [enhanced.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence]
    expected = tuple(float(v) for v in measures[0][0].PixelSpacing)
    assert read_pixel_spacing(pydicom_file("eCT_Supplemental.dcm"), 0) == expected
    image = nib.Nifti1Image(np.zeros((8, 6, 1), np.int16), np.diag([0.7, 0.8, 5.0, 1.0]))
    nib.save(image, tmp_path / "slice.nii.gz")
    assert read_pixel_spacing(tmp_path / "slice.nii.gz") == pytest.approx((0.7, 0.8))
    np.save(tmp_path / "slice.npy", np.zeros((8, 8), np.float32))
    assert read_pixel_spacing(tmp_path / "slice.npy") is None
    ds.PixelSpacing = None
    ds.save_as(tmp_path / "no_spacing.dcm")
    assert read_pixel_spacing(tmp_path / "no_spacing.dcm") is None
