"""``report.html``: one self-contained page (figures and overlays embedded as base64 PNG, no external reference, so it
opens offline and travels as one file), each figure with its 95% interval and count, models side by side."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from vit_ct.report.calibration import BINS
from vit_ct.report.detection import SPECIFICITIES, operating_point
from vit_ct.report.map_quality import MAP_SCORES
from vit_ct.report.map_sanity import FIGURES
from vit_ct.report.subgroups import MIN_CASES

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.2em; font-size: 0.9em; display: block; max-width: 100%;
        overflow-x: auto; }
td { overflow-wrap: anywhere; }
th, td { border-bottom: 1px solid #ddd; padding: 0.25em 0.7em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.ci { color: #666; font-size: 0.85em; }
figure { display: inline-block; margin: 0.3em; vertical-align: top; }
figure img { max-width: 100%; }
.cases img { width: 180px; }
figcaption { font-size: 0.8em; color: #444; max-width: 180px; word-break: break-all; }
dt { font-weight: 600; margin-top: 0.4em; }
.side { display: flex; flex-wrap: wrap; gap: 1.5em; align-items: flex-start; }
.curves { flex: 1 1 420px; }
.curves img { display: block; max-width: 100%; }
.note { font-size: 0.85em; color: #555; max-width: 40em; }
"""
LEVEL_ROWS = ["auroc", "average_precision", "sensitivity", "specificity"] + [
    f"{kind}_at_{operating_point(s)}" for s in SPECIFICITIES for kind in ("sensitivity", "specificity", "threshold")
]
NAMES = {"auroc": "AUROC", "average_precision": "average precision", "sensitivity": "sensitivity at P > 0.5",
         "specificity": "specificity at P > 0.5", "ece": "expected calibration error", "brier": "Brier score",
         "ece_after": "ECE after temperature scaling", "brier_after": "Brier score after temperature scaling",
         "pointing": "pointing game"}  # fmt: skip
DEFINITIONS = {
    "interval": "95% interval: 2.5th to 97.5th percentile over bootstrap replicates that each draw patients with "
    "replacement, keeping all their slices (and scans); n: the cases a figure is computed on",
    "AUROC": "probability that a random case with a lesion gets a higher P(lesion) than one without (ties count half)",
    "average precision": "area under the precision-recall curve, as the sum of precision x recall steps",
    "sensitivity / specificity at P > 0.5": "share of cases with / without a lesion called positive / negative",
    "at 90% / 95% specificity": "the ROC point of highest sensitivity whose specificity is at least 90% / 95%; its "
    "threshold: cases with P(lesion) at or above it are called positive",
    "scan": "a scan's P(lesion) is its most suspicious slice's; it holds a lesion when any slice does (or when its "
    "scan label says so)",
    "ECE": f"sum over {BINS} equal-width bins of P(lesion) of the bin's share of slices x |mean P(lesion) - share with"
    " a lesion| (torchmetrics' BinaryCalibrationError, l1 norm)",
    "Brier score": "mean of (P(lesion) - label)^2",
    "temperature scaling": "P = sigmoid(logit(P) / T), T fitted on the predicted validation slices by likelihood",
    "maps": "per slice with a lesion mask, averaged: pointing (map maximum within the tolerance of the lesion), energy "
    "(share of the map's mass on the lesion), mask fraction (the lesion's share of the head: chance energy), energy "
    "ratio (mean energy / mean mask fraction), in-head pixel AUROC, Dice and HD95 of the map's half-maximum region; "
    "perfect_patch: the mask pooled to the patch grid, the ceiling; floor_image: the slice's first window as the map, "
    "floor_head: the head mask (chance), the floors a map must beat",
    "map sanity check": "model randomisation (Adebayo et al. 2018): the checkpoint's parts re-initialised top down "
    "(head, each block, patch embedding, position embedding); per step, Spearman's rank correlation (ρ) of each "
    "slice's map with the trained model's, inside the head, and the share of slices whose map maximum left its patch; "
    "PASS when, fully randomised, mean ρ < 0.5 and at least half the maxima moved. The image floor reads no weight: "
    "it must FAIL",
    "decision curve": "net benefit of acting on the cases with P(lesion) at or above a threshold probability t: "
    "TP/n - FP/n x t/(1 - t) (Vickers & Elkin 2006), beside acting on every case (prevalence - (1 - prevalence) x "
    "t/(1 - t)) and on none (0); t says how many false alarms one found lesion is worth, (1 - t)/t; above both: the "
    "thresholds where the model's net benefit is higher than either",
    "subgroups": f"slices of one level of a manifest column, DICOM header field or lesion-area quartile; under "
    f"{MIN_CASES} slices only the count; verdict: lower / higher when the level's AUROC interval (sensitivity where it "
    "has no negatives, specificity where it has no positives) excludes the overall value",
}


