"""A whole scan as a radiologist reads it, from a ``vit-ct predict`` output: the slices in order with the rollout
over them (opacity, window, map on or off), the probability along the scan with the scan's probability and its peak
slice marked (with a sequence head, beside it each slice read in its scan: where the two part is where the scan moved
the decision), and the reviewer's verdict buttons, each click written to the verdicts CSV at once; the summary of the
verdicts so far follows the clicks. Headless (papermill, ``python -m vit_ct.review``) the static figure of each scan's
peak slice instead, and the summary as it stands.
"""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from vit_ct.data.transforms.windows import DISPLAY_PRESET, WINDOW_PRESETS
from vit_ct.explain.overlay import render_overlay
from vit_ct.metrics.schema import PREDICTIONS, SCANS
from vit_ct.review.figures import is_headless
from vit_ct.review.predict_run import PredictRun
from vit_ct.review.verdicts import LABEL_VERDICTS, MAP_VERDICTS, Verdicts, verdict_summary


def final_reading(slices: pd.DataFrame) -> str:
    """The column of P(lesion) as the model read the slices last: in their scan where it has a sequence head."""
    return SCANS.p_lesion_in_scan if SCANS.p_lesion_in_scan in slices else SCANS.p_lesion


def peak_slice(slices: pd.DataFrame) -> int:
    """The position (in scan order) of the scan's most suspicious slice (:func:`final_reading`): the scan's
    probability is its."""
    return int(np.argmax(slices[final_reading(slices)].to_numpy()))


def plot_scan(
    run: PredictRun,
    scan: str,
    position: int | None = None,
    *,
    window: str = DISPLAY_PRESET,
    alpha: float = 0.5,
    show_map: bool = True,
) -> Figure:
    """One slice of ``scan`` (default: its peak) with its map, beside P(lesion) along the scan."""
    slices = run.scan_slices(scan)
    peak = peak_slice(slices)
    position = peak if position is None else int(np.clip(position, 0, len(slices) - 1))
    row = slices.iloc[position]
    hu, mask = run.images(row)
    heat = run.rollout(row) if show_map else None
    fig = Figure(figsize=(9.5, 4.2), layout="constrained")
    image_ax, curve_ax = fig.subplots(1, 2, width_ratios=[1, 1.25])
    image_ax.imshow(render_overlay(hu, heat, mask, window=WINDOW_PRESETS[window], alpha=alpha))
    image_ax.set_axis_off()
    label = row.get(PREDICTIONS.label, np.nan)
    read = f" (in scan {row[SCANS.p_lesion_in_scan]:.2f})" if SCANS.p_lesion_in_scan in row else ""
    image_ax.set_title(f"{scan}: slice {position + 1}/{len(slices)}  P(lesion) {row[SCANS.p_lesion]:.2f}{read}"
                       + ("" if pd.isna(label) else f"  label {int(label)}"), fontsize=9)  # fmt: skip
    probs = slices[SCANS.p_lesion].to_numpy()
    top = int(np.argmax(probs))
    curve_ax.plot(np.arange(1, len(probs) + 1), probs, marker="o", color="tab:blue", label="P(lesion) per slice")
    curve_ax.axhline(probs[top], color="tab:red", linestyle="--", linewidth=1, label=f"scan {probs[top]:.2f}")
    final = slices[final_reading(slices)].to_numpy()
    if SCANS.p_lesion_in_scan in slices:  # a sequence head: each slice read in its scan, and the scan's decision so
        curve_ax.plot(np.arange(1, len(final) + 1), final, marker="s", markersize=4, color="tab:orange",
                      label="P(lesion) in its scan")  # fmt: skip
        curve_ax.axhline(
            final[peak], color="tab:orange", linestyle=":", linewidth=1, label=f"scan in scan {final[peak]:.2f}"
        )
    curve_ax.plot(peak + 1, final[peak], marker="*", markersize=14, color="tab:red", linestyle="none", label="peak")
    curve_ax.axvline(position + 1, color="grey", linewidth=1)
    curve_ax.set(xlabel="slice along the scan", ylabel="P(lesion)", xlim=(0.5, len(probs) + 0.5), ylim=(-0.02, 1.02))
    curve_ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # whole slices, one-slice scans too
    curve_ax.legend(loc="lower right", fontsize=8)
    return fig


