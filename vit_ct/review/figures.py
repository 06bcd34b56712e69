"""Figures of a review (:mod:`vit_ct.review`): summary, case gallery, one case in depth, and an ipywidgets
browser of the cases; rollout maps (arXiv:2005.00928) as overlays on each slice's own grid."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.data.transforms.windows import DISPLAY_PRESET, WINDOW_PRESETS, parse_windows
from vit_ct.explain.map_reading import MapReading
from vit_ct.explain.overlay import render_overlay
from vit_ct.files import atomic_write
from vit_ct.inspection.loading import REVIEW_READING
from vit_ct.metrics.schema import PREDICTIONS, REVIEW
from vit_ct.progress import HEADLESS_ENV, headless_flag, in_jupyter_kernel  # noqa: F401  (review.figures.HEADLESS_ENV, as before)
from vit_ct.review.cases import METHODS, CaseMaps, case_maps
from vit_ct.review.summaries import (
    GROUPS,
    calibration_bins,
    confusion,
    expected_calibration_error,
    gallery,
    review_order,
    roc_points,
    summary_metrics,
)
from vit_ct.review.table import case_images, source_map
from vit_ct.task import ViTClassifier


def _window(window) -> tuple[float, float]:
    return parse_windows(window)[0]


def _case_name(row: pd.Series) -> str:
    """Which slice a panel shows, traceable to its case: the scan (where known) and the image's file name, short."""
    name = Path(str(row[REVIEW.image])).name
    scan = row.get(REVIEW.scan)
    where = f"{scan} / {name}" if scan is not None and not pd.isna(scan) and str(scan) else name
    return where if len(where) <= 36 else f"...{where[-33:]}"


def _caption(row: pd.Series) -> str:
    label = "?" if pd.isna(row[REVIEW.label]) else int(row[REVIEW.label])
    text = f"p={row[REVIEW.prob]:.2f}  label {label}"
    pointing, energy, fraction = (PREDICTIONS.score("rollout", s) for s in ("pointing", "energy", "mask_fraction"))
    if not pd.isna(row.get(pointing, np.nan)):
        text += f"\npointing {row[pointing]:.2f}  energy x{row[energy] / row[fraction]:.1f}"
    return text


