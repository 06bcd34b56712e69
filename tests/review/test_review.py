"""``vit_ct.review`` and ``vit_ct.review.figures``: the review table against ``vit-ct predict`` and the model's own
test metrics, the summary metrics against sklearn, calibration and gallery order against hand-computed tables, and the
figures, browser and export."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import DEMO_LEVERS, quiet_trainer
from matplotlib.figure import Figure
from PIL import Image

from vit_ct import ViTClassifier, review
from vit_ct.data.loading.slice_dataset import slice_item
from vit_ct.explain.map_reading import ONE_PASS
from vit_ct.metrics.localisation import (
    MAP_SOURCES,
    SCORES,
    SURFACE_DISTANCE_SOURCES,
    LocalisationMetrics,
    scores_per_slice,
)
from vit_ct.metrics.schema import PREDICTIONS, REVIEW
from vit_ct.predict.writer import PredictionWriter
from vit_ct.review import figures as review_figures
from vit_ct.review.verdicts import read_verdicts

WINDOWS = {"data": {"init_args": {"windows": ["brain", "subdural"]}}}


def hand_table(prob, label, images=None) -> pd.DataFrame:
    images = images or [f"s{i}.dcm" for i in range(len(prob))]
    return pd.DataFrame({"image": images, "prob": prob, "label": pd.array(label, dtype="Int64")})


@pytest.fixture(scope="module")
def sklearn_metrics():
    """The reference implementation (scikit-learn, a dev dependency)."""
    return pytest.importorskip("sklearn.metrics")


@pytest.fixture(scope="module")
def scored():
    rng = np.random.default_rng(0)
    prob = rng.uniform(size=60)
    label = (rng.uniform(size=60) < prob).astype(int)  # informative but imperfect
    return hand_table(prob, label)


# --- metrics against references --------------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [0.5, 0.3])
def test_confusion_and_summary_match_sklearn(scored, threshold, sklearn_metrics):
    y, p = scored["label"].to_numpy(int), scored["prob"].to_numpy()
    predicted = (p > threshold).astype(int)
    expected = sklearn_metrics.confusion_matrix(y, predicted, labels=[0, 1])
    np.testing.assert_array_equal(review.confusion(scored, threshold).to_numpy(), expected)
    metrics = review.summary_metrics(scored, threshold)
    assert metrics["slices"] == 60 and metrics["positives"] == y.sum()
    assert metrics["auroc"] == pytest.approx(sklearn_metrics.roc_auc_score(y, p), abs=1e-6)
    assert metrics["accuracy"] == pytest.approx(sklearn_metrics.accuracy_score(y, predicted))
    assert metrics["sensitivity"] == pytest.approx(sklearn_metrics.recall_score(y, predicted))
    assert metrics["specificity"] == pytest.approx(sklearn_metrics.recall_score(y, predicted, pos_label=0))


def test_threshold_is_strict_and_unlabelled_rows_are_left_out():
    table = hand_table([0.5, 0.9, 0.2, 0.7], [1, 0, 0, None])
    assert list(review.outcome(table, 0.5)) == ["FN", "FP", "TN", "unlabelled"]  # 0.5 > 0.5 is False
    metrics = review.summary_metrics(table, 0.5)
    assert metrics["slices"] == 3 and metrics["positives"] == 1
    assert metrics["sensitivity"] == 0 and metrics["specificity"] == 0.5 and metrics["accuracy"] == pytest.approx(1 / 3)
    assert np.isnan(review.summary_metrics(hand_table([0.1, 0.8], [0, 0]))["auroc"])  # one class: no AUROC


def test_roc_points_match_sklearn(scored, sklearn_metrics):
    fpr, tpr, _ = sklearn_metrics.roc_curve(scored["label"].to_numpy(int), scored["prob"], drop_intermediate=False)
    points = review.roc_points(scored)
    np.testing.assert_allclose(points["fpr"], fpr, atol=1e-6)
    np.testing.assert_allclose(points["tpr"], tpr, atol=1e-6)
    assert points["threshold"].is_monotonic_decreasing


def test_calibration_bins_hand_computed():
    # 4 bins of 0.25: (0, .25] holds .1, .2 (one lesion); (.25, .5] holds .5 (edge: right-inclusive); (.75, 1] .8, .9
    table = hand_table([0.1, 0.2, 0.5, 0.8, 0.9], [0, 1, 1, 1, 1])
    bins = review.calibration_bins(table, n_bins=4)
    assert list(bins["count"]) == [2, 1, 0, 2]
    np.testing.assert_allclose(bins["mean_prob"], [0.15, 0.5, np.nan, 0.85])
    np.testing.assert_allclose(bins["fraction_positive"], [0.5, 1.0, np.nan, 1.0])
    # ECE: (2 |0.5 - 0.15| + 1 |1 - 0.5| + 2 |1 - 0.85|) / 5
    assert review.expected_calibration_error(bins) == pytest.approx((0.7 + 0.5 + 0.3) / 5)


def test_calibration_bins_match_sklearn(scored):
    calibration_curve = pytest.importorskip("sklearn.calibration").calibration_curve

    prob_true, prob_pred = calibration_curve(scored["label"].to_numpy(int), scored["prob"], n_bins=5)
    bins = review.calibration_bins(scored, n_bins=5)
    full = bins[bins["count"] > 0]
    np.testing.assert_allclose(full["fraction_positive"], prob_true)
    np.testing.assert_allclose(full["mean_prob"], prob_pred)


def test_gallery_groups_most_confident_first():
    table = hand_table(
        [0.6, 0.9, 0.1, 0.4, 0.7, 0.05, 0.8, 0.9, 0.3, 0.5],
        [1, 1, 1, 1, 1, 0, 0, 1, 0, None],
        images=list("abcdefghij"),
    )
    assert list(review.gallery(table, "TP", None)["image"]) == ["b", "h", "e", "a"]  # highest first, ties in order
    assert list(review.gallery(table, "TP", 2)["image"]) == ["b", "h"]
    assert list(review.gallery(table, "FN")["image"]) == ["c", "d"]  # the surest misses first
    assert list(review.gallery(table, "FP")["image"]) == ["g"]
    assert list(review.gallery(table, "TN")["image"]) == ["f", "i"]
    assert list(review.gallery(table, "unlabelled")["image"]) == ["j"]
    assert list(review.review_order(table)["image"]) == list("bheagcdfij")
    assert review.pick_case(table)["image"] == "b"
    assert review.pick_case(table, "d")["image"] == "d"
    with pytest.raises(ValueError, match="zz"):
        review.pick_case(table, "zz")
    with pytest.raises(ValueError, match="group"):
        review.gallery(table, "positives")


def test_localisation_scores_are_the_metric_per_slice():
    gen = torch.Generator().manual_seed(0)
    B, S = 6, 24
    maps = torch.rand(B, S, S, generator=gen)
    head = torch.zeros(B, S, S)
    head[:, 3:21, 4:20] = 1
    masks = torch.zeros(B, S, S)
    masks[0, 5:9, 6:10] = 1
    masks[1, 10:12, 10:16] = 1
    masks[2, 15:20, 5:8] = 1
    masks[4, 4:6, 4:6] = 1  # lesion, but its mask is not known: skipped
    known = torch.tensor([True, True, True, True, False, True])  # 3 and 5: no lesion, skipped
    batch = {"mask": masks[:, None], "head": head[:, None], "has_mask": known, "pixel_spacing_mm": torch.tensor(0.9)}
    sources = ("rollout", "floor_image", "floor_head", "perfect_patch")
    scores = scores_per_slice(dict.fromkeys(sources, maps), batch, tolerance_mm=2.0)
    assert scores["rollout_pointing"][3:].isnan().all() and not scores["rollout_pointing"][:3].isnan().any()
    assert scores["floor_head_hd95_mm"].isnan().all()  # the surface distance only of the map and its ceiling
    assert not scores["rollout_hd95_mm"][:3].isnan().any()

    metric = LocalisationMetrics(tolerance_mm=2.0, pixel_spacing_mm=0.9)
    metric.update(maps, masks, head, known=known)
    expected = {name: float(value) for name, value in metric.compute().items()}
    table = pd.DataFrame({name: values.numpy() for name, values in scores.items()})
    summary = review.localisation_summary(table)
    for name in ("pointing", "energy", "mask_fraction", "pixel_auroc", "energy_ratio", "dice", "iou", "hd95_mm"):
        rel = 1e-6 if name == "hd95_mm" else 1e-9  # MONAI's distances are float32
        assert summary.loc["rollout", name] == pytest.approx(expected[name], rel=rel), name
    assert summary.loc["rollout", "slices"] == expected["slices"]
    assert "hd95_px" not in summary.columns  # every slice has a spacing: no empty column of pixel distances
    assert review.localisation_summary(table.iloc[3:]) is None  # no scored slice: nothing to summarise

    # the same slices without a pixel spacing (.npy, no pixel_spacing_mm column): HD95 in pixels, no empty mm column
    del batch["pixel_spacing_mm"]
    with warnings.catch_warnings():  # the once-per-process line that they are scored in pixels (tested elsewhere)
        warnings.simplefilter("ignore")
        in_pixels = scores_per_slice(dict.fromkeys(sources, maps), batch, tolerance_mm=2.0)
    metric = LocalisationMetrics(tolerance_mm=2.0)
    metric.update(maps, masks, head, known=known)
    expected = {name: float(value) for name, value in metric.compute().items()}
    summary = review.localisation_summary(pd.DataFrame({name: v.numpy() for name, v in in_pixels.items()}))
    assert "hd95_mm" not in summary.columns and np.isnan(summary.loc["floor_head", "hd95_px"])  # floors: no HD95
    assert summary.loc["rollout", "hd95_px"] == pytest.approx(expected["hd95_px"], rel=1e-6)
    assert summary.loc["rollout", "pointing"] == pytest.approx(expected["pointing"], rel=1e-9)


# --- the model under review -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(synthetic_set):
    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(
        **DEMO_LEVERS, img_size=32, in_chans=2, embed_dim=32, depth=2, num_heads=2
    ).eval()
    data = review.review_datamodule(model, synthetic_set, split="test", batch_size=3, config=WINDOWS)
    table = review.run_review(model, data, progress=False, reading=ONE_PASS)  # as the trainers below read (no ReadMaps)
    return model, data, table


def test_run_review_matches_vit_ct_predict(tiny, synthetic_set, tmp_path):
    model, _, table = tiny
    data = review.review_datamodule(model, synthetic_set, split="test", batch_size=2, config=WINDOWS)
    trainer = quiet_trainer(callbacks=[PredictionWriter(tmp_path)])
    trainer.predict(model, datamodule=data, return_predictions=False)
    written = pd.read_csv(tmp_path / "predictions.csv")
    assert list(table["image"]) == list(written["image"]) and list(table["label"]) == list(written["label"])
    np.testing.assert_allclose(table["prob"], written["prob"], atol=1e-6)
    for (_, row), rollout in zip(table.iterrows(), written["rollout"], strict=True):
        heat = review.source_map(row)
        np.testing.assert_allclose(heat, np.load(tmp_path / rollout), atol=1e-6)
        hu, mask = review.case_images(row)
        assert heat.shape == hu.shape == (row["rows"], row["cols"]) and (mask is None or mask.shape == hu.shape)
    assert list(table["group"]) == list(review.outcome(table))


def test_the_review_reads_the_slices_the_data_module_reads(tiny, tmp_path):
    """Frame 0 and frame 2 of a volume, a single-slice file without a frame, all in a folder whose name holds a '#':
    the review table, its case images and a predict run opened for review read the slices the data module reads."""
    model, _, _ = tiny
    folder = tmp_path / "scans#1"  # a '#' is part of the folder's name, never a frame
    folder.mkdir()
    rng = np.random.default_rng(0)
    volume = (rng.normal(40, 20, (48, 48, 3)) + [0, 300, 600]).astype(np.float32)  # (rows, cols, slices) in HU
    masks = np.zeros((48, 48, 3), dtype=np.uint8)
    masks[10:20, 10:20, 0], masks[25:35, 20:30, 2] = 1, 1
    single = rng.normal(-500, 20, (48, 48)).astype(np.float32)
    for name, array in {"volume": volume, "masks": masks, "single": single, "single_mask": masks[..., 2]}.items():
        np.save(folder / f"{name}.npy", array)
    (folder / "manifest.csv").write_text(
        "image,label,patient_id,split,mask,slice\n"
        "volume.npy,1,p0,test,masks.npy,0\nvolume.npy,1,p0,test,masks.npy,2\nsingle.npy,1,p1,test,single_mask.npy,\n"
    )
    expected = [(volume[..., 0], masks[..., 0]), (volume[..., 2], masks[..., 2]), (single, masks[..., 2])]
    data = review.review_datamodule(model, folder / "manifest.csv", split="test", batch_size=3, config=WINDOWS)
    table = review.run_review(model, data, progress=False)
    assert table["frame"].iloc[:2].tolist() == [0, 2] and pd.isna(table["frame"].iloc[2])
    dataset = data.datasets["test"]
    for index, (hu, mask) in enumerate(expected):
        item = slice_item(hu, mask, label=dataset.labels[index], index=index, windows=data.windows, img_size=32)
        loaded = dataset.load(index)
        for key in ("image", "mask"):
            np.testing.assert_allclose(loaded[key], item[key], atol=1e-6)
    out = tmp_path / "out"
    quiet_trainer(callbacks=[PredictionWriter(out)]).predict(model, datamodule=data, return_predictions=False)
    run = review.open_predict_run(out)
    for (_, row), (_, written), (hu, mask) in zip(table.iterrows(), run.slices.iterrows(), expected, strict=True):
        for read in (review.case_images(row, table.attrs["read_options"]), run.images(written)):
            np.testing.assert_array_equal(read[0], hu)
            np.testing.assert_array_equal(read[1], mask)


def test_localisation_matches_the_models_test_metrics(tiny, synthetic_set):
    model, _, table = tiny
    data = review.review_datamodule(model, synthetic_set, split="test", batch_size=2, config=WINDOWS)
    trainer = quiet_trainer()
    (logged,) = trainer.test(model, datamodule=data, verbose=False)
    summary = review.localisation_summary(table)
    assert summary is not None and summary.loc["rollout", "slices"] == logged["test/rollout_slices"] > 0
    for source in ("rollout", "floor_image", "floor_head"):
        for name in ("pointing", "energy", "mask_fraction", "pixel_auroc", "energy_ratio"):
            assert summary.loc[source, name] == pytest.approx(logged[f"test/{source}_{name}"], abs=1e-5), (source, name)
    metrics = review.summary_metrics(table)
    assert metrics["accuracy"] == pytest.approx(logged["test/accuracy"], abs=1e-6)


def test_case_maps_agree_with_each_other(tiny):
    model, data, table = tiny
    row = table.iloc[0]
    case = review.case_maps(model, data, row, reading=ONE_PASS)  # as the table was read
    shape = (row["rows"], row["cols"])
    assert set(case.maps) == set(review.METHODS) and case.hu.shape == shape
    for heat in [*case.maps.values(), *case.heads, *case.blocks]:
        assert heat.shape == shape and (heat >= 0).all()
    np.testing.assert_allclose(case.maps["rollout"], review.source_map(row), atol=1e-6)  # the table's map
    assert case.heads.shape[0] == 2 and case.blocks.shape[0] == 2
    # mean head fusion: the heads average to the last block's map, which is the last of the per-block maps
    np.testing.assert_allclose(case.heads.mean(0), case.maps["last-block attention"], atol=1e-6)
    np.testing.assert_allclose(case.blocks[-1], case.maps["last-block attention"], atol=1e-6)
    assert case.maps["gradient rollout"].max() > 0


@pytest.mark.medium
def test_figures_render_and_save(tiny, tmp_path):
    model, data, table = tiny
    case = review.case_maps(model, data, table.iloc[0])
    figures = {
        "summary": review_figures.plot_summary(table),
        "gallery": review_figures.plot_gallery(table, n=2),
        "case": review_figures.plot_case(case, window="subdural"),
        "heads": review_figures.plot_heads(case),
        "blocks": review_figures.plot_blocks(case),
        "windows": review_figures.plot_windows(case),
    }
    images = [ax for ax in figures["gallery"].axes if ax.images]  # two per case: slice, overlay
    assert len(images) == 2 * sum(len(review.gallery(table, g, 2)) for g in review.GROUPS) > 0
    assert len([ax for ax in figures["case"].axes if ax.images]) == 1 + len(review.METHODS)
    for name, fig in figures.items():
        assert isinstance(fig, Figure)
        path = review_figures.save_figure(fig, tmp_path / "figs" / f"{name}.png")
        with Image.open(path) as png:
            assert png.format == "PNG" and min(png.size) > 100
    assert not list((tmp_path / "figs").glob(".*"))  # no temporary files left


def test_figures_without_labels(tiny):
    _, _, table = tiny
    unlabelled = table.assign(label=pd.array([pd.NA] * len(table), dtype="Int64"))
    assert set(review.outcome(unlabelled)) == {"unlabelled"}
    fig = review_figures.plot_gallery(unlabelled, n=2)
    assert len([ax for ax in fig.axes if ax.images]) == 2 * min(2, len(table))
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    for title, (_, row) in zip(titles, review.gallery(unlabelled, "unlabelled", 2).iterrows(), strict=True):
        assert title.startswith("unlabelled ") and Path(row["image"]).name in title  # traceable to its case
        if isinstance(row.get("scan"), str):  # its scan too, where the manifest names one
            assert row["scan"] in title
    assert isinstance(review_figures.plot_summary(unlabelled), Figure)


def test_browse_is_static_when_headless_and_widgets_otherwise(tiny, monkeypatch):
    model, data, table = tiny
    monkeypatch.delenv(review_figures.HEADLESS_ENV, raising=False)
    assert review_figures.is_headless()  # pytest runs no Jupyter kernel
    monkeypatch.setenv(review_figures.HEADLESS_ENV, "0")
    assert not review_figures.is_headless()
    monkeypatch.setenv(review_figures.HEADLESS_ENV, "1")
    assert review_figures.is_headless()
    assert isinstance(review_figures.browse(model, data, table), Figure)

    widgets = pytest.importorskip("ipywidgets")
    browser = review_figures.browse(model, data, table, interactive=True)
    assert isinstance(browser, widgets.interactive)
    controls = {child.description: child for child in browser.children if hasattr(child, "value")}
    assert {"case", "window", "map", "opacity"} <= set(controls)
    assert controls["case"].max == len(table) - 1
    controls["case"].value = 1
    controls["map"].value = "gradient rollout"
    second = review.review_order(table).iloc[1]["image"]
    assert isinstance(browser.result, Figure) and second in browser.result.get_suptitle()
    assert browser.result.axes[1].get_title() == "gradient rollout"


# --- paths, inputs, export ------------------------------------------------------------------------------------------


def test_checkpoint_defaults_to_the_latest_runs_best(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "vit-ct" / "abc"
    (run / "checkpoints").mkdir(parents=True)
    best = run / "checkpoints" / "best.ckpt"
    best.write_bytes(b"x")
    (tmp_path / "runs" / "latest").symlink_to(run, target_is_directory=True)
    (run / "summary.json").write_text(json.dumps({"best_checkpoint": str(best), "last_checkpoint": None}))
    (run / "config.yaml").write_text("data:\n  init_args:\n    windows: [brain, bone]\n")
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")  # where Jupyter starts the notebook's kernel
    assert review.project_root() == tmp_path
    assert review.resolve_checkpoint(None) == best.resolve()
    assert review.run_config(best)["data"]["init_args"]["windows"] == ["brain", "bone"]
    assert review.project_path("outputs/review") == tmp_path / "outputs" / "review"
    with pytest.raises(ValueError, match="nope.ckpt"):
        review.resolve_checkpoint("nope.ckpt")
    monkeypatch.chdir(tmp_path.parent)
    with pytest.raises(ValueError, match="make demo"):
        review.resolve_checkpoint(None)


def test_input_windows_follow_the_run_and_are_checked(tiny, synthetic_set):
    model = tiny[0]
    data = review.review_datamodule(model, synthetic_set, config=WINDOWS)
    assert data.windows == [(40.0, 80.0), (80.0, 200.0)] and not data.augment and data.predict_split == "test"
    with pytest.raises(ValueError, match="2 input windows"):
        review.review_datamodule(model, synthetic_set, config={})
    with pytest.raises(ValueError, match="2 input windows"):
        review.review_datamodule(model, synthetic_set, input_windows="brain")


def test_export_flagged(tiny, tmp_path):
    _, _, table = tiny
    table = table.assign(prob=np.linspace(0.1, 0.2, len(table)))  # everything negative
    written = review.export_flagged(table, tmp_path / "out" / "flagged.csv")
    expected = review.gallery(table, "FN", None)
    assert list(written["image"]) == list(expected["image"]) and set(written["group"]) <= {"FN"}
    on_disk = pd.read_csv(tmp_path / "out" / "flagged.csv")
    assert list(on_disk["image"]) == list(expected["image"]) and "rollout" not in on_disk
    chosen = list(table["image"][:2])
    assert list(review.export_flagged(table, tmp_path / "f.csv", chosen)["image"]) == chosen
    with pytest.raises(ValueError, match="nope.dcm"):
        review.export_flagged(table, tmp_path / "f.csv", ["nope.dcm"])


# --- a predict run, scan by scan, and the reviewer's verdicts ---------------------------------------------------------


@pytest.fixture(scope="module")
def predict_run(tiny, synthetic_set, tmp_path_factory):
    """``vit-ct predict``'s writer over the test split (2 scans of the synthetic set), opened without the model."""
    model, _, _ = tiny
    out = tmp_path_factory.mktemp("predict") / "out"
    data = review.review_datamodule(model, synthetic_set, split="test", batch_size=3, config=WINDOWS)
    quiet_trainer(callbacks=[PredictionWriter(out)]).predict(model, datamodule=data, return_predictions=False)
    return review.open_predict_run(out)


