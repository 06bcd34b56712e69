"""The built-in synthetic head-CT dataset: phantom slices written as real DICOM files, PNG masks and a manifest CSV,
and ``SyntheticCTDataModule``, which builds it once and then reads it exactly like a user's own manifest, so the demo
and the tests exercise the real input path.
"""

import csv
import json
import multiprocessing
import os
import shutil
import uuid
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock
from PIL import Image
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.data.manifests.splits import SPLIT_FRACTIONS, SPLITS
from vit_ct.data.transforms.windows import DISPLAY_WINDOW
from vit_ct.progress import Progress
from vit_ct.sim.anatomy import HEAD_HEIGHT_MM
from vit_ct.sim.phantom import PhantomConfig, SimulatedSlice, sample_head, simulate_slices

MANIFEST_COLUMNS = ("image", "label", "patient_id", "split", "mask", "bleed_type")
RESCALE_INTERCEPT = -1024  # HU of stored value 0
PIXEL_PADDING_VALUE = -2000  # stored value outside the scan circle
N_PATIENTS, SLICES_PER_PATIENT = 120, 8  # the demo's set: 960 slices
_FORMAT_VERSION = 1


def generator_description(n_patients, slices_per_patient, seed, config, split_fractions, **extra) -> dict:
    """What generator.json records: every argument that changes the files (and `extra`), JSON-normalised."""
    description = {
        "format": _FORMAT_VERSION,
        **extra,
        "n_patients": n_patients,
        "slices_per_patient": slices_per_patient,
        "seed": seed,
        "split_fractions": list(split_fractions),
        # a setting added later is recorded only when used, so sets built before it existed still match
        "config": {k: v for k, v in asdict(config).items() if not (k == "patient_bleed_fraction" and v is None)},
    }
    return json.loads(json.dumps(description))