def _figure_cell(metric: dict | None) -> str:
    if not metric or metric.get("value") is None:
        return "&ndash;"
    ci, undefined = metric.get("ci95"), metric.get("ci95_undefined")
    interval = f' <span class="ci">[{ci[0]:.3f}, {ci[1]:.3f}]</span>' if ci else ""
    if undefined:
        interval = f' <span class="ci">[interval undefined: {html.escape(undefined)}]</span>'
    return f'{metric["value"]:.3f}{interval} <span class="ci">n={metric["n"]}</span>'


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _level_table(models: list, level: str, names: list[str]) -> str:
    rows = [[html.escape(NAMES.get(n, n.replace("_", " ")))] + [_figure_cell(m.sections[level].get(n)) for m in models]
            for n in names if any(m.sections[level].get(n) for m in models)]  # fmt: skip
    return _table(["", *(m.name for m in models)], rows)


def _one_class(models: list, level: str, cases: str) -> str:
    """Why a level's AUROC, average precision and specificity (or sensitivity) are blank: every case on one side."""
    notes = []
    for model in models:
        figures = model.sections[level]
        positives, negatives = (figures.get(k, {}).get("n", 0) for k in ("sensitivity", "specificity"))
        if figures and not (positives and negatives):
            side = "with" if positives else "without"
            notes.append(f"{model.name}: all {positives + negatives} {cases} are {side} a lesion, so only the "
                         f"{'sensitivity' if positives else 'specificity'} is defined")  # fmt: skip
    return f'<p class="note">{html.escape("; ".join(notes))}.</p>' if notes else ""


def _maps(models: list) -> str:
    rows = []
    for source in ("rollout", "floor_image", "floor_head", "perfect_patch"):
        for score in MAP_SCORES:
            cells = [_figure_cell(m.sections["maps"].get(source, {}).get(score)) for m in models]
            if any(c != "&ndash;" for c in cells):
                rows.append([f"{source} {score.replace('_', ' ')}", *cells])
    sizes = []
    for model in models:
        by_size = model.sections["maps"].get("pointing_by_lesion_size") or {}
        edges, unit = by_size.get("edges", []), "mm²" if by_size.get("area") == "mm2" else "px"
        for q in range(1, 5):
            if f"q{q}" in by_size:
                sizes.append([html.escape(model.name), f"q{q}: {edges[q - 1]:.4g}-{edges[q]:.4g} {unit}",
                              _figure_cell(by_size[f"q{q}"])])  # fmt: skip
    notes = [m.sections["maps"]["note"] for m in models if "note" in m.sections["maps"]]
    empty = f"<p>{html.escape(notes[0])}.</p>" if notes else "<p>No reported slice has a lesion mask.</p>"
    out = _table(["map and score", *(m.name for m in models)], rows) if rows else empty
    return out + (_table(["model", "lesion area quartile", "rollout pointing"], sizes) if sizes else "")


def _decision(models: list, figures: dict[str, bytes]) -> str:
    rows = []
    for model in models:
        for level, curve in model.sections["decision_curve"].items():
            for entry in curve["table"]:
                rows.append([html.escape(model.name), f"{level}s", f"{entry['threshold']:g}",
                             _figure_cell(entry["model"]), f"{entry['treat_all']:.3f}", "0"])  # fmt: skip
            ranges = ", ".join(f"{lo:g}-{hi:g}" for lo, hi in curve["model_better"]) or "none"
            rows.append([html.escape(model.name), f"{level}s", "above both", ranges, "", ""])
    if not rows:
        return "<p>No labelled slice or scan: no decision curve.</p>"
    header = ["model", "level", "threshold", "net benefit", "act on every case", "act on none"]
    picture = _img(figures["decision_curve.png"], "decision curves") if "decision_curve.png" in figures else ""
    return f'<div class="side"><div>{_table(header, rows)}</div><div class="curves">{picture}</div></div>'


def _sanity(sanity: dict | None, figures: dict[str, bytes]) -> str:
    if sanity is None:
        return ("<p>Not run: add <code>--ckpt_path CKPT</code> (the checkpoint the predictions were made with) to check"
                " that the maps change when the model's weights are randomised.</p>")  # fmt: skip
    rows, pictures = [], []
    for method, check in sanity["methods"].items():
        last, criteria = check["steps"][-1], check["criteria"]
        verdict = f"<b>{check['verdict']}</b>" if check["verdict"] == "PASS" else check["verdict"]
        low, high = last["spearman_q10_q90"]
        rho = f'{last["spearman_mean"]:.3f} <span class="ci">[q10-q90 {low:.2f}, {high:.2f}] n={check["slices"]}</span>'
        rule = f"ρ &lt; {criteria['spearman_mean_below']}, moved &ge; {criteria['moved_at_least']:.0%}"
        changed = html.escape(str(check["first_changed"] or "never"))
        rows.append([html.escape(method), verdict, rho, f"{last['moved']:.0%}", changed, rule])
        file = FIGURES.get(method)
        if file in figures:
            pictures.append(_img(figures[file], f"{method}: maps per randomisation step"))
    settings = (f"checkpoint {sanity['ckpt_path']}; the first {sanity['slices']} slices of the {sanity['split']}"
                f" split, seed {sanity['seed']}; {sanity['checked']}")  # fmt: skip
    header = ["map", "verdict", "mean ρ, fully randomised", "maxima moved", "changed from step", "pass when"]
    return f"<p>{html.escape(settings)}</p>" + _table(header, rows) + "".join(pictures)