def test_a_predict_run_opens_without_the_model(tiny, predict_run):
    _, _, table = tiny
    slices = predict_run.slices
    assert list(slices["image"]) == list(table["image"]) and Path(slices["image_path"].iloc[0]).is_file()
    np.testing.assert_allclose(slices["p_lesion"], table["prob"], atol=1e-6)
    assert predict_run.info["task"] == "binary" and predict_run.info["input"]["img_size"] == 32
    row = slices.iloc[0]
    hu, _ = predict_run.images(row)
    assert predict_run.rollout(row).shape == hu.shape
    for scan in slices["scan"].unique():
        rows = predict_run.scan_slices(scan)
        assert list(rows["order"]) == list(range(len(rows)))
    with pytest.raises(ValueError, match="no predictions.csv"):
        review.open_predict_run(predict_run.folder / "maps")


def test_scan_view_marks_the_peak_and_headless_gives_each_scans_figure(predict_run):
    from vit_ct.review.scan_view import peak_slice, scans_by_probability

    scans = scans_by_probability(predict_run)
    first = predict_run.scan_slices(scans[0])
    assert first["p_lesion"].max() >= predict_run.scan_slices(scans[-1])["p_lesion"].max()
    assert first["p_lesion"].iloc[peak_slice(first)] == first["p_lesion"].max()
    figure = review.plot_scan(predict_run, scans[0], window="subdural", show_map=False)
    assert isinstance(figure, Figure) and len(figure.axes) == 2
    assert all(float(tick).is_integer() for tick in figure.axes[1].get_xticks())  # whole slices: no tick at 1.5
    figures = review.scan_browser(predict_run, interactive=False)
    assert len(figures) == len(scans) and all(isinstance(f, Figure) for f in figures)