def _grid(rows: int, cols: int, *, size: float = 2.4) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=(size * cols, size * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat:
        ax.set_axis_off()
    return fig, axes


def plot_confusion(table: pd.DataFrame, threshold: float = 0.5, *, ax=None) -> Figure:
    """Confusion matrix at ``threshold``, counts in the cells."""
    fig = ax.figure if ax is not None else Figure(figsize=(3.5, 3.2), layout="constrained")
    ax = ax or fig.subplots()
    counts = confusion(table, threshold).to_numpy()
    ax.imshow(counts, cmap="Blues", vmin=0, vmax=max(counts.max(), 1))
    for (i, j), count in np.ndenumerate(counts):
        name = GROUPS[("T" if i == j else "F") + ("P" if j else "N")]
        colour = "white" if count > counts.max() / 2 else "black"
        ax.text(j, i, f"{name}\n{count}", ha="center", va="center", color=colour)
    ax.set(xticks=[0, 1], yticks=[0, 1], xlabel="predicted", ylabel="true", title=f"confusion at p > {threshold}")
    return fig


def plot_roc(table: pd.DataFrame, threshold: float = 0.5, *, ax=None) -> Figure:
    """ROC curve with its AUROC and the operating point at ``threshold``."""
    fig = ax.figure if ax is not None else Figure(figsize=(3.5, 3.2), layout="constrained")
    ax = ax or fig.subplots()
    metrics = summary_metrics(table, threshold)
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    if metrics["positives"] and metrics["positives"] < metrics["slices"]:
        points = roc_points(table)
        ax.plot(points["fpr"], points["tpr"], label=f"AUROC {metrics['auroc']:.3f}")
        ax.plot(1 - metrics["specificity"], metrics["sensitivity"], "o", label=f"p > {threshold}")
        ax.legend(loc="lower right")
    else:
        ax.text(0.5, 0.5, "needs both classes", ha="center")
    ax.set(xlabel="1 - specificity", ylabel="sensitivity", title="ROC", xlim=(0, 1), ylim=(0, 1.02))
    return fig


def plot_calibration(table: pd.DataFrame, n_bins: int = 10, *, ax=None) -> Figure:
    """Reliability diagram: fraction of lesion slices against mean P(lesion) per bin, bin counts as bars."""
    fig = ax.figure if ax is not None else Figure(figsize=(3.5, 3.2), layout="constrained")
    ax = ax or fig.subplots()
    bins = calibration_bins(table, n_bins)
    ax.bar(
        bins["lower"],
        bins["count"] / max(bins["count"].sum(), 1),
        width=1 / n_bins,
        align="edge",
        alpha=0.2,
        color="grey",
        label="share of slices",
    )
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    full = bins[bins["count"] > 0]
    ax.plot(full["mean_prob"], full["fraction_positive"], "o-", label=f"ECE {expected_calibration_error(bins):.3f}")
    ax.set(xlabel="mean P(lesion)", ylabel="fraction with lesion", title="calibration", xlim=(0, 1), ylim=(0, 1.02))
    ax.legend(loc="upper left")
    return fig


def plot_summary(table: pd.DataFrame, threshold: float = 0.5, n_bins: int = 10) -> Figure:
    """Confusion matrix, ROC curve and reliability diagram side by side."""
    fig = Figure(figsize=(11, 3.5), layout="constrained")
    axes = fig.subplots(1, 3)
    plot_confusion(table, threshold, ax=axes[0])
    plot_roc(table, threshold, ax=axes[1])
    plot_calibration(table, n_bins, ax=axes[2])
    return fig


def plot_gallery(
    table: pd.DataFrame, *, n: int = 4, threshold: float = 0.5, window=DISPLAY_PRESET, alpha: float = 0.5
) -> Figure:
    """Two rows per group (TP, FP, FN, TN, unlabelled) that has cases, most confident first: the windowed slice with
    the lesion contour, then the rollout overlay; titles give P(lesion), the label and the case's localisation."""
    names = {**GROUPS, "unlabelled": "unlabelled"}
    groups = {group: gallery(table, group, n, threshold=threshold) for group in names}
    shown = {group: cases for group, cases in groups.items() if not cases.empty}
    fig, axes = _grid(2 * max(len(shown), 1), n)
    empty = [names[group] for group, cases in groups.items() if cases.empty and group in GROUPS]
    fig.suptitle(f"most confident first; no {', no '.join(empty)}" if empty else "most confident first", fontsize=10)
    for g, (group, cases) in enumerate(shown.items()):
        for j, (_, row) in enumerate(cases.iterrows()):
            hu, mask = case_images(row, table.attrs.get("read_options"))
            axes[2 * g, j].imshow(render_overlay(hu, None, mask, window=_window(window)))
            axes[2 * g, j].set_title(f"{names[group]} {j + 1}: {_case_name(row)}\n{_caption(row)}", fontsize=7)
            axes[2 * g + 1, j].imshow(render_overlay(hu, source_map(row), mask, window=_window(window), alpha=alpha))
    return fig


def plot_overlays(
    hu: np.ndarray,
    maps: dict[str, np.ndarray],
    mask: np.ndarray | None = None,
    *,
    window=DISPLAY_PRESET,
    alpha: float = 0.5,
    columns: int = 4,
    title: str | None = None,
) -> Figure:
    """The windowed slice, then one overlay per named map, ``columns`` panels a row."""
    panels = {"CT": None, **maps}
    rows = -(-len(panels) // columns)
    fig, axes = _grid(rows, min(columns, len(panels)))
    for ax, (name, heat) in zip(axes.flat, panels.items(), strict=False):
        ax.imshow(render_overlay(hu, heat, mask, window=_window(window), alpha=alpha))
        ax.set_title(name, fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def plot_case(case: CaseMaps, *, window=DISPLAY_PRESET, alpha: float = 0.5) -> Figure:
    """Rollout, gradient rollout and last-block attention of one case side by side."""
    return plot_overlays(case.hu, case.maps, case.mask, window=window, alpha=alpha, title=_caption(case.row))


def plot_heads(case: CaseMaps, *, window=DISPLAY_PRESET, alpha: float = 0.5) -> Figure:
    """The class token's attention in the last block, one panel per head."""
    heads = {f"head {i}": heat for i, heat in enumerate(case.heads)}
    return plot_overlays(case.hu, heads, case.mask, window=window, alpha=alpha, title="last block, per head")


def plot_blocks(case: CaseMaps, *, window=DISPLAY_PRESET, alpha: float = 0.5) -> Figure:
    """The class token's attention in every block (heads fused), first block first; each panel's title gives the
    block's attention on the prefix tokens (class token, registers) and on air patches, heads averaged."""
    blocks = {
        f"block {i}: prefix {share.cls_prefix:.0%}, air {share.cls_air:.0%}": heat
        for (i, share), heat in zip(case.sink.iterrows(), case.blocks, strict=True)
    }
    return plot_overlays(case.hu, blocks, case.mask, window=window, alpha=alpha, title="per block, heads fused")


def plot_windows(
    case: CaseMaps, presets: Sequence[str] = ("brain", "subdural", "bone"), *, alpha: float = 0.5
) -> Figure:
    """The slice and its rollout overlay in each window preset (bone shows the skull, subdural blood beside it)."""
    fig, axes = _grid(2, len(presets))
    for j, preset in enumerate(presets):
        axes[0, j].imshow(render_overlay(case.hu, None, case.mask, window=_window(preset)))
        axes[0, j].set_title(f"{preset} {WINDOW_PRESETS[preset]}", fontsize=9)
        axes[1, j].imshow(render_overlay(case.hu, case.maps["rollout"], case.mask, window=_window(preset), alpha=alpha))
    return fig


def save_figure(fig: Figure, path: str | os.PathLike, *, dpi: int = 100) -> Path:
    """Write a figure as PNG, atomically (no truncated file after a crash); returns the path."""
    with atomic_write(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    return Path(path)


# --- browsing -------------------------------------------------------------------------------------------------------


def is_headless() -> bool:
    """True when widgets cannot be used: ``VIT_CT_HEADLESS`` is 1/true (``0``/false forces widgets), or there is no
    Jupyter kernel (plain Python), or ipywidgets is missing. A kernel cannot see whether a frontend is attached,
    so runs without one (papermill, nbconvert) set the variable or the notebook's ``interactive = False``."""
    flag = headless_flag()
    if flag is not None:
        return flag
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return True
    return not in_jupyter_kernel()


def browse(
    model: ViTClassifier,
    datamodule: CTSliceDataModule,
    table: pd.DataFrame,
    *,
    interactive: bool | None = None,
    threshold: float = 0.5,
    window: str = DISPLAY_PRESET,
    alpha: float = 0.5,
    reading: MapReading = REVIEW_READING,
):
    """Browse the cases (slider, in :func:`review_order`), window preset, map method and opacity with ipywidgets;
    headless (``interactive`` False, or None and :func:`is_headless`) the static figure of the first case instead.

    Returns:
        An ``ipywidgets.interactive`` widget, or a matplotlib ``Figure`` when headless.
    """
    order = review_order(table, threshold=threshold)
    cache: dict[int, CaseMaps] = {}

    def figure(case: int, window: str, method: str, alpha: float) -> Figure:
        row = order.iloc[case]
        if row.name not in cache:
            cache[row.name] = case_maps(model, datamodule, row, reading=reading)
        maps = cache[row.name]
        title = f"{GROUPS.get(row['group'], row['group'])} {row['image']}\n{_caption(row)}"
        return plot_overlays(maps.hu, {method: maps.maps[method]}, maps.mask, window=window, alpha=alpha, title=title)

    window = window if isinstance(window, str) and window in WINDOW_PRESETS else DISPLAY_PRESET
    if not (interactive if interactive is not None else not is_headless()):
        return figure(0, window, METHODS[0], alpha)
    import ipywidgets as widgets
    from IPython.display import display

    def show(case: int, window: str, method: str, alpha: float) -> Figure:
        fig = figure(case, window, method, alpha)
        display(fig)
        return fig

    return widgets.interactive(
        show,
        case=widgets.IntSlider(value=0, min=0, max=len(order) - 1, description="case"),
        window=widgets.Dropdown(options=list(WINDOW_PRESETS), value=window, description="window"),
        method=widgets.Dropdown(options=list(METHODS), value=METHODS[0], description="map"),
        alpha=widgets.FloatSlider(value=alpha, min=0.0, max=1.0, step=0.05, description="opacity"),
    )
