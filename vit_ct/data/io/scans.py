"""Whole scans as they arrive from an archive: DICOM series (a folder, or a tree of studies and series) and NIfTI
volumes, found without a manifest, their slices ordered along the slice normal, with the voxel-to-world affine.

Slices are grouped by SeriesInstanceUID and ordered by ImagePositionPatient projected on the normal of
ImageOrientationPatient (never by file name or InstanceNumber). Objects that are not CT images (structured reports,
presentation states, other modalities, localizers, files that are not DICOM) are skipped and listed. Links to
folders and files are followed, each file once; a link back to a folder above it is skipped and listed.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pydicom
from pydicom.dataset import Dataset

from vit_ct.data.io.archive_files import archive_files
from vit_ct.data.io.dicom import MEDIA_DIRECTORY, pixel_spacing, sop_name
from vit_ct.data.io.geometry import NIFTI_SUFFIXES, frame_plane, slice_normal, volume_positions
from vit_ct.data.io.reader import display_shape
from vit_ct.files import atomic_write, safe_name

LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])  # DICOM's patient axes (L, P, S) to NIfTI's (R, A, S)
SCAN_COLUMNS = ("scan", "scan_slice", "position_mm", "study_uid", "series_uid")


@dataclass
class Scan:
    """One scan: its slices in order along the normal, and the affine of the volume they form.

    Voxel ``(i, j, k)`` of the volume is row ``i``, column ``j`` of slice ``k`` (nibabel's DICOM convention), for a
    DICOM series; for a NIfTI volume the voxel axes are the file's own.
    """

    scan_id: str
    kind: str  # "dicom" or "nifti"
    source: str  # the series' folder or the NIfTI file
    images: list[str]  # file of each slice
    frames: list[int | None]  # frame of each slice in its file (None: a single-frame DICOM)
    positions_mm: list[float]  # along the slice normal
    affine: np.ndarray  # (4, 4) voxel -> RAS+ mm
    shape: tuple[int, int]  # (rows, columns) of a slice as `load_ct_slice` returns it
    patient_id: str | None = None
    study_uid: str | None = None
    series_uid: str | None = None
    description: str = ""
    notes: list[str] = field(default_factory=list)


@dataclass
class Skipped:
    """A file (or one frame of it) left out of every scan, and why."""

    path: str
    reason: str


# ---------------------------------------------------------------------------------------------------- DICOM headers


@dataclass
class _Slice:
    path: str
    frame: int | None
    position: np.ndarray  # ImagePositionPatient, LPS mm
    orientation: np.ndarray  # ImageOrientationPatient: (row direction, column direction)
    spacing: tuple[float, float]  # PixelSpacing: (between rows, between columns) mm
    shape: tuple[int, int]
    thickness: float | None
    header: Dataset


def _header_problem(ds: Dataset) -> str | None:
    """Why a parsed DICOM object is not a CT slice vit-ct can place in a volume, or None."""
    if not any(k in ds for k in ("PixelData", "FloatPixelData", "DoubleFloatPixelData")):
        if getattr(ds, "file_meta", {}).get("MediaStorageSOPClassUID") == MEDIA_DIRECTORY:
            return "a DICOMDIR: the export's index of its files, which are read themselves"
        return f"no pixel data ({sop_name(ds)} SOP class): not an image"
    modality = str(ds.get("Modality", "") or "")
    if modality != "CT":
        return f"Modality is {modality or 'missing'}, not CT"
    if "LOCALIZER" in [str(v).upper() for v in (ds.get("ImageType") or [])]:
        return "a localizer (scout) image, not a slice of the scan"
    if not ds.get("SeriesInstanceUID"):
        return "no SeriesInstanceUID: cannot tell which scan it belongs to"
    return None


def _read_slices(path: Path) -> tuple[list[_Slice], list[Skipped]]:
    """The slices (frames) of one DICOM file with their geometry, or why the file is skipped."""
    try:
        # defer_size: large values (the pixel data) stay on disk; their presence is still known
        ds = pydicom.dcmread(path, defer_size="1 KB")
    except Exception as e:
        return [], [Skipped(str(path), f"not a DICOM file ({type(e).__name__})")]
    problem = _header_problem(ds)
    if problem is not None:
        return [], [Skipped(str(path), problem)]
    n = int(ds.get("NumberOfFrames") or 1)
    slices, skipped = [], []
    for index in range(n):
        where = str(path) if n == 1 else f"{path} frame {index}"
        position = frame_plane(ds, index, "ImagePositionPatient", "PlanePositionSequence")
        orientation = frame_plane(ds, index, "ImageOrientationPatient", "PlaneOrientationSequence")
        spacing = pixel_spacing(ds, index)
        if position is None or orientation is None or spacing is None:
            missing = [name for name, v in (("ImagePositionPatient", position), ("ImageOrientationPatient",
                       orientation), ("PixelSpacing", spacing)) if v is None]  # fmt: skip
            skipped.append(Skipped(where, f"no {', '.join(missing)}: the slice cannot be placed in its scan"))
            continue
        thickness = ds.get("SliceThickness")
        slices.append(
            _Slice(
                path=str(path),
                frame=index if n > 1 else None,
                position=np.array([float(v) for v in position]),
                orientation=np.array([float(v) for v in orientation]).reshape(2, 3),
                spacing=spacing,
                shape=(int(ds.Rows), int(ds.Columns)),
                thickness=float(thickness) if thickness not in (None, "") else None,
                header=ds,
            )
        )
    return slices, skipped


# ---------------------------------------------------------------------------------------------------- geometry


def dicom_affine(
    first_position: np.ndarray,
    orientation: np.ndarray,
    spacing: tuple[float, float],
    slice_step: np.ndarray,
) -> np.ndarray:
    """(4, 4) affine from voxel (row, column, slice) to RAS+ mm.

    Args:
        first_position: ImagePositionPatient of slice 0 (LPS mm): the centre of its first pixel.
        orientation: ImageOrientationPatient as (row direction, column direction): the direction in which the column
            index grows, then the direction in which the row index grows.
        spacing: PixelSpacing (between rows, between columns) mm.
        slice_step: LPS mm from one slice's position to the next (along the normal, or tilted with the gantry).
    """
    lps = np.eye(4)
    lps[:3, 0] = orientation[1] * spacing[0]  # the row index moves along the column direction
    lps[:3, 1] = orientation[0] * spacing[1]
    lps[:3, 2] = slice_step
    lps[:3, 3] = first_position
    return LPS_TO_RAS @ lps


def _scan_id(patient: str | None, series_number, series_uid: str) -> str:
    """Readable and unique: patient, series number and a short hash of the SeriesInstanceUID."""
    digest = hashlib.sha1(series_uid.encode()).hexdigest()[:8]
    parts = [p for p in (patient, f"s{series_number}" if series_number not in (None, "") else None) if p]
    return safe_name("_".join([*parts, digest]), unique=False)  # the digest keeps it unique


def _series_scan(series_uid: str, slices: list[_Slice]) -> tuple[Scan | None, list[Skipped]]:
    """Order one series' slices along the normal; slices of another size or orientation than most, or a position
    already taken, are skipped."""
    skipped = []
    key = Counter((s.shape, tuple(np.round(s.orientation.ravel(), 4))) for s in slices).most_common(1)[0][0]
    kept = []
    for s in slices:
        if (s.shape, tuple(np.round(s.orientation.ravel(), 4))) == key:
            kept.append(s)
        else:
            where = s.path if s.frame is None else f"{s.path} frame {s.frame}"
            skipped.append(Skipped(where, f"size or orientation differs from the rest of series {series_uid}"))
    normal = slice_normal(kept[0].orientation)
    kept.sort(key=lambda s: float(s.position @ normal))
    ordered = [kept[0]]
    for s in kept[1:]:
        if abs(float((s.position - ordered[-1].position) @ normal)) < 1e-3:
            skipped.append(Skipped(s.path, f"same position as {ordered[-1].path} in series {series_uid}"))
        else:
            ordered.append(s)
    positions = [float(s.position @ normal) for s in ordered]
    first = ordered[0]
    notes = []
    if len(ordered) > 1:
        step = (ordered[-1].position - first.position) / (len(ordered) - 1)
        gaps = np.diff(positions)
        if gaps.max() - gaps.min() > 0.01 * gaps.mean() + 1e-3:
            notes.append(f"uneven slice spacing ({gaps.min():.2f}-{gaps.max():.2f} mm); the NIfTI assumes the mean")
    else:
        step = normal * (first.thickness or 1.0)
    ds = first.header
    patient = str(ds.get("PatientID") or "") or None
    scan = Scan(
        scan_id=_scan_id(patient, ds.get("SeriesNumber"), series_uid),
        kind="dicom",
        source=os.path.commonpath([s.path for s in ordered]) if len(ordered) > 1 else str(Path(first.path).parent),
        images=[s.path for s in ordered],
        frames=[s.frame for s in ordered],
        positions_mm=positions,
        affine=dicom_affine(first.position, first.orientation, first.spacing, step),
        shape=first.shape,
        patient_id=patient,
        study_uid=str(ds.get("StudyInstanceUID") or "") or None,
        series_uid=series_uid,
        description=str(ds.get("SeriesDescription") or ""),
        notes=notes,
    )
    return scan, skipped


def nifti_scan(path: str | os.PathLike) -> Scan:
    """A NIfTI volume as a scan: slice ``k`` is index ``k`` of its third axis, the affine is the file's own."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    try:
        img = nib.load(path)
    except Exception as e:
        raise ValueError(f"cannot read {path} as NIfTI ({type(e).__name__}: {e})") from None
    shape = img.shape + (1,) * (3 - len(img.shape))
    if len(img.shape) < 2 or len(img.shape) > 3 and any(n != 1 for n in img.shape[3:]):
        raise ValueError(f"NIfTI {path} has shape {img.shape}; expected a 2-D slice or a 3-D volume")
    affine = img.affine
    positions = volume_positions(affine, shape[2])
    name = path.name.removesuffix(".gz").removesuffix(".nii")
    return Scan(
        scan_id=safe_name(name),
        kind="nifti",
        source=str(path),
        images=[str(path)] * shape[2],
        frames=list(range(shape[2])) if len(img.shape) >= 3 else [None],
        positions_mm=positions,
        affine=affine,
        shape=display_shape(img),
    )


# ---------------------------------------------------------------------------------------------------- discovery


def shown_path(path: str | os.PathLike) -> str:
    """A path as a message or a CSV can hold it: a byte of its name that is not UTF-8 (which Python holds as a lone
    surrogate, ``\\udcff``, and no UTF-8 text can encode) written as an escape (``\\xff``), the rest as it is."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def check_utf8_names(paths: list[str | os.PathLike]) -> None:
    """Refuse paths whose names are not UTF-8: the manifest and predict's CSVs are UTF-8 text, so such a file could
    be read but never listed; found here, before any slice is read, instead of as an encoding error naming no file.

    Raises:
        ValueError: naming the first such paths (their bad bytes escaped) and what to do.
    """
    bad = []
    for path in paths:
        try:
            str(path).encode("utf-8")
        except UnicodeEncodeError:
            bad.append(shown_path(path))
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise ValueError(
            f"{', '.join(bad[:3])}{more}: a name that is not UTF-8 (its bytes shown as \\x..), which a manifest and"
            " predictions.csv (UTF-8 CSV files) cannot list; rename to UTF-8 (e.g. `convmv -f latin1 -t utf-8 -r"
            " --notest FOLDER`)"
        )


def find_scans(paths: list[str | os.PathLike] | str | os.PathLike) -> tuple[list[Scan], list[Skipped]]:
    """Every scan under ``paths``: DICOM folders (one series, or a tree of studies and series), DICOM files and
    NIfTI volumes (``.nii``, ``.nii.gz``). Linked folders and files are followed, each file read once (a loop of
    links is skipped and listed).

    Returns:
        The scans (DICOM series by SeriesInstanceUID, then NIfTI files, each in path order) and the files left out.

    Raises:
        ValueError: a path that does not exist, a file whose name is not UTF-8 (:func:`check_utf8_names`), or paths
            that hold no CT scan at all (with what was skipped).
    """
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise ValueError("no scans given: name DICOM folders or NIfTI files")
    by_series: dict[str, list[_Slice]] = defaultdict(list)
    niftis, skipped = [], []
    seen: set[tuple[int, int]] = set()  # files listed, across the given paths
    for given in paths:
        root = Path(os.path.abspath(Path(given).expanduser()))  # absolute and normalised, as a manifest's paths
        if not root.exists():
            raise ValueError(f"scan path {shown_path(root)} does not exist; expected a DICOM folder or a NIfTI file")
        check_utf8_names([root])  # a folder given by its name: its files are not named one by one
        files, problems = archive_files(root, seen)
        skipped += [Skipped(shown_path(path), reason) for path, reason in problems]  # listed in UTF-8 CSVs
        for path in files:
            if path.name.lower().endswith(NIFTI_SUFFIXES):
                niftis.append(nifti_scan(path))
                continue
            slices, left_out = _read_slices(path)
            skipped += [Skipped(shown_path(s.path), s.reason) for s in left_out]
            for s in slices:
                by_series[str(s.header.SeriesInstanceUID)].append(s)
    # Only the files that become slices must be listed by name: another file is skipped, its name escaped
    check_utf8_names(list(dict.fromkeys([*(s.path for series in by_series.values() for s in series),
                                         *(n.source for n in niftis)])))  # fmt: skip
    scans = []
    for uid in sorted(by_series, key=lambda u: min(s.path for s in by_series[u])):
        scan, left_out = _series_scan(uid, by_series[uid])
        scans.append(scan)
        skipped += left_out
    scans += niftis
    if not scans:
        listing = "".join(f"\n  {s.path}: {s.reason}" for s in skipped[:20])
        raise ValueError(f"no CT scan found in {', '.join(map(str, paths))}{listing}")
    seen = Counter(s.scan_id for s in scans)
    for s in scans:  # two NIfTI files of one name in different folders
        if seen[s.scan_id] > 1:
            s.scan_id = f"{s.scan_id}_{hashlib.sha1(s.source.encode()).hexdigest()[:6]}"
    return scans, skipped


def scan_table(scans: list[Scan], *, relative_to: str | os.PathLike | None = None) -> pd.DataFrame:
    """One row per slice, in the manifest's columns (``image``, ``slice``, ``label`` left empty, ``patient_id``)
    plus ``scan``, ``scan_slice`` (index along the scan), ``position_mm``, ``study_uid``, ``series_uid``.

    Args:
        scans: from :func:`find_scans`.
        relative_to: write ``image`` relative to this folder (a manifest's); None keeps absolute paths.
    """
    rows = []
    for scan in scans:
        for k, (image, frame, position) in enumerate(zip(scan.images, scan.frames, scan.positions_mm, strict=True)):
            path = os.path.abspath(image)
            rows.append(
                {
                    "image": os.path.relpath(path, relative_to) if relative_to is not None else path,
                    "slice": frame,
                    "label": None,
                    "patient_id": scan.patient_id,
                    "scan": scan.scan_id,
                    "scan_slice": k,
                    "position_mm": round(position, 4),
                    "study_uid": scan.study_uid,
                    "series_uid": scan.series_uid,
                }
            )
    table = pd.DataFrame(rows)
    table["slice"] = table["slice"].astype("Int64")
    return table


def write_scan_manifest(paths: list[str], output: str | os.PathLike) -> tuple[Path, list[Scan], list[Skipped]]:
    """Write a manifest of every slice of the scans under ``paths``, labels left empty for the user to fill in;
    the files left out go to ``<output stem>.skipped.csv`` beside it (when there are any).

    Returns:
        The manifest path, the scans and the files skipped.
    """
    output = Path(output)
    scans, skipped = find_scans(paths)
    output.parent.mkdir(parents=True, exist_ok=True)
    table = scan_table(scans, relative_to=output.resolve().parent)
    with atomic_write(output) as tmp:
        table.to_csv(tmp, index=False)
    if skipped:
        with atomic_write(output.with_name(f"{output.name.removesuffix('.csv')}.skipped.csv")) as tmp:
            pd.DataFrame([vars(s) for s in skipped], columns=["path", "reason"]).to_csv(tmp, index=False)
    return output, scans, skipped
