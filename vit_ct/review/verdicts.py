"""What a reviewer concluded, case by case, kept in a CSV beside the review: is the map on the lesion, is the label
right, a note. Every verdict is written at once (a kernel restart loses nothing; reopening shows the earlier ones),
summarised (agreement, reviewer-judged pointing, the cases in dispute) and compared between two reviewers.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from vit_ct.files import atomic_write

MAP_VERDICTS = ("on the lesion", "near it", "elsewhere", "no lesion visible")
LABEL_VERDICTS = ("agree", "disagree")
COLUMNS = ("case", "reviewer", "map", "label", "note", "time")


class Verdicts:
    """One reviewer's verdicts in ``path`` (created on the first verdict, read again when it exists).

    Args:
        path: The CSV (``case``, ``reviewer``, ``map``, ``label``, ``note``, ``time``).
        reviewer: Who judges; a file holds one reviewer's verdicts.
    """

    def __init__(self, path: str | os.PathLike, reviewer: str) -> None:
        self.path = Path(path)
        self.reviewer = reviewer
        self.frame = read_verdicts(self.path) if self.path.is_file() else pd.DataFrame(columns=list(COLUMNS))
        others = set(self.frame["reviewer"].dropna()) - {reviewer}
        if others:
            raise ValueError(f"{self.path} holds the verdicts of {sorted(others)}, not {reviewer!r}: one file each")

    def get(self, case: str) -> dict:
        """The verdict on ``case`` (empty when there is none yet)."""
        rows = self.frame[self.frame["case"] == str(case)]
        return {} if rows.empty else rows.iloc[-1].dropna().to_dict()

    def record(self, case: str, *, map: str | None = None, label: str | None = None, note: str | None = None):
        """Set the map verdict, the label verdict and/or the note of ``case`` (what is not given stays), and write
        the file at once (atomically: a crash leaves the previous file)."""
        if map is not None and map not in MAP_VERDICTS:
            raise ValueError(f"map verdict must be one of {MAP_VERDICTS}, got {map!r}")
        if label is not None and label not in LABEL_VERDICTS:
            raise ValueError(f"label verdict must be one of {LABEL_VERDICTS}, got {label!r}")
        verdict = {"case": str(case), "reviewer": self.reviewer, **self.get(case)}
        verdict.update({k: v for k, v in {"map": map, "label": label, "note": note}.items() if v is not None})
        verdict["time"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        kept = self.frame[self.frame["case"] != str(case)]
        self.frame = pd.concat([kept, pd.DataFrame([verdict], columns=list(COLUMNS))], ignore_index=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(self.path) as tmp:
            self.frame.to_csv(tmp, index=False)


def read_verdicts(path: str | os.PathLike) -> pd.DataFrame:
    """A verdicts CSV, checked: its columns, and only the verdicts :data:`MAP_VERDICTS` / :data:`LABEL_VERDICTS`."""
    frame = pd.read_csv(path, dtype=str, keep_default_na=False).replace("", pd.NA)
    missing = [c for c in COLUMNS if c not in frame]
    if missing:
        raise ValueError(f"{path} is not a verdicts file: it lacks the columns {missing}")
    for column, allowed in (("map", MAP_VERDICTS), ("label", LABEL_VERDICTS)):
        bad = sorted(set(frame[column].dropna()) - set(allowed))
        if bad:
            raise ValueError(f"{path}: {column} verdicts {bad} are none of {allowed}")
    return frame[list(COLUMNS)]


def verdict_summary(verdicts: pd.DataFrame) -> dict:
    """Agreement with the labels, reviewer-judged pointing and the cases in dispute.

    ``pointing``: the share of cases whose map the reviewer placed on the lesion, among those where a lesion was
    visible (on / near / elsewhere); ``pointing_near``: on or near it. ``disputed``: the cases whose label the
    reviewer disagrees with or whose map lies elsewhere.
    """
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
