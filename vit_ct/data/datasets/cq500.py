"""CQ500 (qure.ai; Chilamkurthy et al., Lancet 2018): 491 head CT studies (DICOM) read by three radiologists per
scan, as a vit-ct manifest with scan labels from the readers' majority, one series per study.

Layout (the archives from headctstudy.qure.ai as projects read them, e.g. ``CQ500CT25 CQ500CT25/Unknown Study/CT
Thin Plain/CT000110.dcm``; the reads' header checked against code that asserts it in full). The original site no
longer resolves; its Kaggle mirror (kaggle.com/datasets/crawford/qureai-headct, the source CQ500 papers now cite)
puts the study folders one level down (``qct01/CQ500CT0 CQ500CT0/...``, as projects reading the mirror walk it) and
lacks some studies that reads.csv lists (481 of 491 reported): by default the studies present are converted and the
absent ones listed in ``OUT.left_out.csv`` (``on_missing="raise"`` stops instead).

- ``CQ500CT<N> CQ500CT<N>/Unknown Study/CT <series description>/CT<6 digits>.dcm``: one folder per patient (one
  study), one folder per series, several series per study: thick and thin (0.625-5 mm), soft and bone kernels, some
  post-contrast (``CT PLAIN THIN``, ``CT 5mm``, ``CT BONE``, ``CT PRE CONTRAST 5MM STD``, ``CT 5mm POST CONTRAST``,
  ``CT 4cc sec 150cc D3D on``, ...; a repeated description gets ``-2``). A folder per archive above it
  (``CQ500-CT-<N>/CQ500CT<N> CQ500CT<N>/...``) is accepted. CT DICOM with rescale slope/intercept (HU as vit-ct
  reads any CT DICOM).
- ``reads.csv``: ``name`` (``CQ500-CT-<N>``), ``Category`` (the batch), then for each reader R1, R2, R3:
  ``R<r>:ICH, :IPH, :IVH, :SDH, :EDH, :SAH, :BleedLocation-Left, :BleedLocation-Right, :ChronicBleed, :Fracture,
  :CalvarialFracture, :OtherFracture, :MassEffect, :MidlineShift`` (0/1), one row per study.

Scan labels (the usual rule of CQ500 papers): ``scan_label`` = ICH read by at least two of the three readers;
``scan_epidural`` .. ``scan_subdural`` = that type read by at least two (EDH, IPH, IVH, SAH, SDH); the same value on
every row of the scan. Extra columns: ``category``; ``ich_reads`` (0-3) and ``r1_ich``, ``r2_ich``, ``r3_ich``;
the majority of ``chronic_bleed``, ``bleed_left``, ``bleed_right``, ``fracture``, ``calvarial_fracture``,
``other_fracture``, ``mass_effect``, ``midline_shift``; ``series_description``, ``kernel``, ``slice_thickness_mm``
of the chosen series. No ``label``: the reads say nothing about single slices.

One series per study, by these keys in turn (every series, its keys and the choice go to ``<stem>.series.csv``): at
least 10 images (fewer is a scout or a partial); axial; non-contrast (a post-contrast description or a
ContrastBolusAgent; a lone "C" is contrast too, "C-" plain: the readers judged bleeds on plain CT); a soft-tissue
kernel (not BONE/LUNG/EDGE/DETAIL/SHARP in the description or kernel, nor a Siemens kernel numbered 60 or more: bone
kernels make blood look like noise); slice thickness at or above ``min_thickness_mm`` (default 2.5 mm: the 2.5-5 mm of
clinical reading and of RSNA 2019, CT-ICH and INSTANCE, whereas 0.6-1.25 mm slices carry 2-3x the noise and 4-8x the
slices), the thinnest of those (else the thickest below); then one whose description says plain (pre-contrast,
non-contrast) over one that says nothing; then the most images; then the folder name. ``OUT.series.csv``'s ``why``
names the key that decided.

Licence: CC BY-NC-SA 4.0 (headctstudy.qure.ai): non-commercial, attribution, share alike.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pydicom
from pydicom.multival import MultiValue

from vit_ct.data.datasets.output import DatasetOutput
from vit_ct.data.datasets.volumes import LEFT_OUT, Converted, check_choice, count_note, dataset_folder
from vit_ct.data.io.scans import Scan, find_scans, scan_table
from vit_ct.data.manifests.splits import list_lines
from vit_ct.progress import track

READS = "reads.csv"
READERS = ("R1", "R2", "R3")
BLEED_READS = {"ICH": "label", "EDH": "epidural", "IPH": "intraparenchymal", "IVH": "intraventricular",
               "SAH": "subarachnoid", "SDH": "subdural"}  # fmt: skip
OTHER_READS = {"ChronicBleed": "chronic_bleed", "BleedLocation-Left": "bleed_left",
               "BleedLocation-Right": "bleed_right", "Fracture": "fracture",
               "CalvarialFracture": "calvarial_fracture", "OtherFracture": "other_fracture",
               "MassEffect": "mass_effect", "MidlineShift": "midline_shift"}  # fmt: skip
NAME = re.compile(r"^CQ500-CT-(\d+)$")
FOLDER = re.compile(r"^CQ500-?CT-?(\d+)(?:\s+CQ500-?CT-?\1)?$", re.IGNORECASE)
MIN_IMAGES = 10
SHARP = re.compile(r"BONE|LUNG|EDGE|DETAIL|SHARP|HRCT", re.IGNORECASE)
SIEMENS_KERNEL = re.compile(r"^[HBJQ][a-z]?(\d{2})", re.IGNORECASE)  # H31s soft ... H70h bone; Br64, Qr59
# A lone "C" is contrast too (CQ500CT183's "CT C" and "CT C THIN" beside "CT Plain" and "CT PLAIN THIN")
CONTRAST = re.compile(
    r"\bPOST\b(?!\s*FOSSA)|CONTRAST|CECT|C\+|\bCTA\b|ANGIO|\d\s*CC\b|\bORAL\b|(?:^|[\s_/])C(?:$|[\s_/])", re.IGNORECASE
)
PLAIN = re.compile(r"PRE[\s_-]*CONTRAST|NON[\s_-]*CONTRAST|PLAIN|NCCT|WITHOUT|(?:^|[\s_/])C-(?:$|\s)", re.IGNORECASE)


def read_reads(path: Path) -> pd.DataFrame:
    """The reads as scan-level columns (see the module), indexed by study number N, with the CSV ``line``.

    Raises:
        ValueError: naming the file and lines, for a missing column, a value other than 0/1, a name that is not
            ``CQ500-CT-<N>``, or a study read twice.
    """
    try:
        raw = pd.read_csv(path, dtype=str, keep_default_na=False, encoding="utf-8-sig")
    except (OSError, pd.errors.ParserError, UnicodeDecodeError) as e:
        raise ValueError(f"CQ500 reads {path}: cannot read ({type(e).__name__}: {e})") from None
    raw.columns = [c.strip() for c in raw.columns]
    needed = ["name", *(f"{r}:{finding}" for r in READERS for finding in BLEED_READS)]
    missing = [c for c in needed if c not in raw.columns]
    if missing:
        raise ValueError(f"CQ500 reads {path} lacks the columns {missing}; expected name, Category, R1:ICH, ...")
    lines = raw.index + 2
    numbers = raw["name"].str.strip().str.extract(NAME)[0]
    if numbers.isna().any():
        raise ValueError(f"CQ500 reads {path}: name must read CQ500-CT-<N>; bad on lines {list(lines[numbers.isna()])}")
    table = pd.DataFrame({"scan": raw["name"].str.strip(), "line": lines, "number": numbers.astype(int)})
    table["category"] = raw["Category"].str.strip() if "Category" in raw.columns else ""
    for finding, column in {**BLEED_READS, **OTHER_READS}.items():
        reads = [f"{r}:{finding}" for r in READERS]
        if not all(c in raw.columns for c in reads):
            continue  # the other findings are optional extras
        votes = raw[reads].apply(lambda col: col.str.strip())
        bad = ~votes.isin(["0", "1"]).all(axis=1)
        if bad.any():
            raise ValueError(f"CQ500 reads {path}: {', '.join(reads)} must be 0 or 1; bad on lines {list(lines[bad])}")
        votes = votes.astype(int)
        majority = (votes.sum(axis=1) >= 2).astype(int)  # two of the three readers
        if finding == "ICH":
            table["ich_reads"] = votes.sum(axis=1)
            for r in READERS:
                table[f"{r.lower()}_ich"] = votes[f"{r}:ICH"]
        table["scan_label" if column == "label" else f"scan_{column}" if finding in BLEED_READS else column] = majority
    twice = table["number"].duplicated(keep=False)
    if twice.any():
        raise ValueError(f"CQ500 reads {path}: studies read twice on lines {list_lines(list(table.line[twice]))}")
    return table.set_index("number")


def patient_folders(root: Path) -> dict[int, Path]:
    """``CQ500CT<N> CQ500CT<N>`` folders up to two levels below ``root``, by N (the deepest where they nest)."""
    found: dict[int, list[Path]] = defaultdict(list)
    for dirpath, dirnames, _ in os.walk(root):
        here = Path(dirpath)
        for name in dirnames:
            if match := FOLDER.match(name.strip()):
                found[int(match[1])].append(here / name)
        if len(here.relative_to(root).parts) >= 1:
            dirnames[:] = [d for d in dirnames if FOLDER.match(d.strip())]  # below the first level: only nesting
    folders = {}
    for number, paths in found.items():
        deepest = [p for p in paths if not any(q != p and q.is_relative_to(p) for q in paths)]
        if len(deepest) > 1:
            raise ValueError(f"CQ500: study {number} has several folders {deepest}; expected one (remove the copies)")
        folders[number] = deepest[0]
    return folders


@dataclass
class Series:
    """One series folder of a study, from its first readable DICOM header."""

    folder: Path
    images: int
    description: str = ""
    kernel: str = ""
    thickness_mm: float | None = None
    contrast: bool = False
    plain: bool = False  # its description says plain / pre-contrast / non-contrast
    sharp: bool = False
    axial: bool = True
    problem: str | None = None  # why it is not a CT image series
    scan: Scan | None = None  # its slices, once chosen

    def key(self, min_thickness_mm: float) -> tuple:
        """Sort key: the series to choose sorts first (the module's rule)."""
        ok = self.thickness_mm is not None and self.thickness_mm >= min_thickness_mm - 1e-3
        thickness = self.thickness_mm if ok else -(self.thickness_mm or 0.0)  # thinnest above, else thickest below
        return (self.images < MIN_IMAGES, not self.axial, self.contrast, self.sharp, not ok, thickness,
                not self.plain, -self.images, self.folder.as_posix())  # fmt: skip

    def traits(self, min_thickness_mm: float) -> str:
        thickness = "thickness unknown" if self.thickness_mm is None else f"{self.thickness_mm:g} mm"
        if self.thickness_mm is not None and self.thickness_mm < min_thickness_mm - 1e-3:
            thickness += f" (< {min_thickness_mm:g})"
        contrast = "post-contrast" if self.contrast else "said plain" if self.plain else "contrast not said"
        return ", ".join([
            *(["fewer than 10 images"] if self.images < MIN_IMAGES else []), *([] if self.axial else ["not axial"]),
            contrast, "sharp/bone kernel" if self.sharp else "soft kernel", thickness, f"{self.images} images",
        ])  # fmt: skip

    def why(self, chosen: Series | None, min_thickness_mm: float) -> str:
        """Why this series was chosen, or which key of the rule put it below the chosen one."""
        if self is chosen:
            return "chosen: first by the rule"
        if self.problem is not None or chosen is None:
            return "not a CT image series" if self.problem is not None else "no series of the study could be read"
        mine, theirs = self.key(min_thickness_mm), chosen.key(min_thickness_mm)
        first = next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
        below_minimum = self.thickness_mm is None or self.thickness_mm < min_thickness_mm - 1e-3
        names = ("fewer than 10 images", "not axial", "post-contrast", "sharp/bone kernel",
                 f"thinner than {min_thickness_mm:g} mm", "thinner" if below_minimum else "thicker",
                 "plain not said", "fewer images", "folder name")  # fmt: skip
        return f"below {chosen.folder.name}: {names[first]}"


def _axial(orientation) -> bool:
    """Whether ImageOrientationPatient's slice normal lies within 45 degrees of the body's long axis (a gantry tilt
    of up to 30 degrees is still axial); True when the header does not say."""
    try:
        normal = np.cross(*np.reshape([float(v) for v in orientation], (2, 3)))
        return bool(abs(normal[2]) > 0.7 * np.linalg.norm(normal))
    except (TypeError, ValueError):
        return True


def _series(folder: Path) -> Series:
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    for path in files[:5]:  # the first DICOM image of the folder speaks for the series
        try:
            ds = pydicom.dcmread(path, stop_before_pixels=True)
        except Exception:
            continue
        if "SeriesInstanceUID" not in ds:
            continue
        description = str(ds.get("SeriesDescription") or "") or folder.name.removeprefix("CT ")
        value = ds.get("ConvolutionKernel")
        kernel = "\\".join(map(str, value)) if isinstance(value, MultiValue) else str(value or "")
        siemens = SIEMENS_KERNEL.match(kernel)
        try:
            thickness = float(ds.get("SliceThickness"))
        except (TypeError, ValueError):
            thickness = None
        modality = str(ds.get("Modality") or "")
        localizer = "LOCALIZER" in [str(v).upper() for v in (ds.get("ImageType") or [])]
        return Series(
            folder,
            len(files),
            description=description,
            kernel=kernel,
            thickness_mm=thickness,
            contrast=bool(str(ds.get("ContrastBolusAgent") or "").strip())
            or bool(CONTRAST.search(description) and not PLAIN.search(description)),
            plain=bool(PLAIN.search(description)) and not str(ds.get("ContrastBolusAgent") or "").strip(),
            sharp=bool(SHARP.search(description) or SHARP.search(kernel) or (siemens and int(siemens[1]) >= 60)),
            axial=_axial(ds.get("ImageOrientationPatient")),
            problem=f"Modality {modality or 'missing'}, not CT" if modality != "CT" else "a localizer" if localizer
            else None,
        )  # fmt: skip
    return Series(folder, len(files), description=folder.name, problem="no readable DICOM image header")


def study_series(folder: Path) -> list[Series]:
    """Every folder below a study's folder that holds files, as a series."""
    return [
        _series(Path(dirpath))
        for dirpath, _, files in sorted(os.walk(folder))
        if any(not f.startswith(".") for f in files)
    ]


def choose_series(candidates: list[Series], min_thickness_mm: float, notes: list[str]) -> Series | None:
    """The first series by the rule that `find_scans` can make a scan of (set as its ``scan``), or None."""
    for series in sorted((s for s in candidates if s.problem is None), key=lambda s: s.key(min_thickness_mm)):
        try:
            scans, skipped = find_scans([series.folder])
        except ValueError as e:
            series.problem = str(e).splitlines()[0]
            continue
        series.scan = max(scans, key=lambda s: len(s.images))
        if skipped:
            notes.append(f"{len(skipped)} file(s) of {series.folder} skipped ({skipped[0].reason})")
        return series
    return None


def series_table(candidates: list[Series], chosen: Series | None, min_thickness_mm: float, root: Path) -> pd.DataFrame:
    """Every series of a study, in the order of the rule, with its traits and whether it was chosen."""
    ranked = sorted(candidates, key=lambda s: (s.problem is not None, s.key(min_thickness_mm)))
    table = pd.DataFrame(
        [
            {
                "folder": s.folder.relative_to(root).as_posix(),
                "series_description": s.description,
                "kernel": s.kernel,
                "slice_thickness_mm": s.thickness_mm,
                "images": s.images,
                "rank": rank if s.problem is None else None,
                "chosen": int(s is chosen),
                "reason": s.problem or s.traits(min_thickness_mm),
                "why": s.why(chosen, min_thickness_mm),
            }
            for rank, s in enumerate(ranked, start=1)
        ],
        columns=[
            "folder",
            "series_description",
            "kernel",
            "slice_thickness_mm",
            "images",
            "rank",
            "chosen",
            "reason",
            "why",
        ],  # fmt: skip
    )
    return table.astype({"rank": "Int64"})


def _raise_missing(missing: list[tuple[str, str]], root: Path) -> None:
    listed = ", ".join(f"{scan} ({reason})" for scan, reason in missing[:10])
    raise ValueError(
        f"CQ500: {len(missing)} stud(ies) of {root / READS} cannot be found under {root}: {listed}"
        "; expected a folder CQ500CT<N> CQ500CT<N> with DICOM series for each (on_missing='skip' leaves them out)"
    )


def convert(
    root: Path, out: DatasetOutput, *, min_thickness_mm: float = 2.5, on_missing: str = "skip", progress: bool = True
) -> Converted:
    """CQ500 as a scan-labelled manifest, one series per study (see the module).

    Args:
        root: the folder holding reads.csv and the CQ500CT<N> CQ500CT<N> folders.
        out: where the manifest and ``<stem>.series.csv`` go.
        min_thickness_mm: the thinnest slices preferred (mm); thinner series are chosen only when no other is left.
        on_missing: "skip" (default: the Kaggle mirror lacks some studies) leaves out a study of reads.csv that has
            no folder or no CT series, each listed in ``OUT.left_out.csv`` and counted in one note; "raise" stops.
        progress: show a progress bar.
    """
    check_choice(on_missing, "on_missing", ("raise", "skip"))
    if not min_thickness_mm >= 0:
        raise ValueError(f"min_thickness_mm must be >= 0 (mm), got {min_thickness_mm}")
    root = dataset_folder(root, (READS,), "CQ500", f"{READS} beside the CQ500CT<N> CQ500CT<N> folders")
    reads = read_reads(root / READS)
    folders = patient_folders(root)
    notes: list[str] = []
    missing = [(reads.at[n, "scan"], f"no folder CQ500CT{n} CQ500CT{n}") for n in reads.index if n not in folders]
    if missing and on_missing == "raise":  # before reading any series
        _raise_missing(missing, root)
    unread = sorted(set(folders) - set(reads.index))
    notes += count_note(len(unread), f"study folder(s) without a row in {READS}, left out: {unread[:10]}")
    tables, series_tables = [], []
    for number in track([n for n in reads.index if n in folders], "CQ500 studies", disable=not progress):
        name, candidates = reads.at[number, "scan"], study_series(folders[number])
        chosen = choose_series(candidates, min_thickness_mm, notes)
        series_tables.append(series_table(candidates, chosen, min_thickness_mm, root).assign(scan=name))
        if chosen is None:
            missing.append((name, f"no CT series in {folders[number]}"))
            continue
        table = scan_table([chosen.scan]).drop(columns=["label"])
        table["image"] = [out.reference(p) for p in table["image"]]
        table["scan"] = table["patient_id"] = name
        for column in reads.columns.drop(["scan", "line"]):
            table[column] = reads.at[number, column]
        table["series_description"] = chosen.description
        table["kernel"] = chosen.kernel
        table["slice_thickness_mm"] = chosen.thickness_mm
        tables.append(table)
    if missing and on_missing == "raise":
        _raise_missing(missing, root)
    if missing:
        out.add_table(LEFT_OUT, pd.DataFrame(missing, columns=["scan", "reason"]))
    shown = ", ".join(f"{scan} ({reason})" for scan, reason in missing[:5]) + (" ..." if len(missing) > 5 else "")
    notes += count_note(
        len(missing),
        f"stud(ies) of {READS} left out: {shown} (each with its reason in {out.stem}.{LEFT_OUT}.csv;"
        " on_missing='raise' stops instead)",
    )
    if not tables:
        raise ValueError(f"CQ500: no study of {root / READS} has a CT series under {root}")
    series = pd.concat(series_tables, ignore_index=True)
    out.add_table("series", series[["scan", *series.columns.drop("scan")]])
    return Converted(pd.concat(tables, ignore_index=True), notes)
