"""The RSNA 2019 Intracranial Hemorrhage Detection data (Kaggle) as a vit-ct manifest, and its label weights.

Kaggle layout: ``stage_2_train.csv`` holds one row ``ID_<sop id>_<subtype>,<0/1>`` per slice and subtype (five ICH
subtypes and ``any``); the slices are ``ID_<sop id>.dcm`` in one folder. The manifest has one row per slice:
``image``, the six label columns and ``patient_id`` (from each DICOM header, so the split keeps patients apart).

    python -m vit_ct.data.datasets.rsna_manifest stage_2_train.csv stage_2_train/ rsna_manifest.csv
    vit-ct fit --config configs/rsna_ich.yaml --data.manifest rsna_manifest.csv
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
from rich.progress import MofNCompleteColumn

from vit_ct.data.io.dicom import pixel_bytes_problem, read_deferred
from vit_ct.progress import Progress

# Column order of the manifest and of the model outputs.
RSNA_LABELS = ("epidural", "intraparenchymal", "intraventricular", "subarachnoid", "subdural", "any")


def read_rsna_labels(labels_csv: str | os.PathLike) -> pd.DataFrame:
    """One row per slice from Kaggle's ``ID_<sop id>_<subtype>,Label`` rows.

    Exact duplicate rows (the stage 2 file repeats some) are dropped; a slice given two different values for one
    subtype, an unknown subtype, a label other than 0/1 or a slice missing some subtype is an error.

    Returns:
        Index ``ID_<sop id>`` (sorted), one int column per label in ``RSNA_LABELS`` order.
    """
    path = Path(labels_csv)
    try:
        raw = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (OSError, pd.errors.ParserError, UnicodeDecodeError) as e:
        raise ValueError(f"RSNA labels {path}: cannot read ({type(e).__name__}: {e})") from None
    if list(raw.columns[:2]) != ["ID", "Label"]:
        raise ValueError(f"RSNA labels {path}: expected the header ID,Label (Kaggle's stage_2_train.csv)")
    raw = raw[["ID", "Label"]].drop_duplicates()
    line = raw.index + 2  # the CSV line of each row (header = line 1), for error messages
    slice_id = raw["ID"].str.rpartition("_")[0]
    subtype = raw["ID"].str.rpartition("_")[2]
    malformed = ~slice_id.str.startswith("ID_")
    if malformed.any():
        bad = list(line[malformed][:20])
        raise ValueError(f"RSNA labels {path}: IDs must read ID_<sop id>_<subtype>; bad on lines {bad}")
    table = pd.DataFrame({"slice": slice_id, "subtype": subtype, "label": raw["Label"], "line": line})
    unknown = ~table["subtype"].isin(RSNA_LABELS)
    if unknown.any():
        names = sorted(set(table.loc[unknown, "subtype"]))
        raise ValueError(f"RSNA labels {path}: unknown subtypes {names[:10]} on lines {list(table.line[unknown][:20])}")
    not_binary = ~table["label"].isin(["0", "1"])
    if not_binary.any():
        raise ValueError(f"RSNA labels {path}: Label must be 0 or 1; bad on lines {list(table.line[not_binary][:20])}")
    clash = table.duplicated(["slice", "subtype"], keep=False)
    if clash.any():
        raise ValueError(
            f"RSNA labels {path}: slices given both 0 and 1 for one subtype on lines {list(table.line[clash][:20])}"
        )
    wide = table.pivot(index="slice", columns="subtype", values="label").reindex(columns=list(RSNA_LABELS))
    incomplete = wide.isna().any(axis=1)
    if incomplete.any():
        raise ValueError(
            f"RSNA labels {path}: {int(incomplete.sum())} slices lack some of the six subtypes,"
            f" e.g. {list(wide.index[incomplete][:5])}"
        )
    return wide.astype(int).sort_index()


def _slice_header(path: Path) -> tuple[str | None, str | None]:
    """(PatientID, why its pixel data cannot be decoded or None) of one slice, from one read of its header (the
    pixel bytes stay on disk) and its size."""
    try:
        ds = read_deferred(path)
    except Exception:  # pixel_bytes_problem reads it again and says why
        return None, pixel_bytes_problem(path)
    value = ds.get("PatientID")
    return (str(value) if value else None), pixel_bytes_problem(path, ds)


def build_rsna_manifest(
    labels_csv: str | os.PathLike,
    dicom_dir: str | os.PathLike,
    out_csv: str | os.PathLike,
    *,
    workers: int = 8,
    progress: bool = True,
) -> pd.DataFrame:
    """Write a multi-label vit-ct manifest for the RSNA 2019 ICH layout.

    Args:
        labels_csv: Kaggle's ``stage_2_train.csv`` (``ID,Label`` rows ``ID_<sop id>_<subtype>``).
        dicom_dir: Folder of the ``ID_<sop id>.dcm`` slices.
        out_csv: Manifest to write; ``image`` paths are relative to its folder when it lies above the DICOMs'.
        workers: Threads reading DICOM headers (I/O bound).
        progress: Show a progress bar.

    Returns:
        The manifest: ``image``, the six labels, ``patient_id``. A slice whose pixel data cannot be decoded (short
        or cut, as RSNA's ``ID_6431af929.dcm``; `vit_ct.data.io.dicom.pixel_bytes_problem`) is left out, and listed
        with its reason in ``attrs["left_out"]`` (path, reason): a set's converter knows its set, so a known bad file
        never stops a run.

    Raises:
        ValueError: a malformed labels file, a missing folder, or labelled slices without a DICOM file.
    """
    labels = read_rsna_labels(labels_csv)
    folder = Path(dicom_dir)
    if not folder.is_dir():
        raise ValueError(f"RSNA DICOM folder {folder} not found")
    on_disk = {name[: -len(".dcm")] for name in os.listdir(folder) if name.endswith(".dcm")}
    missing = [sop for sop in labels.index if sop not in on_disk]
    if missing:
        raise ValueError(
            f"{len(missing)} of {len(labels)} labelled slices have no file in {folder}, e.g. {missing[:3]}"
            " (is it the folder of the same stage as the labels?)"
        )
    paths = [folder / f"{sop}.dcm" for sop in labels.index]
    with (
        Progress(*Progress.get_default_columns(), MofNCompleteColumn(), disable=not progress) as bar,
        ThreadPoolExecutor(max_workers=workers) as pool,
    ):
        task = bar.add_task("Reading headers and checking pixel data", total=len(paths))
        patients, problems = [], []
        for patient, problem in pool.map(_slice_header, paths):
            patients.append(patient)
            problems.append(problem)
            bar.advance(task)
    out = Path(out_csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    base = out.resolve().parent
    where = folder.resolve()
    where = Path(os.path.relpath(where, base)) if where.is_relative_to(base) else where  # relative when below
    images = [(where / f"{sop}.dcm").as_posix() for sop in labels.index]
    manifest = pd.DataFrame({"image": images, **{c: labels[c].to_numpy() for c in RSNA_LABELS}, "patient_id": patients})
    bad = np.array([problem is not None for problem in problems])
    manifest = manifest[~bad].reset_index(drop=True)
    manifest.attrs["left_out"] = [
        (str(path), problem) for path, problem in zip(paths, problems, strict=True) if problem
    ]
    manifest.to_csv(out, index=False)
    return manifest


def main(args: list[str] | None = None) -> None:
    """``python -m vit_ct.data.datasets.rsna_manifest LABELS_CSV DICOM_DIR OUT_CSV``."""
    parser = argparse.ArgumentParser(
        prog="python -m vit_ct.data.datasets.rsna_manifest", description=__doc__.split("\n")[0]
    )
    parser.add_argument("labels_csv", help="Kaggle's stage_2_train.csv")
    parser.add_argument("dicom_dir", help="folder of the ID_<sop id>.dcm slices")
    parser.add_argument("out_csv", help="manifest CSV to write")
    parser.add_argument("--workers", type=int, default=8, help="threads reading DICOM headers")
    ns = parser.parse_args(args)
    manifest = build_rsna_manifest(ns.labels_csv, ns.dicom_dir, ns.out_csv, workers=ns.workers)
    positives = ", ".join(f"{c} {int(manifest[c].sum())}" for c in RSNA_LABELS)
    print(f"wrote {ns.out_csv}: {len(manifest)} slices, {manifest['patient_id'].nunique()} patients; {positives}")
    for path, reason in manifest.attrs["left_out"]:
        print(f"  left out {path}: {reason}")


if __name__ == "__main__":
    main()
