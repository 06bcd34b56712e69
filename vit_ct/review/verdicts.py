"""What a reviewer concluded, case by case, kept in a CSV beside the review: is the map on the lesion, is the label
right, a note. Every verdict is written at once (a kernel restart loses nothing; reopening shows the earlier ones) and
merged by case under a lock (several writers lose none of each other's), in a file named safely after the reviewer;
summarised (agreement, reviewer-judged pointing, the cases in dispute) and compared between two reviewers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
from filelock import FileLock, Timeout

from vit_ct.files import atomic_write, safe_name

MAP_VERDICTS = ("on the lesion", "near it", "elsewhere", "no lesion visible")
LABEL_VERDICTS = ("agree", "disagree")
COLUMNS = ("case", "reviewer", "map", "label", "note", "time")
LOCK_TIMEOUT_S = 60.0  # a write holds the lock for milliseconds: a minute means a stopped writer
_EXPECTED = (
    f"expected a CSV in UTF-8 with a header row {', '.join(COLUMNS)} and a row per case, "
    "a field holding a comma or a quote in double quotes"
)


def verdicts_path(folder: str | os.PathLike, reviewer: str) -> Path:
    """The verdicts CSV of ``reviewer`` in ``folder``: ``verdicts-<reviewer>.csv`` where the name is a safe file name
    (letters, digits, ``.``, ``_``, ``-``); otherwise every other character becomes ``_`` and a short hash of the name
    is added (``dr/smith``: ``verdicts-dr_smith-<8 hex>.csv``), so the file lies in ``folder`` whatever the name
    (``/``, ``..``) and two names never share a file. The CSV's ``reviewer`` column keeps the name as typed.

    Raises:
        ValueError: ``reviewer`` is empty or blank.
    """
    name = _checked_reviewer(reviewer)
    return Path(folder) / f"verdicts-{safe_name(name, length=64)}.csv"


class Verdicts:
    """One reviewer's verdicts in ``path`` (created on the first verdict). Several writers may share the file (the
    notebook cell run twice, two windows, two processes): each verdict is merged into what is on disk under a lock,
    and every read sees the file as it is now.

    Args:
        path: The CSV (``case``, ``reviewer``, ``map``, ``label``, ``note``, ``time``), e.g. :func:`verdicts_path`.
        reviewer: Who judges; a file holds one reviewer's verdicts.
    """

    def __init__(self, path: str | os.PathLike, reviewer: str) -> None:
        self.path = Path(path)
        self.reviewer = _checked_reviewer(reviewer)
        self._listeners: list[Callable[[str], None]] = []
        self._on_disk()  # a broken file, or another reviewer's, is refused now rather than at the first click

    def on_record(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(case)`` after every verdict :meth:`record` writes, once the file holds it and the lock is
        released (a summary that follows the clicks re-reads the file then); a listener that fails cannot undo the
        write."""
        self._listeners.append(listener)

    @property
    def frame(self) -> pd.DataFrame:
        """The verdicts on disk now, one row per case (see :func:`read_verdicts`)."""
        return self._on_disk()

    def _on_disk(self) -> pd.DataFrame:
        try:
            frame = read_verdicts(self.path)
        except FileNotFoundError:
            return pd.DataFrame(columns=list(COLUMNS))
        others = set(frame["reviewer"].dropna()) - {self.reviewer}
        if others:
            raise ValueError(
                f"{self.path} holds the verdicts of {sorted(others)}, not {self.reviewer!r}: one file per reviewer "
                "(review.verdicts_path)"
            )
        return frame

    def get(self, case: str) -> dict:
        """The verdict on ``case`` on disk now (empty when there is none yet)."""
        frame = self._on_disk()
        rows = frame[frame["case"] == str(case)]
        return {} if rows.empty else rows.iloc[-1].dropna().to_dict()

    def record(self, case: str, *, map: str | None = None, label: str | None = None, note: str | None = None):
        """Set the map verdict, the label verdict and/or the note of ``case`` and write the file at once.

        Under an inter-process lock (``.<file>.lock`` beside it), the file is read again, this verdict merged in by
        case (a field not given keeps its value on disk; what other writers recorded stays) and written atomically
        and durably, so no writer loses another's verdicts and a crash leaves the previous file.
        """
        if map is not None and map not in MAP_VERDICTS:
            raise ValueError(f"map verdict must be one of {MAP_VERDICTS}, got {map!r}")
        if label is not None and label not in LABEL_VERDICTS:
            raise ValueError(f"label verdict must be one of {LABEL_VERDICTS}, got {label!r}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = self.path.with_name(f".{self.path.name}.lock")
        try:
            with FileLock(lock, timeout=LOCK_TIMEOUT_S):
                frame = self._on_disk()
                earlier = frame[frame["case"] == str(case)]
                verdict = {"case": str(case), "reviewer": self.reviewer}
                verdict.update({} if earlier.empty else earlier.iloc[-1].dropna().to_dict())
                verdict.update({k: v for k, v in {"map": map, "label": label, "note": note}.items() if v is not None})
                verdict["time"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
                kept = frame[frame["case"] != str(case)]
                frame = pd.concat([kept, pd.DataFrame([verdict], columns=list(COLUMNS))], ignore_index=True)
                with atomic_write(self.path, durable=True) as tmp:
                    frame.to_csv(tmp, index=False)
        except Timeout as error:
            raise TimeoutError(
                f"{self.path}: another writer has held {lock} for over {LOCK_TIMEOUT_S:.0f} s; the verdict on {case} "
                "is not written: let that notebook or process finish (or stop it), then click again"
            ) from error
        for listener in self._listeners:
            listener(str(case))


def read_verdicts(path: str | os.PathLike) -> pd.DataFrame:
    """A verdicts CSV, checked, with one row per case.

    Where a case has several rows (a verdict corrected by hand in a row added below), the later row in the file wins
    whole, its empty fields included, and takes that later place; the ``time`` column plays no part. The file must
    hold its columns, one reviewer, a case on every row, and only the verdicts :data:`MAP_VERDICTS` /
    :data:`LABEL_VERDICTS`; a ``ValueError`` names the file and what was expected otherwise.
    """
    try:
        rows = pd.read_csv(path, header=None, dtype=str, keep_default_na=False, encoding="utf-8-sig")
    except pd.errors.EmptyDataError as error:
        raise ValueError(f"{path} is empty: {_EXPECTED}") from error
    except pd.errors.ParserError as error:  # read without a header, so that a row longer than the header is one
        problem = str(error).strip().removeprefix("Error tokenizing data. C error: ")
        raise ValueError(f"{path} is not a readable CSV ({problem}): {_EXPECTED}") from error
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte {error.start}): {_EXPECTED}") from error
    header = rows.iloc[0].tolist()
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise ValueError(f"{path} is not a verdicts file: it lacks the columns {missing}; {_EXPECTED}")
    doubled = sorted({c for c in header if header.count(c) > 1})
    if doubled:
        raise ValueError(f"{path} has the columns {doubled} twice; {_EXPECTED}")
    frame = rows.iloc[1:].set_axis(header, axis=1).replace("", pd.NA).reset_index(drop=True)
    for column, allowed in (("map", MAP_VERDICTS), ("label", LABEL_VERDICTS)):
        bad = sorted(set(frame[column].dropna()) - set(allowed))
        if bad:
            raise ValueError(f"{path}: {column} verdicts {bad} are none of {allowed}")
    caseless = (frame.index[frame["case"].isna()] + 1).tolist()
    if caseless:
        raise ValueError(f"{path}: rows {caseless} (1 = the first below the header) have no case; each judges one")
    reviewers = sorted(set(frame["reviewer"].dropna()))
    if len(reviewers) > 1:
        raise ValueError(f"{path} holds the verdicts of {reviewers}: one file per reviewer (review.verdicts_path)")
    return frame[list(COLUMNS)].drop_duplicates("case", keep="last").reset_index(drop=True)


def _checked_reviewer(reviewer: str) -> str:
    if not isinstance(reviewer, str) or not reviewer.strip():
        raise ValueError(f"reviewer must be a name (who judges), got {reviewer!r}")
    return reviewer


def verdict_summary(verdicts: pd.DataFrame) -> dict:
    """Agreement with the labels, reviewer-judged pointing and the cases in dispute.

    ``pointing``: the share of cases whose map the reviewer placed on the lesion, among those where a lesion was
    visible (on / near / elsewhere); ``pointing_near``: on or near it. ``disputed``: the cases whose label the
    reviewer disagrees with or whose map lies elsewhere. A case with several rows counts once, by its last row (the
    rule of :func:`read_verdicts`).
    """
    verdicts = verdicts.drop_duplicates("case", keep="last")
    judged_map = verdicts["map"].dropna()
    visible = judged_map[judged_map != "no lesion visible"]
    labels = verdicts["label"].dropna()
    disputed = verdicts[(verdicts["label"] == "disagree") | (verdicts["map"] == "elsewhere")]["case"].tolist()

    def share(hits, total):
        return float(hits) / total if total else float("nan")

    return {
        "cases": int(verdicts["case"].nunique()),
        "label_agreement": share((labels == "agree").sum(), len(labels)),
        "pointing": share((visible == "on the lesion").sum(), len(visible)),
        "pointing_near": share(visible.isin(["on the lesion", "near it"]).sum(), len(visible)),
        "map_verdicts": judged_map.value_counts().reindex(MAP_VERDICTS, fill_value=0).to_dict(),
        "disputed": disputed,
    }


def cohen_kappa(a: pd.Series, b: pd.Series) -> float:
    """Cohen's kappa of two raters' categorical verdicts on the same cases (NaN when chance agreement is total)."""
    observed = float((a.to_numpy() == b.to_numpy()).mean())
    categories = sorted(set(a) | set(b))
    expected = sum(float((a == c).mean()) * float((b == c).mean()) for c in categories)
    return (observed - expected) / (1 - expected) if expected < 1 else float("nan")


def compare_reviewers(first: str | os.PathLike, second: str | os.PathLike) -> pd.DataFrame:
    """Agreement between two reviewers' verdict files, per question (``map``, ``label``), on the cases both judged:
    ``cases``, ``agreement`` (share of identical verdicts), ``kappa`` (Cohen's) and ``differ`` (the cases)."""
    a, b = read_verdicts(first), read_verdicts(second)
    both = a.merge(b, on="case", suffixes=("_a", "_b"))
    rows = {}
    for question in ("map", "label"):
        judged = both.dropna(subset=[f"{question}_a", f"{question}_b"])
        x, y = judged[f"{question}_a"], judged[f"{question}_b"]
        rows[question] = {
            "cases": len(judged),
            "agreement": float((x == y).mean()) if len(judged) else float("nan"),
            "kappa": cohen_kappa(x, y) if len(judged) else float("nan"),
            "differ": judged.loc[x != y, "case"].tolist(),
        }
    return pd.DataFrame.from_dict(rows, orient="index")
