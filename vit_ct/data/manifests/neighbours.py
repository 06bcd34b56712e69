"""Each slice's neighbours in its scan: the rows of a manifest table that lie a stated distance in mm below and above
each slice, so that a model can read a slice as a radiologist does, with the slices around it (2.5D input).

A scan is the manifest's ``scan`` column where it names one; else the patient (``patient_id``) within one DICOM
series or NIfTI volume, or the series or volume alone. A slice's position is the manifest's ``position_mm`` (mm
along the slice normal, as ``vit-ct manifest`` writes it), else what its file says (DICOM ImagePositionPatient on the
normal of ImageOrientationPatient; a NIfTI volume's affine). Distances, not indices: series range from 0.625 to 5 mm
between slices. The neighbour below a slice is the slice of its scan nearest to ``context_mm`` below it (never the
slice itself), within twice that distance; likewise above. Where there is none (the ends of a scan, a gap, a slice
with no scan or no position) the slice stands in for its missing neighbour (replicate padding), and
:meth:`Neighbours.describe` says how often.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from vit_ct.data.io.geometry import slice_place
from vit_ct.data.manifests.manifest import frame_number
from vit_ct.data.manifests.splits import list_lines

POSITION_COLUMN = "position_mm"
SAME_PLACE_MM = 1e-3  # slices of one scan closer than this along the normal are at the same position
REACH = 2.0  # a neighbour lies at most this many times context_mm away


@dataclass(frozen=True)
class Neighbours:
    """The neighbours of a table's rows.

    Attributes:
        rows: ``(N, 2)`` int64: the row below and the row above each row (the row itself where it has none).
        context_mm: The distance they were chosen at.
        padded: Rows with a scan and a position that miss at least one neighbour (the ends of a scan, gaps).
        alone: Rows with no scan or no position, read with themselves as neighbours.
        same_place: Rows that share their position with another slice of their scan (two series named as one scan?).
    """

    rows: np.ndarray
    context_mm: float
    padded: int
    alone: int
    same_place: int

    def describe(self, where: str = "") -> str:
        """One line for a run's log, e.g. ``context 5 mm: 960 slices, 240 at a scan's end or a gap (the slice
        itself read as its missing neighbour)``."""
        n = len(self.rows)
        text = f"{where + ': ' if where else ''}context {self.context_mm:g} mm below and above: {n} slices"
        if self.padded:
            text += f", {self.padded} at a scan's end or a gap"
        if self.alone:
            text += f", {self.alone} with no scan or position (no scan, patient_id, series or position_mm)"
        if self.padded or self.alone:
            text += "; these read the slice itself in place of a missing neighbour"
        if self.same_place:
            text += f"; {self.same_place} share a position with another slice of their scan (two series in one scan?)"
        return text


def slice_places(table: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Each row's scan (``(N,)`` int64, -1 where unknown) and position along the slice normal (``(N,)`` float64 mm,
    NaN where unknown), from the manifest's columns, else from the files (headers only).

    Raises:
        ValueError: a ``position_mm`` cell that is not a number, naming the manifest and its lines.
    """
    n = len(table)
    positions = np.full(n, np.nan)
    if POSITION_COLUMN in table.columns:
        given = pd.to_numeric(table[POSITION_COLUMN].replace("", np.nan), errors="coerce").to_numpy(dtype=np.float64)
        bad = np.isnan(given) & table[POSITION_COLUMN].notna().to_numpy() & (table[POSITION_COLUMN] != "").to_numpy()
        if bad.any():
            lines = table["manifest_line"].to_numpy()[bad] if "manifest_line" in table.columns else np.flatnonzero(bad)
            raise ValueError(
                f"manifest {table.attrs.get('manifest', '')}: column '{POSITION_COLUMN}' must hold the slice's position"
                f" in mm along the slice normal (a number), or be empty; bad value on lines {list_lines(list(lines))}"
            )
        positions = given.copy()  # (to_numpy may hand back a read-only view)
    named = _column(table, "scan")
    patients = _column(table, "patient_id")
    series = np.full(n, None, dtype=object)
    frames = table["slice"] if "slice" in table.columns else pd.Series([None] * n)
    for i, (image, frame) in enumerate(zip(table["image"], frames, strict=True)):
        if named[i] is not None and not np.isnan(positions[i]):
            continue  # the manifest says it all
        place, position = slice_place(image, frame_number(frame))
        series[i] = place
        if np.isnan(positions[i]) and position is not None:
            positions[i] = position
    codes = np.full(n, -1, dtype=np.int64)
    numbered: dict = {}
    for i in range(n):
        if named[i] is not None:
            key = ("scan", named[i])
        elif series[i] is not None or patients[i] is not None:
            key = ("patient", patients[i], series[i])  # a patient's series (or volume), or the patient's slices
        else:
            continue
        codes[i] = numbered.setdefault(key, len(numbered))
    return codes, positions


def _column(table: pd.DataFrame, column: str) -> list:
    """A text column's values, None where empty or missing."""
    if column not in table.columns:
        return [None] * len(table)
    return [None if value is None or pd.isna(value) or str(value) == "" else str(value) for value in table[column]]


def neighbour_rows(scans: np.ndarray, positions: np.ndarray, context_mm: float) -> Neighbours:
    """The neighbours of rows in ``scans`` (``(N,)``, -1: none) at ``positions`` (``(N,)`` mm, NaN: unknown), at
    ``context_mm`` below and above (see the module's rule)."""
    if not context_mm > 0:
        raise ValueError(f"context_mm must be a distance > 0 in mm, got {context_mm}")
    n = len(scans)
    rows = np.repeat(np.arange(n, dtype=np.int64)[:, None], 2, axis=1)
    placed = (scans >= 0) & ~np.isnan(positions)
    padded = same_place = 0
    order = np.flatnonzero(placed)
    for members in _groups(scans[order]):
        members = order[members]
        z = positions[members]
        offset = z[None, :] - z[:, None]  # offset[i, j]: from slice i to slice j, mm
        same_place += int(((np.abs(offset) < SAME_PLACE_MM).sum(axis=1) > 1).sum())
        missing = np.zeros(len(members), dtype=bool)
        for side, sign in ((0, -1.0), (1, 1.0)):
            distance = sign * offset  # > 0 on this side
            reachable = (distance >= SAME_PLACE_MM) & (distance <= REACH * context_mm)
            # nearest to context_mm; of two as near, the one nearer the slice
            cost = np.where(reachable, np.abs(distance - context_mm) + 1e-6 * distance, np.inf)
            best = cost.argmin(axis=1)
            found = np.isfinite(cost[np.arange(len(members)), best])
            rows[members[found], side] = members[best[found]]
            missing |= ~found
        padded += int(missing.sum())
    return Neighbours(rows, float(context_mm), padded, int((~placed).sum()), same_place)


def _groups(codes: np.ndarray) -> list[np.ndarray]:
    """Indices of ``codes`` grouped by value."""
    if len(codes) == 0:
        return []
    order = np.argsort(codes, kind="stable")
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    return np.split(order, bounds)


def table_neighbours(table: pd.DataFrame, context_mm: float) -> Neighbours:
    """:func:`neighbour_rows` of a manifest table's rows (:func:`slice_places`), as row numbers of the table."""
    scans, positions = slice_places(table)
    return neighbour_rows(scans, positions, context_mm)