@pytest.mark.parametrize("n_slices", [1, 3, 7])
def test_the_scan_views_slice_axis_shows_whole_slices_only(predict_run, n_slices):
    """The tick labels as drawn, for scans of 1, 3 and 7 slices: every slice its whole number, no 1.5 (a one-slice
    scan once had ticks at 0.960, 0.975, ...)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    slices = predict_run.slices  # the test split's slices, taken again where it has fewer
    rows = slices.iloc[[i % len(slices) for i in range(n_slices)]].assign(**{PREDICTIONS.scan: "made-up scan"})
    rows["order"] = range(n_slices)
    figure = review.plot_scan(dataclasses.replace(predict_run, slices=rows, scans=None), "made-up scan")
    FigureCanvasAgg(figure).draw()
    axis = figure.axes[1]
    low, high = axis.get_xlim()
    labels = [tick.get_text() for tick in axis.get_xticklabels() if low <= tick.get_position()[0] <= high]
    assert [int(label) for label in labels if label.isdigit()] == list(range(1, n_slices + 1)), labels


def _summary_shown(view) -> dict[str, str]:
    """The rows of the verdicts summary widget as its HTML shows them: name -> text."""
    import re

    return dict(re.findall(r"<th>([^<]+)</th>\s*<td>([^<]*)</td>", view.value))


def test_the_verdicts_summary_follows_every_click_and_keeps_the_earlier_verdicts(predict_run, tmp_path):
    path = tmp_path / "verdicts.csv"
    verdicts = review.Verdicts(path, "reader-1")
    verdicts.record("judged last week", map="elsewhere", label="disagree", note='a, "quoted" note')
    slices = predict_run.slices  # two scans: the test split's slices twice
    two = pd.concat([slices.assign(**{PREDICTIONS.scan: name}) for name in ("scan-a", "scan-b")], ignore_index=True)
    two["order"] = two.groupby(PREDICTIONS.scan).cumcount()
    browser = review.scan_browser(dataclasses.replace(predict_run, slices=two, scans=None), verdicts, interactive=True)
    summary = review.verdicts_so_far(verdicts, interactive=True)  # drawn before any click, as the notebook runs it
    assert _summary_shown(summary)["cases"] == "1"
    controls = {getattr(w, "description", ""): w for box in browser.children for w in getattr(box, "children", [box])}
    first, second = controls["scan"].options[:2]

    controls["map"].value = "on the lesion"  # a click on a verdict button
    shown = _summary_shown(summary)
    assert shown["cases"] == "2" and shown["pointing"] == "50%" and shown["disputed"] == "judged last week"
    controls["label"].value = "agree"  # the same scan again: still two cases
    shown = _summary_shown(summary)
    assert shown["cases"] == "2" and shown["label_agreement"] == "50%"
    controls["scan"].value = second
    controls["map"].value = "elsewhere"
    shown = _summary_shown(summary)
    assert shown["cases"] == "3" and shown["disputed"] == f"judged last week, {second}"
    assert shown["map_verdicts"] == "on the lesion 1, near it 0, elsewhere 2, no lesion visible 0"

    written = read_verdicts(path).set_index("case")  # every verdict on disk, the earlier one as it was
    assert list(written.index) == ["judged last week", first, second]
    assert written.loc["judged last week", "note"] == 'a, "quoted" note'
    assert (written.loc[first, "map"], written.loc[first, "label"]) == ("on the lesion", "agree")
    assert review.verdicts_so_far(verdicts, interactive=False)["cases"] == 3  # headless: the summary as it stands


def test_a_verdict_click_reaches_the_csv_at_once_and_reopening_restores_it(predict_run, tmp_path):
    path = tmp_path / "verdicts.csv"
    browser = review.scan_browser(predict_run, review.Verdicts(path, "reader-1"), interactive=True)
    controls = {getattr(w, "description", ""): w for box in browser.children for w in getattr(box, "children", [box])}
    scan = controls["scan"].value
    controls["map"].value = "near it"  # a click on a verdict button
    assert pd.read_csv(path).set_index("case").loc[scan, "map"] == "near it"  # written at once
    controls["label"].value = "disagree"
    controls["note"].value = "bleed along the falx"
    reopened = review.Verdicts(path, "reader-1")
    assert reopened.get(scan)["map"] == "near it" and reopened.get(scan)["note"] == "bleed along the falx"
    again = review.scan_browser(predict_run, reopened, interactive=True)
    shown = {getattr(w, "description", ""): w for box in again.children for w in getattr(box, "children", [box])}
    assert shown["map"].value == "near it" and shown["label"].value == "disagree"  # the earlier verdict, shown
    with pytest.raises(ValueError, match="reader-1"):
        review.Verdicts(path, "reader-2")  # one reviewer per file


def test_the_notebooks_scan_cell_keeps_a_reviewer_named_like_a_path_in_the_review_folder(predict_run, tmp_path):
    """The notebook's own scan and verdicts cells, run as the kernel runs them, for the reviewer ``dr/smith``."""
    notebook = json.loads((Path(__file__).parents[2] / "notebooks" / "attention_review.ipynb").read_text())
    cells = {tag: "".join(c["source"]) for c in notebook["cells"] for tag in c["metadata"].get("tags", [])}
    shown = []
    namespace = {"review": review, "out": tmp_path / "review", "reviewer": "dr/smith", "interactive": True,
                 "predict_output": str(predict_run.folder), "window": "brain",
                 "display": lambda *x: shown.extend(x)}  # fmt: skip
    exec(cells["scans"], namespace)
    exec(cells["verdicts"], namespace)  # "Run all": the summary is drawn before the reviewer's first click
    browser, summary = shown
    assert _summary_shown(summary)["cases"] == "0"
    controls = {getattr(w, "description", ""): w for box in browser.children for w in getattr(box, "children", [box])}
    controls["map"].value = "on the lesion"
    written = review.verdicts_path(tmp_path / "review", "dr/smith")
    assert [p for p in (tmp_path / "review").rglob("*") if not p.name.startswith(".")] == [written]
    assert pd.read_csv(written)["reviewer"].tolist() == ["dr/smith"]
    assert _summary_shown(summary)["cases"] == "1" and _summary_shown(summary)["pointing"] == "100%"
    assert "dr/smith" in summary.value