def _subgroups(model) -> str:
    parts = []
    for column, levels in model.sections["subgroups"].items():
        rows = []
        for level, entry in levels.items():
            figures = [_figure_cell(entry.get(k)) for k in ("auroc", "sensitivity", "specificity", "pointing")]
            verdict = entry.get("verdict") or ("too few to say" if entry["n"] < MIN_CASES else "&ndash;")
            rows.append([html.escape(level), str(entry["n"]), str(entry["positives"]), *figures, verdict])
        parts.append(
            f"<h4>{html.escape(column)}</h4>"
            + _table(
                ["level", "slices", "with lesion", "AUROC", "sensitivity", "specificity", "pointing", "verdict"], rows
            )
        )
    return "".join(parts) or "<p>No categorical manifest column, DICOM header field or lesion mask to group by.</p>"


def _cases(model) -> str:
    parts = []
    for kind, cases in model.sections["worst_cases"].items():
        figures = []
        for case in cases:
            overlay = case.get("overlay")
            picture = _img(Path(overlay).read_bytes(), case["image"]) if overlay and Path(overlay).is_file() else ""
            caption = f"{html.escape(case['image'])}<br>P(lesion) {case['p_lesion']:.3f}"
            figures.append(f"<figure>{picture}<figcaption>{caption}</figcaption></figure>")
        title = kind.replace("_", " ")
        parts.append(f"<h4>{title}</h4>" + ("".join(figures) or "<p>none</p>"))
    return f'<div class="cases">{"".join(parts)}</div>'


def report_page(
    models: list, figures: dict[str, bytes], *, title: str, settings: str, sanity: dict | None = None
) -> str:
    """The whole page: models' figures side by side, the figures' PNGs, the map sanity check (``report.json``'s
    ``sanity``), the worst cases, the definitions."""
    first = models[0].sections
    temperature = [[html.escape(m.name), f"{m.sections['calibration']['temperature']:.3f}",
                    str(m.sections['calibration']['fitted_on'])] for m in models
                   if m.sections["calibration"].get("temperature")]  # fmt: skip
    rows = [[html.escape(m.name), html.escape(m.sections["rows"]["split"]), str(m.sections["rows"]["slices"]),
             str(m.sections["rows"]["positive_slices"]), str(m.sections["rows"]["scans"]),
             str(m.sections["rows"]["patients"])] for m in models]  # fmt: skip
    body = [
        f"<h1>{html.escape(title)}</h1><p>{html.escape(settings)}</p>",
        _table(["model", "split", "slices", "with lesion", "scans", "patients"], rows),
        "<h2>Detection</h2>",
    ]
    tables = ["<h3>Slices</h3>", _level_table(models, "slice", LEVEL_ROWS), _one_class(models, "slice", "slices")]
    if any(m.sections["scan"] for m in models):
        tables += ["<h3>Scans</h3>", _level_table(models, "scan", LEVEL_ROWS), _one_class(models, "scan", "scans")]
    curves = [_img(figures["roc.png"], "ROC curves"), _img(figures["pr.png"], "precision-recall curves")]
    body.append(f'<div class="side"><div>{"".join(tables)}</div><div class="curves">{"".join(curves)}</div></div>')
    body += ["<h2>Calibration</h2>", _level_table(models, "calibration", ["ece", "brier", "ece_after", "brier_after"])]
    body += [_table(["model", "temperature T", "fitted on slices"], temperature) if temperature else
             f"<p>{html.escape(first['calibration'].get('temperature_note', ''))}</p>"]  # fmt: skip
    body += [_img(figures["reliability.png"], "reliability diagram"), "<h2>Decision curve</h2>",
             _decision(models, figures), "<h2>Maps against the lesion masks</h2>",
             _maps(models)]  # fmt: skip
    if "pointing_by_size.png" in figures:
        body.append(_img(figures["pointing_by_size.png"], "pointing by lesion size"))
    body += ["<h2>Map sanity check</h2>", _sanity(sanity, figures)]
    for model in models:
        body += [f"<h2>Subgroups: {html.escape(model.name)}</h2>", _subgroups(model)]
    for model in models:
        body += [f"<h2>Worst cases: {html.escape(model.name)}</h2>", _cases(model)]
    terms = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in DEFINITIONS.items())
    body.append(f"<h2>Definitions</h2><dl>{terms}</dl>")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>\n")  # fmt: skip
