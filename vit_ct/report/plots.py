"""The report's figures as PNG (matplotlib, Agg): ROC and precision-recall curves with their 95% bands, reliability
diagrams, decision curves, the pointing game by lesion size; one colour per model."""

from __future__ import annotations

import io

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only, no display: also on a server without one
import matplotlib.pyplot as plt  # noqa: E402

from vit_ct.report.calibration import BINS  # noqa: E402
from vit_ct.report.detection import GRID  # noqa: E402

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()


def curve_figure(models: list, kind: str) -> bytes:
    """ROC (``kind="roc"``: sensitivity against 1 - specificity) or precision-recall curves per level (slices, scans),
    each model's curve with its pointwise 95% band over patients."""
    levels = [level for level in ("slice", "scan") if any(level in m.curves for m in models)]
    figure, axes = plt.subplots(1, len(levels), figsize=(4.6 * len(levels), 4.2), squeeze=False)
    for ax, level in zip(axes[0], levels, strict=True):
        drawn = 0
        for colour, model in zip(COLOURS, models, strict=False):
            if level not in model.curves:
                continue
            value, lo, hi = model.curves[level][kind]
            if np.isnan(np.asarray(value, float)).all():  # one class only (e.g. every scan positive): no curve
                continue
            drawn += 1
            figure_name = "auroc" if kind == "roc" else "average_precision"
            summary = model.sections[level][figure_name]["value"]
            label = f"{model.name} ({'AUROC' if kind == 'roc' else 'AP'} {summary:.3f})" if summary is not None else (
                model.name)  # fmt: skip
            ax.plot(GRID, value, color=colour, label=label)
            ax.fill_between(GRID, lo, hi, color=colour, alpha=0.2, linewidth=0)
        if kind == "roc":
            ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
            ax.set_xlabel("1 - specificity")
            ax.set_ylabel("sensitivity")
        else:
            ax.set_xlabel("recall (sensitivity)")
            ax.set_ylabel("precision")
        ax.set_title(f"{'ROC' if kind == 'roc' else 'precision-recall'}, {level}s")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.02)
        if drawn:
            ax.legend(loc="lower right" if kind == "roc" else "lower left", fontsize=8)
        else:  # said on the axes, not left empty
            ax.text(0.5, 0.5, f"undefined: the {level}s reported\nhold one class only", ha="center", va="center")
    return _png(figure)


def reliability_figure(models: list) -> bytes:
    """Reliability diagram: per bin of P(lesion), the share of slices with a lesion against the mean P(lesion) (the
    diagonal is perfect calibration); after temperature scaling dashed, where it was fitted."""
    figure, ax = plt.subplots(figsize=(4.6, 4.2))
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
    for colour, model in zip(COLOURS, models, strict=False):
        calibration = model.sections["calibration"]
        if not calibration:  # no slice labels
            continue
        bins = calibration["reliability"]
        ece = calibration["ece"]["value"]
        ax.plot([b["mean_prob"] for b in bins], [b["fraction_positive"] for b in bins], "o-", color=colour,
                label=f"{model.name} (ECE {ece:.3f})")  # fmt: skip
        if calibration.get("temperature"):
            after = calibration["reliability_after"]
            ax.plot([b["mean_prob"] for b in after], [b["fraction_positive"] for b in after], "s--", color=colour,
                    label=f"{model.name}, T = {calibration['temperature']:.2f}")  # fmt: skip
    ax.set_xlabel("mean P(lesion) in the bin")
    ax.set_ylabel("share of slices with a lesion")
    ax.set_title(f"reliability, {BINS} equal-width bins")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left", fontsize=8)
    return _png(figure)


def pointing_by_size_figure(models: list) -> bytes | None:
    """The rollout's pointing game per quartile of lesion area, with 95% intervals; None when no model has maps."""
    having = [m for m in models if m.sections["maps"].get("pointing_by_lesion_size")]
    if not having:
        return None
    figure, ax = plt.subplots(figsize=(4.6, 3.6))
    for i, (colour, model) in enumerate(zip(COLOURS, having, strict=False)):
        by_size = model.sections["maps"]["pointing_by_lesion_size"]
        quartiles = [q for q in range(1, 5) if f"q{q}" in by_size and by_size[f"q{q}"]["value"] is not None]
        values = [by_size[f"q{q}"]["value"] for q in quartiles]
        intervals = [by_size[f"q{q}"]["ci95"] or [v, v] for q, v in zip(quartiles, values, strict=True)]
        errors = [[v - ci[0] for v, ci in zip(values, intervals, strict=True)],
                  [ci[1] - v for v, ci in zip(values, intervals, strict=True)]]  # fmt: skip
        x = [q + 0.1 * (i - (len(having) - 1) / 2) for q in quartiles]
        ax.errorbar(x, values, yerr=errors, fmt="o", color=colour, capsize=3, label=model.name)
    unit = having[0].sections["maps"]["pointing_by_lesion_size"]["area"]
    ax.set_xticks([1, 2, 3, 4], ["q1\nsmallest", "q2", "q3", "q4\nlargest"])
    ax.set_ylabel("pointing game")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"rollout pointing by lesion area ({'mm²' if unit == 'mm2' else 'pixels'}) quartile")
    ax.legend(fontsize=8)
    return _png(figure)


def decision_figure(models: list) -> bytes | None:
    """Decision curves per level (slices, scans): each model's net benefit over threshold probabilities with its 95%
    band over patients, beside acting on every case (grey) and on none (zero); None when no model has one."""
    levels = [level for level in ("slice", "scan") if any(level in m.sections["decision_curve"] for m in models)]
    if not levels:
        return None
    figure, axes = plt.subplots(1, len(levels), figsize=(4.6 * len(levels), 4.2), squeeze=False)
    for ax, level in zip(axes[0], levels, strict=True):
        top = 0.0
        for colour, model in zip(COLOURS, models, strict=False):
            curve = model.sections["decision_curve"].get(level)
            if curve is None:
                continue
            t, value = np.asarray(curve["thresholds"]), np.asarray(curve["model"], float)
            lo, hi = (np.asarray(bound, float) for bound in curve["model_ci95"])
            ax.plot(t, value, color=colour, label=model.name)
            ax.fill_between(t, lo, hi, color=colour, alpha=0.2, linewidth=0)
            top = max(top, curve["prevalence"] or 0.0)
        every = np.asarray(curve["treat_all"], float)
        ax.plot(t, every, color="grey", linewidth=1, label=f"act on every {level}")
        ax.axhline(0.0, color="black", linewidth=1, linestyle=":", label="act on none")
        ax.set_xlim(0, 1)
        ax.set_ylim(-0.05 * max(top, 0.1), 1.1 * max(top, 0.1))
        ax.set_xlabel("threshold probability")
        ax.set_ylabel("net benefit")
        ax.set_title(f"decision curve, {level}s")
        ax.legend(loc="upper right", fontsize=8)
    return _png(figure)


def report_figures(models: list) -> dict[str, bytes]:
    """Every figure, by file name."""
    figures = {"roc.png": curve_figure(models, "roc"), "pr.png": curve_figure(models, "pr"),
               "reliability.png": reliability_figure(models)}  # fmt: skip
    decision = decision_figure(models)
    if decision is not None:
        figures["decision_curve.png"] = decision
    pointing = pointing_by_size_figure(models)
    if pointing is not None:
        figures["pointing_by_size.png"] = pointing
    return figures