def test_predict_and_the_review_write_the_schemas_columns_with_the_same_values(tiny, predict_run):
    """One pass (vit_ct.task.inference.infer) behind both: predictions.csv's header is the schema's, the review
    table's too, and every value the two share is the same to the last bit, slice by slice."""
    model, _, table = tiny
    written = pd.read_csv(predict_run.folder / PREDICTIONS.file, float_precision="round_trip")
    blocks = model.hparams.depth
    kept = [s for s in SCORES if s != "hd95_px"]  # every synthetic slice has a pixel spacing: HD95 in mm only
    sources = [s for s in SURFACE_DISTANCE_SOURCES if s != "perfect_grid"]  # that one with map_shifts > 1 only
    assert list(written.columns) == PREDICTIONS.header(
        task="binary", class_names=model.class_names, labels=True, scan=True, frame=False, mask=True, blocks=blocks,
        sources=sources, scores=kept,
    )  # fmt: skip
    scores = [PREDICTIONS.score(source, s) for source in MAP_SOURCES for s in SCORES]
    shares = [PREDICTIONS.rollout_air, PREDICTIONS.rollout_outside_head]
    assert list(table.columns) == [f.default for f in dataclasses.fields(REVIEW)] + shares + scores
    assert list(written[PREDICTIONS.image]) == list(table[REVIEW.image])
    assert np.array_equal(written[PREDICTIONS.prob].to_numpy(), table[REVIEW.prob].to_numpy())  # binary: P(lesion)
    shared = shares + [PREDICTIONS.score(source, s) for source in sources for s in kept]
    assert np.array_equal(written[shared].to_numpy(), table[shared].to_numpy(), equal_nan=True)
    for name in (PREDICTIONS.cls_prefix, PREDICTIONS.cls_air):
        columns = [PREDICTIONS.block(name, b) for b in range(blocks)]
        assert np.array_equal(written[columns].to_numpy(), np.stack(table[name].to_numpy()))
    assert written[shared].notna().any().all()  # the comparison covers scored slices, not only NaN
