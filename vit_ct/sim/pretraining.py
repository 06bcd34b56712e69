"""The scanner-randomised pretraining set on disk (`vit_ct.sim.cohort`), written in parallel and resumably: DICOM, PNG
masks and a manifest in the built-in synthetic set's layout, with the scanner's draws as extra manifest columns.

    python -m vit_ct.sim.pretraining data/pretraining --patients 3000 --slices_per_patient 16 --seed 0 --num_workers 2

Killed and started again with the same arguments, it continues where it stopped; the files do not depend on the
number of workers or restarts. Train over it like any manifest: ``--data.manifest data/pretraining/manifest.csv``.
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import os
import shutil
import sys
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock, Timeout
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from vit_ct.data.manifests.splits import SPLIT_FRACTIONS
from vit_ct.files import atomic_write
from vit_ct.progress import Progress
from vit_ct.sim.cohort import CohortConfig, simulate_cohort_patient
from vit_ct.sim.cohort_scan import simulate_cohort_scan
from vit_ct.sim.synthetic import MANIFEST_COLUMNS, generator_description, split_patients, write_slices

SCANNER_COLUMNS = (
    "level", "kernel", "photons_per_ray", "pixel_spacing_mm", "slice_thickness_mm", "blur_px", "beam_hardening",
    "cupping", "hu_offset", "hu_gain", "ring_bins", "ring_gain_error", "head_scale", "motion_mm", "metal",
)  # fmt: skip
PROGRESS = ".progress"  # one JSON of manifest rows per completed patient: what a restart reads


def patient_id(index: int) -> str:
    """Cohort patient name used in PatientID, folder names and the manifest (distinct from the demo set's)."""
    return f"cohort-{index:05d}"


def write_pretraining_set(
    root: str | os.PathLike,
    *,
    n_patients: int,
    slices_per_patient: int = 16,
    seed: int = 0,
    config: CohortConfig = CohortConfig(),  # noqa: B008 (frozen dataclass: immutable default)
    split_fractions: tuple[float, float, float] = SPLIT_FRACTIONS,
    num_workers: int = 1,
    progress: bool = True,
    scan_spacing_mm: float | None = None,
) -> Path:
    """Write (or finish writing) the pretraining set under `root`; return its manifest path.

    Writes `images/<patient>/<k>.dcm` (CT Image Storage, int16, HU = stored - 1024, the true PixelSpacing and
    SliceThickness), `masks/<patient>/<k>.png` (uint8 0/255), `manifest.csv` (`MANIFEST_COLUMNS` then
    `SCANNER_COLUMNS`, paths relative to it; splits by patient) and `generator.json` (these arguments). Each patient
    is written under temporary names and renamed into place when complete; `.progress/<patient>.json` then marks
    it done. A restart skips the done patients and removes any half-written one; the manifest is written
    atomically from the completed patients at the end.

    Args:
        root: folder of the set; created, or holding a set begun with the same arguments.
        n_patients: synthetic patients, one head and one scanner each.
        slices_per_patient: slices per patient, evenly spaced from the ventricles to the vertex (scanned as one
            batch: 16 or more keeps the projector's sparse matrices efficient).
        seed: seed of everything (anatomy, scanners, noise, splits, UIDs).
        config: how patients, lesions and scanners are drawn.
        split_fractions: shares of patients in train, val and test.
        num_workers: processes writing patients in parallel (one torch thread each).
        progress: show a progress bar.
        scan_spacing_mm: write each patient as a whole scan instead: contiguous slices this far apart, each bleed a
            3-D object that every slice it reaches shows (:func:`vit_ct.sim.cohort_scan.simulate_cohort_scan`;
            ``config.bleed_fraction`` is then the share of patients with a bleed), for models that read a slice with
            its neighbours. None: slices spread over the head, each with its own lesions.

    Raises:
        ValueError: bad arguments, or `root` holds something else (other files, or a set begun with other arguments).
    """
    root = Path(root)
    if n_patients < 1 or slices_per_patient < 1 or num_workers < 1:
        raise ValueError(
            f"n_patients, slices_per_patient and num_workers must be >= 1, got {n_patients}, {slices_per_patient}, "
            f"{num_workers}"
        )
    if len(split_fractions) != 3 or min(split_fractions) < 0 or not np.isclose(sum(split_fractions), 1):
        raise ValueError(f"split_fractions must be three non-negative shares summing to 1, got {split_fractions}")
    if scan_spacing_mm is not None:  # checked before anything is written
        simulate_cohort_scan(seed, 0, slices_per_patient, config, spacing_mm=scan_spacing_mm, acquire=False)
    scans = {} if scan_spacing_mm is None else {"scan_spacing_mm": scan_spacing_mm}  # sets from before: the same
    description = generator_description(
        n_patients,
        slices_per_patient,
        seed,
        config,
        split_fractions,
        kind="vit-ct scanner-randomised pretraining set",
        **scans,
    )
    root.mkdir(parents=True, exist_ok=True)
    try:  # one writer at a time: a second one would race the first for the same patients
        with FileLock(str(root / ".lock"), timeout=0):
            _claim(root, description)
            done = _completed(root, n_patients)
            _write_patients(root, description, config, [i for i in range(n_patients) if i not in done], num_workers,
                            progress)  # fmt: skip
            return _write_manifest(root, description, _completed(root, n_patients))
    except Timeout:
        raise ValueError(f"{root} is being written by another process; wait for it or choose another folder") from None


def _claim(root: Path, description: dict) -> None:
    """Record the arguments in a new set, or check that an existing one was begun with the same."""
    existing = root / "generator.json"
    if existing.is_file():
        found = json.loads(existing.read_text())
        if found != description:
            changed = sorted(k for k in description if found.get(k) != description[k])
            raise ValueError(
                f"{root} holds a pretraining set begun with other arguments ({', '.join(changed)} differ); pass the "
                f"same arguments to finish it, or choose another folder"
            )
        return
    if any(p.name != ".lock" for p in root.iterdir()):
        raise ValueError(f"{root} holds other files, not a pretraining set; choose an empty or new folder")
    with atomic_write(existing) as tmp:
        tmp.write_text(json.dumps(description, indent=2, sort_keys=True) + "\n")


def _completed(root: Path, n_patients: int) -> dict[int, list[dict]]:
    """The manifest rows of every patient marked done, by index."""
    done = {}
    for index in range(n_patients):
        marker = root / PROGRESS / f"{patient_id(index)}.json"
        if marker.is_file():
            done[index] = json.loads(marker.read_text())
    return done


def _write_patients(root: Path, description: dict, config: CohortConfig, todo: list[int], num_workers, progress):
    """Write the patients in `todo`, in parallel when `num_workers` > 1, with a progress bar over slices."""
    _remove_leftovers(root, todo)
    seed, n_slices = description["seed"], description["slices_per_patient"]
    jobs = [(root, seed, index, n_slices, config, description.get("scan_spacing_mm")) for index in todo]
    columns = (
        TextColumn("pretraining set"), BarColumn(), MofNCompleteColumn(), TextColumn("patients"),
        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(),
    )  # fmt: skip
    with Progress(*columns, disable=not progress) as bar:
        total = description["n_patients"]
        task = bar.add_task("patients", total=total, completed=total - len(todo), rate="")
        start, written = time.perf_counter(), 0

        def advance():
            nonlocal written
            written += n_slices
            bar.update(task, advance=1, rate=f"{written / (time.perf_counter() - start):.1f} slices/s")

        if num_workers == 1 or len(jobs) <= 1:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # as in a worker: the same work, and the caller keeps its threads after
            try:
                for job in jobs:
                    _write_patient(*job)
                    advance()
            finally:
                torch.set_num_threads(threads)
            return
        context = multiprocessing.get_context("spawn")  # torch is not fork-safe once its threads exist
        pool = ProcessPoolExecutor(num_workers, mp_context=context, initializer=_start_worker)
        try:
            pending = {pool.submit(_write_patient, *job) for job in jobs}
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    future.result()  # a worker's error stops the run; the done patients stay done
                    advance()
        finally:
            pool.shutdown(cancel_futures=True)


def _start_worker() -> None:
    torch.set_num_threads(1)  # parallelism comes from patients, not from inside one
    if sys.platform.startswith("linux"):  # die with the parent, not finish patients after it was killed
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def _remove_leftovers(root: Path, todo: list[int]) -> None:
    """Remove what an interrupted run left of the patients still to write: temporary folders and files, and
    renamed folders whose patient was not yet marked done."""
    for folder in (root, root / "images", root / "masks", root / PROGRESS):
        if folder.is_dir():  # ours (.<patient>.tmp-<id>) and atomic_write's (.<name>.<pid>.tmp)
            for leftover in [*folder.glob(".*.tmp-*"), *folder.glob(".*.tmp")]:
                shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    for index in todo:
        for folder in ("images", "masks"):
            shutil.rmtree(root / folder / patient_id(index), ignore_errors=True)


def _write_patient(
    root: Path, seed: int, index: int, n_slices: int, config: CohortConfig, scan_spacing_mm: float | None = None
) -> None:
    """Simulate one patient and write their files under temporary names, then rename them into place: masks, images,
    and last the progress marker that says the patient is done."""
    pid = patient_id(index)
    if scan_spacing_mm is None:
        slices = simulate_cohort_patient(seed, index, n_slices, config)
    else:
        slices = simulate_cohort_scan(seed, index, n_slices, config, spacing_mm=scan_spacing_mm)
    tag = f".{pid}.tmp-{uuid.uuid4().hex[:8]}"
    images, masks = root / "images" / tag, root / "masks" / tag
    rows = write_slices(slices, seed=seed, pid=pid, images=images, masks=masks)
    for row, simulated in zip(rows, slices, strict=True):
        row.update(
            level=round(simulated.level, 4),
            photons_per_ray=simulated.photons_per_ray,
            **{k: v for k, v in simulated.settings.items() if k in SCANNER_COLUMNS},
        )
    masks.rename(root / "masks" / pid)
    images.rename(root / "images" / pid)
    marker = root / PROGRESS / f"{pid}.json"
    marker.parent.mkdir(exist_ok=True)
    with atomic_write(marker) as tmp:
        tmp.write_text(json.dumps(rows, indent=1) + "\n")


def _write_manifest(root: Path, description: dict, done: dict[int, list[dict]]) -> Path:
    """Split the patients (seeded, each split with both classes) and write the manifest atomically."""
    n_patients = description["n_patients"]
    assert len(done) == n_patients, "every patient is written before the manifest"
    labels = [[row["label"] for row in done[i]] for i in range(n_patients)]
    splits = split_patients(labels, description["split_fractions"], description["seed"])
    manifest = root / "manifest.csv"
    with atomic_write(manifest) as tmp, tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=(*MANIFEST_COLUMNS, *SCANNER_COLUMNS), lineterminator="\n")
        writer.writeheader()
        writer.writerows(dict(row, split=splits[i]) for i in range(n_patients) for row in done[i])
    return manifest


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m vit_ct.sim.pretraining",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("root", type=Path, metavar="OUT", help="folder of the set (new, or begun with these arguments)")
    parser.add_argument("--patients", type=int, required=True, help="synthetic patients, one head and scanner each")
    parser.add_argument("--slices_per_patient", type=int, default=16, help="slices per patient (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of everything (default 0)")
    parser.add_argument("--num_workers", type=int, default=1, help="processes, one torch thread each (default 1)")
    parser.add_argument("--size", type=int, default=CohortConfig.size, help="rows and columns of a slice (default 256)")
    parser.add_argument("--scan_spacing_mm", type=float, default=None,
                        help="whole scans: contiguous slices this far apart, each bleed spanning the slices it reaches"
                        " (default: slices spread over the head, each with its own lesions)")  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        manifest = write_pretraining_set(
            args.root,
            n_patients=args.patients,
            slices_per_patient=args.slices_per_patient,
            seed=args.seed,
            config=CohortConfig(size=args.size),
            num_workers=args.num_workers,
            progress=not args.quiet,
            scan_spacing_mm=args.scan_spacing_mm,
        )
    except ValueError as error:
        parser.error(str(error))
    print(f"pretraining set: {manifest}")
    return manifest


if __name__ == "__main__":
    main()
