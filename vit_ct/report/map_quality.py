"""Do the maps point at the lesion? The per-slice localisation scores ``predict`` writes (``<map>_<score>`` columns of
``predictions.csv``: :mod:`vit_ct.metrics.localisation`), and the floors' it does not write (scored here on the slices
read as the model read them), averaged over the slices with a lesion mask, with their intervals; the pointing game by
lesion-size quartile; each slice's lesion size from its mask.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from vit_ct.data.io.reader import load_mask
from vit_ct.data.loading.slice_dataset import CTSliceDataset, collate
from vit_ct.data.transforms.contract import InputContract
from vit_ct.metrics.localisation import MAP_SOURCES, scores_per_slice
from vit_ct.metrics.schema import PREDICTIONS
from vit_ct.report.bootstrap import Metric, PatientBootstrap, estimate, patient_bootstrap
from vit_ct.report.inputs import MANIFEST_ROW, MASK_PATH, PATIENT, SPACING

# the scores shown, in this order; energy_ratio = mean energy / mean mask fraction (1 is chance), as test/ logs it
MAP_SCORES = ("pointing", "energy", "mask_fraction", "energy_ratio", "pixel_auroc", "dice", "hd95_mm", "hd95_px")
LESION_AREA_PX, LESION_AREA_MM2 = "lesion_area_px", "lesion_area_mm2"
FLOORS = ("floor_image", "floor_head")  # maps that read no weight: the image's first window, the head mask


def scored_slices(slices: pd.DataFrame) -> pd.DataFrame:
    """The slices whose rollout was scored against a lesion mask (a known, non-empty mask in the head)."""
    column = PREDICTIONS.score("rollout", "pointing")
    return slices[slices[column].notna()] if column in slices else slices.iloc[:0]


def floor_scores(
    slices: pd.DataFrame, manifest: pd.DataFrame, contract: dict | None, *, tolerance_mm: float, batch_size: int = 16
) -> pd.DataFrame:
    """``slices`` with the floors' score columns (:data:`FLOORS`, as :func:`vit_ct.explain.maps.localisation_maps`
    makes them; HD95 too) on the slices whose rollout was scored, where the predictions lack them: each slice read
    from ``manifest`` (``manifest_row``) as the model read it (``contract``: ``run.json``'s ``input``), scored by
    :func:`~vit_ct.metrics.localisation.scores_per_slice` as ``predict`` scores the rollout. Unchanged without a
    contract (another model's CSV) or a scored slice.
    """
    scored = scored_slices(slices)
    missing = [f for f in FLOORS if PREDICTIONS.score(f, "pointing") not in slices]
    if scored.empty or not missing or not contract or contract.get("windows") is None:
        return slices
    contract = InputContract.from_dict(contract)
    table = manifest.iloc[scored[MANIFEST_ROW].to_numpy()]
    dataset = CTSliceDataset(table, windows=contract.windows, img_size=contract.img_size,
                             label_columns=manifest.attrs.get("label_columns"),
                             read_options=contract.read_options)  # fmt: skip
    columns: dict[str, list[torch.Tensor]] = {}
    for start in range(0, len(dataset), batch_size):
        batch = collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
        maps = {"floor_image": batch["image"][:, 0].float(), "floor_head": batch["head"][:, 0].float()}
        scores = scores_per_slice(maps, batch, tolerance_mm=tolerance_mm, sources=tuple(missing),
                                  surface_distance=("floor_image",))  # fmt: skip
        for name, values in scores.items():
            columns.setdefault(name, []).append(values)
    out = slices.copy()
    for name, parts in columns.items():
        out[name] = np.nan
        out.loc[scored.index, name] = torch.cat(parts).cpu().numpy()
    return out


def map_statistic(table: pd.DataFrame, columns: list[str]):
    """The mean of each score column over a replicate's slices (NaN cells left out), and the energy ratios."""
    values = table[columns].to_numpy(float)

    def statistic(rows: np.ndarray) -> dict[str, float]:
        chosen = values[rows]
        with np.errstate(all="ignore"):
            counts = np.isfinite(chosen).sum(axis=0)
            means = np.where(counts > 0, np.nansum(chosen, axis=0) / np.maximum(counts, 1), np.nan)
        out = dict(zip(columns, means.tolist(), strict=True))
        for source in MAP_SOURCES:
            energy, fraction = f"{source}_energy", f"{source}_mask_fraction"
            if energy in out and fraction in out:
                out[f"{source}_energy_ratio"] = out[energy] / out[fraction] if out[fraction] > 0 else np.nan
        return out

    return statistic


def map_scores(slices: pd.DataFrame, *, resamples: int, seed: int) -> dict[str, dict[str, Metric]]:
    """Per map (``rollout``, ``perfect_patch``, and the floors where the predictions carry them) each score of
    :data:`MAP_SCORES` with its interval over patients; ``{}`` when no slice was scored."""
    scored = scored_slices(slices)
    columns = [PREDICTIONS.score(s, score) for s in MAP_SOURCES for score in MAP_SCORES if score != "energy_ratio"]
    columns = [c for c in columns if c in scored and scored[c].notna().any()]
    if scored.empty or not columns:
        return {}
    counts = {c: int(scored[c].notna().sum()) for c in columns}
    counts |= {f"{s}_energy_ratio": counts.get(f"{s}_energy", 0) for s in MAP_SOURCES}
    bootstrap = patient_bootstrap(scored[PATIENT], resamples=resamples, seed=seed)
    metrics, _ = estimate(map_statistic(scored, columns), bootstrap, counts)
    return {
        source: {score: metrics[f"{source}_{score}"] for score in MAP_SCORES if f"{source}_{score}" in metrics}
        for source in MAP_SOURCES
        if f"{source}_pointing" in metrics
    }


def lesion_areas(slices: pd.DataFrame) -> pd.DataFrame:
    """Each slice's lesion area from its mask: ``lesion_area_px`` (pixels) and ``lesion_area_mm2`` (where the slice's
    pixel spacing is known, from ``pixel_spacing_mm``); NaN without a mask. Reads every mask once."""
    area_px = np.full(len(slices), np.nan)
    frames = slices["slice"] if "slice" in slices else pd.Series(None, index=slices.index)
    for i, (path, frame) in enumerate(zip(slices[MASK_PATH], frames, strict=True)):
        if isinstance(path, str):
            area_px[i] = load_mask(path, frame=None if pd.isna(frame) else int(frame)).sum()
    spacing = slices[SPACING].to_numpy(float) if SPACING in slices else np.full(len(slices), np.nan)
    return slices.assign(**{LESION_AREA_PX: area_px, LESION_AREA_MM2: area_px * spacing**2})


def size_quartiles(area: pd.Series) -> tuple[pd.Series, list[float]]:
    """Quartile 1-4 of each lesion's area (1 the smallest), <NA> without a lesion; and the edges (min, 3 cuts, max)."""
    lesion = area[area > 0]
    if lesion.empty:
        return pd.Series(pd.NA, index=area.index, dtype="Int64"), []
    edges = np.quantile(lesion, [0.25, 0.5, 0.75])
    quartile = pd.Series(pd.NA, index=area.index, dtype="Int64")
    quartile[lesion.index] = np.searchsorted(edges, lesion.to_numpy(), side="right") + 1  # 1..4, as small_data.py
    return quartile, [float(lesion.min()), *map(float, edges), float(lesion.max())]


def pointing_by_size(slices: pd.DataFrame, *, resamples: int, seed: int) -> dict:
    """The rollout's pointing game per quartile of lesion area (``q1`` the smallest), with intervals; the area's unit
    (mm² where every scored slice has a spacing, else pixels) and the quartiles' edges."""
    scored = scored_slices(slices)
    if scored.empty or LESION_AREA_PX not in scored:
        return {}
    unit = LESION_AREA_MM2 if scored[LESION_AREA_MM2].notna().all() else LESION_AREA_PX
    quartile, edges = size_quartiles(scored[unit])
    pointing = PREDICTIONS.score("rollout", "pointing")
    out = {"area": "mm2" if unit == LESION_AREA_MM2 else "px", "edges": edges}
    for q in range(1, 5):
        chosen = scored[(quartile == q).fillna(False).to_numpy(bool)]
        if chosen.empty:
            continue
        bootstrap: PatientBootstrap = patient_bootstrap(chosen[PATIENT], resamples=resamples, seed=seed)
        metrics, _ = estimate(map_statistic(chosen, [pointing]), bootstrap, {pointing: len(chosen)})
        out[f"q{q}"] = metrics[pointing]
    return out