def scan_browser(
    run: PredictRun,
    verdicts: Verdicts | None = None,
    *,
    interactive: bool | None = None,
    window: str = DISPLAY_PRESET,
    alpha: float = 0.5,
):
    """Every scan of ``run``, most suspicious first: a slice slider (arrow keys step it), window preset, map on/off,
    opacity, a button to jump to the peak slice, and with ``verdicts`` the buttons and note of the scan's verdict
    (restored when reopened). Headless (``interactive`` False, or None and headless): the peak-slice figure of every
    scan, a list of ``Figure``.
    """
    order = scans_by_probability(run)
    if not (interactive if interactive is not None else not is_headless()):
        return [plot_scan(run, scan, window=window, alpha=alpha) for scan in order]
    import ipywidgets as widgets
    from IPython.display import clear_output, display

    scan_box = widgets.Dropdown(options=order, value=order[0], description="scan")
    position = widgets.IntSlider(value=0, min=0, max=0, description="slice", continuous_update=False)
    preset = widgets.ToggleButtons(options=list(WINDOW_PRESETS), value=window, description="window")
    show_map = widgets.Checkbox(value=True, description="show map")
    opacity = widgets.FloatSlider(value=alpha, min=0.0, max=1.0, step=0.05, description="opacity")
    to_peak = widgets.Button(description="peak slice")
    map_verdict = widgets.ToggleButtons(options=MAP_VERDICTS, value=None, description="map")
    label_verdict = widgets.ToggleButtons(options=LABEL_VERDICTS, value=None, description="label")
    note = widgets.Text(description="note", continuous_update=False)
    out = widgets.Output()
    restoring = False

    def draw(*_):
        with out:
            clear_output(wait=True)
            display(plot_scan(run, scan_box.value, position.value, window=preset.value, alpha=opacity.value,
                              show_map=show_map.value))  # fmt: skip

    def select_scan(*_):
        nonlocal restoring
        slices = run.scan_slices(scan_box.value)
        position.max = len(slices) - 1
        position.value = peak_slice(slices)
        if verdicts is not None:
            restoring = True  # showing the stored verdict is not a new one
            earlier = verdicts.get(scan_box.value)
            map_verdict.value, label_verdict.value = earlier.get("map"), earlier.get("label")
            note.value = earlier.get("note", "")
            restoring = False
        draw()

    def save(change):
        if verdicts is None or restoring or change["new"] in (None, ""):
            return
        field = {map_verdict: "map", label_verdict: "label", note: "note"}[change["owner"]]
        verdicts.record(scan_box.value, **{field: change["new"]})

    scan_box.observe(select_scan, names="value")
    for control in (position, preset, show_map, opacity):
        control.observe(draw, names="value")
    to_peak.on_click(lambda _: setattr(position, "value", peak_slice(run.scan_slices(scan_box.value))))
    for control in (map_verdict, label_verdict, note):
        control.observe(save, names="value")
    select_scan()
    rows = [widgets.HBox([scan_box, position, to_peak]), widgets.HBox([preset, show_map, opacity]), out]
    if verdicts is not None:
        rows += [map_verdict, label_verdict, note]
    return widgets.VBox(rows)


def scans_by_probability(run: PredictRun) -> list[str]:
    """The run's scans, highest P(lesion) first (``scans.csv``'s, else each scan's peak slice's): as the model read
    them last, each slice in its scan where it has a sequence head."""
    if run.scans is not None and {SCANS.scan, SCANS.prob} <= set(run.scans.columns):
        prob = SCANS.prob_in_scan if SCANS.prob_in_scan in run.scans.columns else SCANS.prob
        ranked = run.scans.sort_values(prob, ascending=False, kind="stable")
        return ranked[SCANS.scan].astype(str).tolist()
    if PREDICTIONS.scan not in run.slices:
        raise ValueError(f"{run.folder} has no scans: predict whole scans, or a manifest with a scan or patient_id")
    peaks = run.slices.groupby(PREDICTIONS.scan)[final_reading(run.slices)].max()
    peaks = peaks.sort_values(ascending=False, kind="stable")
    return [str(s) for s in peaks.index]


def verdicts_so_far(verdicts: Verdicts, *, interactive: bool | None = None):
    """The summary of the reviewer's verdicts (:func:`~vit_ct.review.verdicts.verdict_summary`): an ipywidgets
    ``HTML`` table drawn again after every verdict ``verdicts`` records (the scan view's clicks), read from the file
    as it is then; headless (``interactive`` False, or None and headless) the summary's dict as it stands."""
    if not (interactive if interactive is not None else not is_headless()):
        return verdict_summary(verdicts.frame)
    import ipywidgets as widgets

    view = widgets.HTML(_summary_html(verdicts))
    verdicts.on_record(lambda _case: setattr(view, "value", _summary_html(verdicts)))
    return view


def _summary_html(verdicts: Verdicts) -> str:
    summary = verdict_summary(verdicts.frame)

    def shown(value) -> str:
        if isinstance(value, float):
            return "n/a" if np.isnan(value) else f"{value:.0%}"  # no case to count yet
        if isinstance(value, dict):
            return ", ".join(f"{name} {count}" for name, count in value.items())
        if isinstance(value, list):
            return ", ".join(map(str, value)) or "none"
        return str(value)

    table = pd.Series({name: shown(value) for name, value in summary.items()}, dtype=object).to_frame("value")
    return f"<b>verdicts of {html.escape(verdicts.reviewer)} so far</b>" + table.to_html(escape=True)