def build_synthetic_dataset(
    root: str | os.PathLike,
    *,
    n_patients: int = N_PATIENTS,
    slices_per_patient: int = SLICES_PER_PATIENT,
    seed: int = 0,
    config: PhantomConfig = PhantomConfig(),  # noqa: B008 (frozen dataclass: immutable default)
    split_fractions: tuple[float, float, float] = SPLIT_FRACTIONS,
    overwrite: bool = False,
    num_workers: int = 1,
    progress: bool = True,
) -> Path:
    """Generate the synthetic head-CT set under `root` unless it is already there; return its manifest path.

    Writes `images/<patient>/<k>.dcm` (CT Image Storage, int16, HU = stored - 1024), `masks/<patient>/<k>.png`
    (uint8 0/255, empty for negatives), `manifest.csv` (columns `MANIFEST_COLUMNS`, paths relative to it) and
    `generator.json` (these arguments). Everything is written to a temporary sibling folder that is renamed into
    place at the end, so an interrupted run never leaves a set that looks complete. The same arguments give
    byte-identical files, whatever `num_workers`.

    Args:
        root: folder of the dataset.
        n_patients: synthetic patients; each has one head and `slices_per_patient` slices at increasing levels.
        slices_per_patient: slices per patient.
        seed: seed of everything (anatomy, noise, splits, UIDs).
        config: how slices are drawn (size, spacing, bleed mix, dose, kernels).
        split_fractions: shares of patients in train, val and test; each non-empty split gets both classes.
        overwrite: replace an existing set at `root` that was built with other arguments.
        num_workers: processes generating patients in parallel.
        progress: show a progress bar.

    Returns:
        Path of `root/manifest.csv`.

    Raises:
        ValueError: `root` holds something else (a set built with other arguments, or unrelated files) and
            `overwrite` is False, or the arguments are invalid.
    """
    root = Path(root)
    if n_patients < 1 or slices_per_patient < 1:
        raise ValueError(f"n_patients and slices_per_patient must be >= 1, got {n_patients}, {slices_per_patient}")
    if len(split_fractions) != 3 or min(split_fractions) < 0 or not np.isclose(sum(split_fractions), 1):
        raise ValueError(f"split_fractions must be three non-negative shares summing to 1, got {split_fractions}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    description = generator_description(n_patients, slices_per_patient, seed, config, split_fractions)
    root.parent.mkdir(parents=True, exist_ok=True)
    # Ranks started together (torchrun) may all ask for the set: one builds it, the others wait, then reuse it.
    with FileLock(str(root.parent / f".{root.name}.lock")):
        return _build_once(root, description, config, num_workers=num_workers, progress=progress, overwrite=overwrite)


def _build_once(
    root: Path, description: dict, config: PhantomConfig, *, num_workers: int, progress: bool, overwrite: bool
) -> Path:
    manifest = root / "manifest.csv"
    if root.exists() and any(root.iterdir()):
        existing = root / "generator.json"
        if manifest.is_file() and existing.is_file() and json.loads(existing.read_text()) == description:
            return manifest
        if not overwrite:
            raise ValueError(
                f"{root} already holds a dataset built with other arguments (or other files); choose another root "
                f"or pass overwrite=True to replace it"
            )

    partial = root.parent / f".{root.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        rows = _generate(partial, description, config, num_workers, progress)
        with (partial / "manifest.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=MANIFEST_COLUMNS, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        (partial / "generator.json").write_text(json.dumps(description, indent=2, sort_keys=True) + "\n")
        if root.exists():
            shutil.rmtree(root)
        partial.rename(root)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return manifest


def _generate(folder: Path, description: dict, config: PhantomConfig, num_workers: int, progress: bool):
    """Write every patient's files under `folder`; return the manifest rows in patient order."""
    n_patients, seed = description["n_patients"], description["seed"]
    jobs = [(folder, seed, index, description["slices_per_patient"], config) for index in range(n_patients)]
    columns = (TextColumn("synthetic head CT"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    per_patient = {}
    with Progress(*columns, disable=not progress, transient=False) as bar:
        task = bar.add_task("patients", total=n_patients)
        if num_workers == 1:
            for job in jobs:
                index, slices = _write_patient(*job)
                per_patient[index] = slices
                bar.advance(task)
        else:
            context = multiprocessing.get_context("spawn")  # torch is not fork-safe once its threads exist
            with ProcessPoolExecutor(max_workers=num_workers, mp_context=context) as pool:
                for index, slices in pool.map(_write_patient_unpacked, jobs):
                    per_patient[index] = slices
                    bar.advance(task)
    labels = [[row["label"] for row in per_patient[i]] for i in range(n_patients)]
    splits = split_patients(labels, description["split_fractions"], seed)
    return [dict(row, split=splits[i]) for i in range(n_patients) for row in per_patient[i]]


def _write_patient_unpacked(job):
    return _write_patient(*job)


def patient_id(index: int) -> str:
    """Synthetic patient name used in PatientID and in the manifest."""
    return f"synth-{index:04d}"


def simulate_patient(seed: int, index: int, n_slices: int, config: PhantomConfig) -> list[SimulatedSlice]:
    """The slices of synthetic patient `index`: one head, evenly spaced levels from low to high.

    Seeded by (seed, index) alone, so a patient does not depend on which worker draws it or in what order.
    """
    rng = np.random.default_rng([seed, index])
    head = sample_head(rng)
    start = rng.uniform(0.0, 0.25)
    levels = start + (1 - start) * np.arange(n_slices) / n_slices
    bleed_types = None  # drawn slice by slice
    if config.patient_bleed_fraction is not None and rng.random() >= config.patient_bleed_fraction:
        bleed_types = ["none"] * n_slices  # a patient without a bleed
    return simulate_slices(rng, config, n_slices, head=head, levels=list(levels), bleed_types=bleed_types)


def _write_patient(folder: Path, seed: int, index: int, n_slices: int, config: PhantomConfig):
    """Simulate one patient and write their DICOM files and masks; returns (index, manifest rows without split)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # parallelism comes from patients, not from inside one
    try:
        slices = simulate_patient(seed, index, n_slices, config)
    finally:  # in the caller's process (num_workers=1) its training must keep every thread
        torch.set_num_threads(threads)
    pid = patient_id(index)
    return index, write_slices(slices, seed=seed, pid=pid, images=folder / "images" / pid, masks=folder / "masks" / pid)


def write_slices(slices: list[SimulatedSlice], *, seed: int, pid: str, images: Path, masks: Path) -> list[dict]:
    """Write one patient's slices as `images/<k>.dcm` and `masks/<k>.png`; returns their manifest rows (without
    split), whose paths name the set's layout, `images/<pid>/<k>.dcm` and `masks/<pid>/<k>.png`.

    Args:
        slices: the patient's slices, lowest level first.
        seed: seed of the set (part of every DICOM UID).
        pid: PatientID.
        images: folder for the DICOM files.
        masks: folder for the PNG masks.
    """
    images.mkdir(parents=True, exist_ok=True)
    masks.mkdir(parents=True, exist_ok=True)
    uids = {name: dicom_uid(seed, pid, name) for name in ("study", "series", "frame")}
    rows = []
    for k, simulated in enumerate(slices):
        write_dicom(images / f"{k:03d}.dcm", simulated, patient=pid, uids=uids, instance=k + 1,
                    sop_uid=dicom_uid(seed, pid, k))  # fmt: skip
        Image.fromarray(simulated.mask.astype(np.uint8) * 255).save(masks / f"{k:03d}.png")
        rows.append(
            {
                "image": f"images/{pid}/{k:03d}.dcm",
                "label": simulated.label,
                "patient_id": pid,
                "mask": f"masks/{pid}/{k:03d}.png",
                "bleed_type": simulated.bleed_type,
            }
        )
    return rows


def dicom_uid(seed: int, pid: str, name) -> str:
    """Deterministic DICOM UID for this seed, patient and object."""
    return generate_uid(entropy_srcs=["vit-ct synthetic", str(seed), pid, str(name)])


def stored_values(simulated: SimulatedSlice) -> np.ndarray:
    """int16 `(H, W)` DICOM stored values: HU rounded, clipped to [-1024, 3071], padding outside the scan circle."""
    hu = np.clip(np.rint(simulated.hu), RESCALE_INTERCEPT, RESCALE_INTERCEPT + 4095)
    stored = (hu - RESCALE_INTERCEPT).astype(np.int16)
    stored[~simulated.field_of_view] = PIXEL_PADDING_VALUE
    return stored


def write_dicom(path: Path, simulated: SimulatedSlice, *, patient: str, uids: dict, instance: int, sop_uid: str):
    """Write one slice as a CT Image Storage file (explicit VR little endian) with fixed dates for reproducibility.

    Args:
        path: file to write.
        simulated: the slice.
        patient: PatientID (also PatientName).
        uids: "study", "series" and "frame" (of reference) UIDs shared by the patient's slices.
        instance: InstanceNumber, 1-based, increasing with the slice level.
        sop_uid: SOPInstanceUID of this slice.
    """
    rows, columns = simulated.hu.shape
    spacing = simulated.pixel_spacing_mm
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = CTImageStorage
    meta.MediaStorageSOPInstanceUID = sop_uid
    meta.TransferSyntaxUID = ExplicitVRLittleEndian

    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID = CTImageStorage
    ds.SOPInstanceUID = sop_uid
    ds.ImageType = ["DERIVED", "SECONDARY", "AXIAL"]
    ds.Modality = "CT"
    ds.Manufacturer = "vit-ct synthetic phantom"
    ds.PatientName = f"Synthetic^{patient}"
    ds.PatientID = patient
    ds.PatientBirthDate = ""
    ds.PatientSex = "O"
    for prefix in ("Study", "Series", "Acquisition", "Content"):
        setattr(ds, f"{prefix}Date", "20240101")
        setattr(ds, f"{prefix}Time", "120000")
    ds.AccessionNumber = ""
    ds.ReferringPhysicianName = ""
    ds.StudyID = "1"
    ds.StudyInstanceUID = uids["study"]
    ds.SeriesInstanceUID = uids["series"]
    ds.FrameOfReferenceUID = uids["frame"]
    ds.SeriesNumber = 1
    ds.AcquisitionNumber = 1
    ds.InstanceNumber = instance
    ds.PatientPosition = "HFS"  # head first supine, as a head CT is acquired
    ds.PositionReferenceIndicator = ""  # Type 2: no anatomical reference point
    ds.SeriesDescription = "synthetic head CT"
    ds.BodyPartExamined = "HEAD"
    ds.ConvolutionKernel = simulated.kernel or "none"
    ds.KVP = 120
    ds.SliceThickness = simulated.slice_thickness_mm
    z = round(simulated.level * HEAD_HEIGHT_MM, 3)
    ds.SliceLocation = z
    ds.ImagePositionPatient = [round(-(columns - 1) / 2 * spacing, 4), round(-(rows - 1) / 2 * spacing, 4), z]
    ds.ImageOrientationPatient = [1, 0, 0, 0, 1, 0]
    ds.PixelSpacing = [spacing, spacing]  # [row, column] mm
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.Rows, ds.Columns = rows, columns
    ds.BitsAllocated, ds.BitsStored, ds.HighBit = 16, 16, 15
    ds.PixelRepresentation = 1  # signed
    ds.PixelPaddingValue = PIXEL_PADDING_VALUE
    ds.RescaleIntercept = RESCALE_INTERCEPT
    ds.RescaleSlope = 1
    ds.RescaleType = "HU"
    ds.WindowCenter, ds.WindowWidth = (int(v) for v in DISPLAY_WINDOW)  # what a viewer shows first
    ds.PixelData = stored_values(simulated).tobytes()
    ds.save_as(path, enforce_file_format=True)


def split_patients(labels: list[list[int]], fractions, seed: int) -> list[str]:
    """Seeded split of patients (given their slices' labels) in which every non-empty split has both classes."""
    n = len(labels)
    counts = [round(f * n) for f in fractions[1:]]
    counts = [max(1, c) if f > 0 else 0 for c, f in zip(counts, fractions[1:], strict=True)]
    n_train = n - sum(counts)
    if n_train < (1 if fractions[0] > 0 else 0):
        raise ValueError(f"{n} patients are too few for split_fractions {tuple(fractions)}")
    names = ["train"] * n_train + ["val"] * counts[0] + ["test"] * counts[1]
    rng = np.random.default_rng([seed, 2**31])
    for _ in range(1000):
        assignment = [names[i] for i in rng.permutation(n)]
        classes = {split: set() for split in SPLITS}
        for split, patient_labels in zip(assignment, labels, strict=True):
            classes[split].update(patient_labels)
        if all(classes[split] == {0, 1} for split in SPLITS if split in assignment):
            return assignment
    raise ValueError(
        "could not split patients so that every split has both classes; use more patients or slices per patient"
    )


class SyntheticCTDataModule(CTSliceDataModule):
    """The built-in synthetic head-CT set: generated once into ``root`` as DICOM + PNG masks + manifest, then
    read like any manifest.

    Args:
        root: Folder of the generated set (reused when it already holds one built with the same arguments).
        n_patients: Synthetic patients (one head each, several slice levels).
        slices_per_patient: Slices per patient.
        slice_size: Rows and columns of the generated slices.
        field_of_view_mm: Side of the reconstructed field of view (230 mm: 0.9 mm pixels at 256).
        seed: Seed of the generator; the same seed gives byte-identical files.
        bleed_fraction: Share of slices with an acute bleed.
        small_fraction: Share of bleeds only a few mm across or thick (the hardest cases).
        low_contrast_fraction: Share of bleeds in the lowest 10 HU of the acute-blood range (50-60 HU).
        **kwargs: The arguments of :class:`CTSliceDataModule` (except ``manifest``).
    """

    def __init__(
        self,
        root: str = "data/synthetic",
        *,
        n_patients: int = N_PATIENTS,
        slices_per_patient: int = SLICES_PER_PATIENT,
        slice_size: int = 256,
        field_of_view_mm: float = 230.0,
        seed: int = 0,
        bleed_fraction: float = PhantomConfig.bleed_fraction,
        small_fraction: float = PhantomConfig.small_fraction,
        low_contrast_fraction: float = PhantomConfig.low_contrast_fraction,
        **kwargs,
    ) -> None:
        super().__init__(manifest=str(Path(root) / "manifest.csv"), **kwargs)
        self.root = root
        self.n_patients = n_patients
        self.slices_per_patient = slices_per_patient
        self.slice_size = slice_size
        self.field_of_view_mm = field_of_view_mm
        self.seed = seed
        self.bleed_fraction = bleed_fraction
        self.small_fraction = small_fraction
        self.low_contrast_fraction = low_contrast_fraction

    def check(self, stage: str, *, num_classes: int | None = None) -> None:
        # The CLI checks the data before the trainer starts (and before DDP starts other ranks): build the set first.
        self.prepare_data()
        super().check(stage, num_classes=num_classes)

    def prepare_data(self) -> None:
        build_synthetic_dataset(
            self.root,
            n_patients=self.n_patients,
            slices_per_patient=self.slices_per_patient,
            seed=self.seed,
            config=PhantomConfig(
                size=self.slice_size,
                pixel_spacing_mm=self.field_of_view_mm / self.slice_size,
                bleed_fraction=self.bleed_fraction,
                small_fraction=self.small_fraction,
                low_contrast_fraction=self.low_contrast_fraction,
            ),
            split_fractions=self.split_fractions,
        )
