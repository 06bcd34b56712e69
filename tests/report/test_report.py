"""``vit-ct report``: each figure against a hand-computed or scikit-learn reference, the bootstrap over patients on
its own resamples, the report of a predict output beside a made-up CNN's, and bad input named."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TINY_MODEL_ARGS, tiny_data_args
from npy_manifest import DEMO
from predict_outputs import fake_predict_output
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve
from torchmetrics.classification import BinaryCalibrationError

from vit_ct.cli import main
from vit_ct.report import bootstrap as bootstrap_module
from vit_ct.report import report_command
from vit_ct.report.bootstrap import patient_bootstrap, replicate
from vit_ct.report.calibration import calibration_scores, fit_temperature, reliability, scale
from vit_ct.report.decision import THRESHOLDS, net_benefit, treat_all
from vit_ct.report.detection import detection_scores
from vit_ct.report.subgroups import MIN_CASES, subgroup

# A tiny table: 4 positives, 6 negatives, one tie across the classes (0.6)
PROB = np.array([0.9, 0.6, 0.4, 0.2, 0.7, 0.6, 0.3, 0.2, 0.1, 0.05])
LABEL = np.array([1, 1, 1, 1, 0, 0, 0, 0, 0, 0], dtype=bool)


def test_detection_figures_equal_scikit_learn_and_the_hand_count():
    scores = detection_scores(PROB, LABEL)
    assert scores["auroc"] == pytest.approx(roc_auc_score(LABEL, PROB))
    # by hand, of the 4 x 6 pairs: 0.9 beats all 6 negatives, 0.6 beats 4 and ties 1, 0.4 beats 4, 0.2 beats 2, ties 1
    assert scores["auroc"] == pytest.approx((6 + 4.5 + 4 + 2.5) / 24)
    assert scores["average_precision"] == pytest.approx(average_precision_score(LABEL, PROB), abs=1e-6)
    assert scores["sensitivity"] == 0.5 and scores["specificity"] == pytest.approx(4 / 6)  # called: P > 0.5
    # 90% specificity allows no false positive of 6 (1/6 = 17% of them): the ROC points with fpr 0 reach tpr 1/4
    fpr, tpr, thresholds = roc_curve(LABEL, PROB)
    allowed = fpr <= 0.1
    assert scores["sensitivity_at_spec90"] == pytest.approx(tpr[allowed].max()) == 0.25
    assert scores["specificity_at_spec90"] == 1.0 and scores["threshold_at_spec90"] == pytest.approx(0.9)
    # 95%: the same point
    assert scores["sensitivity_at_spec95"] == 0.25


def test_operating_point_at_a_reachable_specificity():
    prob = np.linspace(0, 1, 21)
    label = prob > 0.45  # separable but for nothing: every negative below every positive
    label[2] = True  # one low positive
    scores = detection_scores(prob, label)
    fpr, tpr, _ = roc_curve(label, prob)
    assert scores["sensitivity_at_spec90"] == pytest.approx(tpr[(1 - fpr) >= 0.9].max())
    assert scores["specificity_at_spec90"] >= 0.9


def test_undefined_figures_are_nan_not_an_error():
    scores = detection_scores(np.array([0.2, 0.8]), np.array([True, True]))
    assert np.isnan(scores["auroc"]) and scores["sensitivity"] == 0.5 and np.isnan(scores["specificity"])


def test_ece_equals_torchmetrics_and_the_hand_count():
    rng = np.random.default_rng(0)
    prob = np.concatenate([rng.random(300), [0.0, 1.0, 1 / 15, 2 / 15]])  # the bin edges and P = 1
    label = rng.random(len(prob)) < prob**2
    expected = BinaryCalibrationError(n_bins=15, norm="l1")(torch.from_numpy(prob), torch.from_numpy(label.astype(int)))
    assert calibration_scores(prob, label)["ece"] == pytest.approx(float(expected), abs=1e-12)
    # by hand, 2 bins: [0, 0.5) holds 0.1, 0.2 (labels 0, 1): |0.15 - 0.5| x 2/4; [0.5, 1) 0.6, 0.9 (1, 1): |0.75 - 1|
    hand = calibration_scores(np.array([0.1, 0.2, 0.6, 0.9]), np.array([0, 1, 1, 1]), bins=2)
    assert hand["ece"] == pytest.approx(0.35 * 0.5 + 0.25 * 0.5)
    assert hand["brier"] == pytest.approx((0.01 + 0.64 + 0.16 + 0.01) / 4)
    assert [b["n"] for b in reliability(np.array([0.1, 0.2, 0.6, 0.9]), np.array([0, 1, 1, 1]), bins=2)] == [2, 2]


def test_temperature_scaling_recovers_an_overconfident_models_temperature():
    rng = np.random.default_rng(1)
    z = rng.normal(0, 2, 40_000)
    label = rng.random(len(z)) < 1 / (1 + np.exp(-z))  # the truth: P = sigmoid(z)
    overconfident = 1 / (1 + np.exp(-2 * z))  # the model says sigmoid(2z): T = 2 undoes it
    temperature = fit_temperature(overconfident, label)
    assert temperature == pytest.approx(2.0, rel=0.05)
    after = calibration_scores(scale(overconfident, temperature), label)["ece"]
    assert after < calibration_scores(overconfident, label)["ece"] / 3


def test_net_benefit_equals_the_hand_count():
    """Net benefit at t = TP/n - FP/n x t/(1 - t), the cases called being those with P(lesion) >= t."""
    at = np.array([0.2, 0.5, 0.6, 0.95])
    # t = 0.2: 0.9, 0.6, 0.4, 0.2, 0.7, 0.6, 0.3, 0.2 called: TP 4, FP 4 -> 4/10 - 4/10 x 0.25
    # t = 0.5: 0.9, 0.6, 0.7, 0.6: TP 2, FP 2 -> 2/10 - 2/10 x 1; t = 0.6 the same cases (the ties at 0.6 are called)
    # t = 0.95: none called -> 0
    expected = [0.4 - 0.4 * 0.25, 0.2 - 0.2 * 1.0, 0.2 - 0.2 * 1.5, 0.0]
    np.testing.assert_allclose(net_benefit(PROB, LABEL, at), expected, atol=1e-12)
    # acting on every case: prevalence 0.4 -> 0.4 - 0.6 x t/(1 - t)
    np.testing.assert_allclose(treat_all(LABEL, at), 0.4 - 0.6 * at / (1 - at), atol=1e-12)
    # against the plain definition at every threshold of the curve
    prob, label = PROB, LABEL
    plain = [((prob >= t) & label).sum() / 10 - ((prob >= t) & ~label).sum() / 10 * t / (1 - t) for t in THRESHOLDS]
    np.testing.assert_allclose(net_benefit(PROB, LABEL), plain, atol=1e-12)


def test_a_replicate_is_the_rows_of_the_patients_it_drew():
    patients = np.array(["a", "a", "a", "b", "c", "c", "d", "e", "e", "e"])
    boot = patient_bootstrap(patients, resamples=50, seed=3)
    names = np.unique(patients)
    for r in (0, 17, 49):
        expected = np.concatenate([np.flatnonzero(patients == names[k]) for k in boot.draws[r]])
        assert sorted(boot.rows(r)) == sorted(expected)
    # one replicate recomputed by hand: the statistic of the rows drawn, duplicates counted twice
    reps = replicate(lambda rows: {"auroc": detection_scores(PROB[rows], LABEL[rows])["auroc"]}, boot)
    rows = boot.rows(17)
    expected = roc_auc_score(LABEL[rows], PROB[rows]) if LABEL[rows].any() and not LABEL[rows].all() else np.nan
    np.testing.assert_allclose(reps["auroc"][17], expected)
    assert patient_bootstrap(patients, resamples=50, seed=3).draws.tolist() == boot.draws.tolist()  # seeded


def test_patients_not_slices_are_resampled():
    """One patient with 30 slices and 10 with one each: a replicate holds that patient's 30 slices 0, 1, 2... times
    together; a bootstrap over slices would split them."""
    patients = np.array(["big"] * 30 + [f"p{i}" for i in range(10)])
    boot = patient_bootstrap(patients, resamples=200, seed=0)
    for r in range(200):
        rows = boot.rows(r)
        big = np.isin(rows, np.arange(30))
        assert big.sum() % 30 == 0
        assert np.bincount(rows[big], minlength=30)[:30].std() == 0  # every slice of it as often as the others
        assert len(rows) - big.sum() == (boot.draws[r] != 0).sum() * 1  # the others one slice a draw
    assert {len(boot.rows(r)) for r in range(200)} != {40}  # sizes vary: patients, not slices, were drawn


def test_a_perfectly_separable_set_has_the_interval_1_1():
    prob = np.array([0.1, 0.2, 0.3, 0.7, 0.8, 0.9] * 3)
    label = prob > 0.5
    patients = np.repeat([f"p{i}" for i in range(9)], 2)
    boot = patient_bootstrap(patients, resamples=300, seed=0)
    metrics, _ = bootstrap_module.estimate(
        lambda rows: {"auroc": detection_scores(prob[rows], label[rows])["auroc"]}, boot, {"auroc": len(prob)}
    )
    assert metrics["auroc"] == {"value": 1.0, "ci95": [1.0, 1.0], "n": 18}


def test_an_interval_against_its_replicates_percentiles():
    rng = np.random.default_rng(0)
    prob, label = rng.random(60), rng.random(60) < 0.5
    patients = np.repeat(np.arange(20), 3).astype(str)
    boot = patient_bootstrap(patients, resamples=400, seed=1)
    statistic = lambda rows: {"brier": calibration_scores(prob[rows], label[rows])["brier"]}  # noqa: E731
    metrics, reps = bootstrap_module.estimate(statistic, boot, {"brier": 60})
    values = sorted(calibration_scores(prob[boot.rows(r)], label[boot.rows(r)])["brier"] for r in range(400))
    assert metrics["brier"]["ci95"] == pytest.approx([np.percentile(values, 2.5), np.percentile(values, 97.5)])
    assert metrics["brier"]["ci95"][0] < metrics["brier"]["value"] < metrics["brier"]["ci95"][1]


def test_a_small_subgroup_shows_its_count_and_no_verdict():
    table = pd.DataFrame({"p_lesion": PROB, "positive": LABEL, "patient": [f"p{i}" for i in range(10)]})
    entry = subgroup(table, {"auroc": {"value": 0.9, "ci95": [0.8, 1.0], "n": 100}}, resamples=20, seed=0)
    assert len(table) < MIN_CASES
    assert entry == {"n": 10, "positives": 4, "patients": 10, "verdict": None}


def test_a_subgroups_verdict_compares_its_interval_with_the_overall_figure():
    rng = np.random.default_rng(0)
    table = pd.DataFrame({"p_lesion": rng.random(40), "positive": np.arange(40) % 2 == 1,
                          "patient": np.repeat([f"p{i}" for i in range(20)], 2)})  # fmt: skip
    figures = lambda auroc: {"auroc": {"value": auroc, "ci95": None, "n": 400}}  # noqa: E731
    entry = subgroup(table, figures(0.99), resamples=200, seed=0)  # chance here, 0.99 overall
    assert entry["n"] == 40 and entry["auroc"]["ci95"][1] < 0.99 and entry["verdict"] == "lower"
    assert subgroup(table, figures(entry["auroc"]["value"]), resamples=200, seed=0)["verdict"] == "no difference shown"
    negatives = table[~table["positive"]].head(20)  # no positive: judged by its specificity
    overall = {"specificity": {"value": 0.9, "ci95": None, "n": 400}}
    judged = subgroup(negatives, overall, resamples=200, seed=0)
    assert judged["specificity"]["ci95"][1] < 0.9 and judged["verdict"] == "lower"


def test_help_states_the_bootstraps_defaults():
    assert (report_command.RESAMPLES, report_command.SEED) == (bootstrap_module.RESAMPLES, bootstrap_module.SEED)


def test_report_help_answers_without_torch():
    code = "import sys; from vit_ct.cli import main\ntry: main(['report', '--help'])\nexcept SystemExit: pass\n"
    code += "print(sorted(m for m in ('torch', 'pandas', 'matplotlib') if m in sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "--manifest" in run.stdout and run.stdout.strip().endswith("[]")


def vit_ct_command(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The installed ``vit-ct`` (this checkout's code where PYTHONPATH names it), which must succeed."""
    env = {**os.environ, "WANDB_MODE": "offline"}
    command = [str(Path(sys.executable).with_name("vit-ct")), *args]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


@pytest.mark.medium
def test_a_report_of_a_predict_output_beside_a_made_up_cnn(tmp_path):
    out, manifest = fake_predict_output(tmp_path)
    predictions = pd.read_csv(out / "predictions.csv")
    cnn = predictions[["image"]].assign(prob=np.random.default_rng(5).random(len(predictions)))
    cnn.to_csv(tmp_path / "cnn.csv", index=False)  # a user's CNN: the image and its P(lesion), nothing else
    report = tmp_path / "report"
    main(["report", str(out), "--manifest", str(manifest), "--output_dir", str(report),
          "--compare", f"my-cnn={tmp_path / 'cnn.csv'}", "--bootstrap", "200"])  # fmt: skip

    record = json.loads((report / "report.json").read_text())
    assert {"slice", "scan", "maps", "calibration", "subgroups"} <= set(record)
    test = predictions[predictions["image"].str[1:3].astype(int) >= 4]  # patients 4.. are the test split
    auroc = record["slice"]["auroc"]
    assert set(auroc) == {"value", "ci95", "n"} and auroc["n"] == len(test)
    for level in ("slice", "scan"):  # every figure in one shape
        assert all(set(figure) == {"value", "ci95", "n"} for figure in record[level].values())
    assert auroc["value"] == pytest.approx(roc_auc_score(test["label"], test["prob"]))
    assert auroc["ci95"][0] <= auroc["value"] <= auroc["ci95"][1]
    scans = test.groupby("scan").agg(prob=("prob", "max"), label=("label", "max"))
    assert record["scan"]["auroc"]["value"] == pytest.approx(roc_auc_score(scans["label"], scans["prob"]), abs=1e-6)
    assert record["scan"]["auroc"]["n"] == len(scans)
    lesion = test[test["label"] == 1]
    maps = record["maps"]["rollout"]
    assert maps["pointing"]["value"] == pytest.approx(lesion["rollout_pointing"].mean())
    ratio = lesion["rollout_energy"].mean() / lesion["rollout_mask_fraction"].mean()
    assert maps["energy_ratio"]["value"] == pytest.approx(ratio)
    assert record["maps"]["perfect_patch"]["dice"]["n"] == len(lesion)
    assert {f"q{q}" for q in range(1, 5)} & set(record["maps"]["pointing_by_lesion_size"])
    # calibration: ECE as torchmetrics; temperature fitted on the 4 validation patients, written for later use
    ece = BinaryCalibrationError(n_bins=15)(
        torch.tensor(test["prob"].to_numpy()), torch.tensor(test["label"].to_numpy())
    )
    assert record["calibration"]["ece"]["value"] == pytest.approx(float(ece), abs=1e-6)
    val = predictions[predictions["image"].str[1:3].astype(int) < 4]
    temperature = fit_temperature(val["prob"].to_numpy(), val["label"].to_numpy(bool))
    assert json.loads((report / "calibration.json").read_text()) == {"temperature": pytest.approx(temperature)}
    assert record["calibration"]["ece_after"]["n"] == len(test)
    # subgroups: the manifest's lesion_type, each level with its count; under 20 slices no verdict
    levels = record["subgroups"]["lesion_type"]
    assert set(levels) == {"none", "edh", "sdh", "iph"}
    assert sum(entry["n"] for entry in levels.values()) == len(test)
    assert all(entry["verdict"] is None for entry in levels.values() if entry["n"] < MIN_CASES)
    worst = record["worst_cases"]["false_positives"]
    assert [c["p_lesion"] for c in worst] == sorted(test.loc[(test["label"] == 0) & (test["prob"] > 0.5), "prob"],
                                                    reverse=True)[: len(worst)]  # fmt: skip
    # the decision curves, slices and scans, as the hand-checked net benefit gives them on the reported cases
    for level, cases in (("slice", test), ("scan", scans)):
        curve = record["decision_curve"][level]
        prob, label = cases["prob"].to_numpy(), cases["label"].to_numpy(bool)
        assert curve["n"] == len(cases) and curve["thresholds"] == THRESHOLDS.tolist()
        np.testing.assert_allclose(curve["model"], net_benefit(prob, label), atol=1e-12)
        np.testing.assert_allclose(curve["treat_all"], treat_all(label), atol=1e-12)
        lo, hi = (np.array(bound, float) for bound in curve["model_ci95"])
        assert np.all(lo <= np.array(curve["model"]) + 1e-12) and np.all(np.array(curve["model"]) <= hi + 1e-12)
        better = np.array(curve["model"]) > np.maximum(treat_all(label), 0)
        inside, grid = np.zeros_like(better), THRESHOLDS
        for first, last in curve["model_better"]:
            inside |= (grid >= first) & (grid <= last)
        assert np.array_equal(inside, better)
        row = next(r for r in curve["table"] if r["threshold"] == 0.2)
        assert row["model"]["value"] == pytest.approx(net_benefit(prob, label, np.array([0.2]))[0])
    # the CNN beside it, on the same slices
    mine = record["compare"]["my-cnn"]
    cnn_test = cnn.set_index("image").loc[test["image"], "prob"]
    assert mine["slice"]["auroc"]["value"] == pytest.approx(roc_auc_score(test["label"], cnn_test))
    assert mine["maps"] == {}  # no map columns: no map figures

    page = (report / "report.html").read_text(encoding="utf-8")
    assert "my-cnn" in page and "vit-ct" in page and "<h2>Decision curve</h2>" in page
    text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "DATA", page)  # the embedded PNGs
    assert not re.search(r"https?:|//|url\(|<link|<script", text)  # nothing to fetch: it opens offline
    assert set(re.findall(r'(?:src|href)="([^"]*)"', text)) == {"DATA"}
    figures = sorted(p.name for p in (report / "figures").glob("*.png"))
    assert figures == ["decision_curve.png", "pointing_by_size.png", "pr.png", "reliability.png", "roc.png"]
    for figure in figures:  # each figure embedded as it was written
        encoded = base64.b64encode((report / "figures" / figure).read_bytes()).decode()
        assert encoded in page
    overlay = base64.b64encode((out / "overlays" / f"{Path(worst[0]['image']).stem}.png").read_bytes()).decode()
    assert overlay in page  # the worst cases with their overlays

    # a second report into the same folder is refused, then replaces the first with --overwrite; OUT/report by default
    again = ["report", str(out), "--manifest", str(manifest), "--output_dir", str(report), "--bootstrap", "20"]
    with pytest.raises(SystemExit):
        main(again)
    main([*again, "--overwrite"])
    assert "compare" in json.loads((report / "report.json").read_text())
    assert json.loads((report / "report.json").read_text())["compare"] == {}


@pytest.mark.parametrize(
    ("damage", "expected"),
    [("no_folder", r"not a vit-ct predict output: it has no predictions\.csv"),
     ("no_prob", r"predictions\.csv lacks a P\(lesion\) column: expected 'prob'"),
     ("no_image", r"predictions\.csv lacks the 'image' column"),
     ("bad_prob", r"predictions\.csv: P\(lesion\) must be a number in \[0, 1\]; bad on lines \[2\]"),
     ("other_manifest", r"predictions\.csv: 2 of its 64 rows are not in manifest .*manifest\.csv"),
     ("bad_compare", r"--compare 'cnn': expected NAME=PATH")],
)  # fmt: skip
def test_bad_input_is_named(tmp_path, capsys, damage, expected):
    out, manifest = fake_predict_output(tmp_path)
    table = pd.read_csv(out / "predictions.csv")
    extra = []
    if damage == "no_folder":
        out = tmp_path / "data"
    elif damage == "no_prob":
        (out / "run.json").unlink()
        table.drop(columns="prob").to_csv(out / "predictions.csv", index=False)
    elif damage == "no_image":
        table.drop(columns="image").to_csv(out / "predictions.csv", index=False)
    elif damage == "bad_prob":
        table.assign(prob=[1.5] + list(table["prob"][1:])).to_csv(out / "predictions.csv", index=False)
    elif damage == "other_manifest":
        table.loc[[3, 9], "image"] = "elsewhere.npy"
        table.to_csv(out / "predictions.csv", index=False)
    elif damage == "bad_compare":
        extra = ["--compare", "cnn"]
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(out), "--manifest", str(manifest), "--output_dir", str(tmp_path / "r"), *extra])
    assert exit_info.value.code == 2
    assert re.search(expected, capsys.readouterr().err)
    assert not (tmp_path / "r").exists()


@pytest.mark.medium
def test_the_benchmark_times_a_report_and_writes_its_record(tmp_path):
    out, manifest = fake_predict_output(tmp_path, patients=8)
    from benchmarks import report_time

    figures = report_time.main([str(out), "--manifest", str(manifest), "--repeats", "2", "--bootstrap", "20",
                                "--summary", str(tmp_path / "none.json")], records=tmp_path / "records")  # fmt: skip
    record = json.loads((tmp_path / "records" / "report_time.json").read_text())
    assert record["figures"] == figures and figures["slices"] == 4 * 4  # patients 4..7: the test split
    assert 0 < figures["report_min_s"] < 600 and figures["test_auroc_logged"] is None
    assert len(record["notes"]["times_s"]) == 2  # repeated runs: each writes a report of its own


@pytest.mark.slow
def test_fit_predict_report_through_the_real_command(synthetic_set, tmp_path):
    """The demo's recipe, tiny: fit, predict the test split, then the report of that output through the installed
    command; its AUROC is what `vit-ct test` logged for the same slices, with the figures of a DICOM set."""
    common = ["--config", DEMO, *tiny_data_args(synthetic_set), *TINY_MODEL_ARGS, "--trainer.precision", "32-true"]
    vit_ct_command("fit", *common, "--trainer.max_epochs", "1", cwd=tmp_path)
    summary = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())
    out = tmp_path / "out"
    vit_ct_command("predict", *common, "--ckpt_path", summary["best_checkpoint"], "--data.init_args.predict_split",
                   "test", "--output_dir", str(out), cwd=tmp_path)  # fmt: skip
    run = vit_ct_command("report", str(out), "--manifest", str(synthetic_set), "--bootstrap", "100", cwd=tmp_path)
    assert "report written" in run.stdout
    record = json.loads((out / "report" / "report.json").read_text())
    predictions = pd.read_csv(out / "predictions.csv")
    assert record["rows"]["slices"] == len(predictions) and record["rows"]["split"] == "test"
    if predictions["label"].nunique() == 2:
        assert record["slice"]["auroc"]["value"] == pytest.approx(summary["metrics"]["test/auroc"], abs=1e-4)
    assert record["maps"]["rollout"]["pointing"]["n"] == int(predictions["rollout_pointing"].notna().sum())
    # the synthetic DICOM headers: one manufacturer, the kernels the simulator drew; bleed_type from the manifest
    assert set(record["subgroups"]["manufacturer"]) == {"vit-ct synthetic phantom"}
    assert "bleed_type" in record["subgroups"] and "kvp" in record["subgroups"]
    assert (out / "report" / "report.html").stat().st_size > 10_000


def test_scan_labels_alone_give_the_scan_figures(tmp_path):
    """A manifest labelled by scan (``scan_label``, no slice labels): slices of lesion-free scans are negatives, those
    of scans with a lesion unknown; the scans are reported against their scan labels."""
    out, manifest = fake_predict_output(tmp_path)
    table = pd.read_csv(manifest)
    table["scan_label"] = table.groupby("patient_id")["label"].transform("max")
    table.drop(columns="label").to_csv(manifest, index=False)
    report = tmp_path / "report"
    main(["report", str(out), "--manifest", str(manifest), "--output_dir", str(report), "--bootstrap", "50"])
    record = json.loads((report / "report.json").read_text())
    predictions = pd.read_csv(out / "predictions.csv")
    test = predictions[predictions["image"].str[1:3].astype(int) >= 4]
    scans = test.groupby("scan").agg(prob=("prob", "max"), label=("label", "max"))
    assert record["scan"]["auroc"]["value"] == pytest.approx(roc_auc_score(scans["label"], scans["prob"]), abs=1e-6)
    assert record["rows"]["scans"] == len(scans)
    negatives = test[test["scan"].isin(scans.index[scans["label"] == 0])]
    assert record["rows"]["slices"] == len(negatives) and record["slice"]["specificity"]["n"] == len(negatives)


def test_a_manifest_with_masks_beside_predictions_without_map_scores_says_to_predict_again(tmp_path):
    """Masks filled into the manifest after predict: the maps were scored (or not) when predicting, so the report
    says that, instead of 'no slice has a lesion mask'."""
    out, manifest = fake_predict_output(tmp_path)
    table = pd.read_csv(out / "predictions.csv")
    scores = [c for c in table.columns if c.startswith(("rollout_", "perfect_patch_", "perfect_grid_"))]
    table.drop(columns=scores).to_csv(out / "predictions.csv", index=False)
    report = tmp_path / "report"
    main(["report", str(out), "--manifest", str(manifest), "--output_dir", str(report), "--bootstrap", "10"])
    note = json.loads((report / "report.json").read_text())["maps"]["note"]
    masked = pd.read_csv(manifest).query("split == 'test'")["mask"].notna().sum()
    assert (
        note.startswith(f"{masked} reported slices have a lesion mask in this manifest")
        and "predict again" in note.lower()
    )
    assert "Predict again with this manifest" in (report / "report.html").read_text()


def test_identifiers_are_never_subgroups():
    from vit_ct.report.inputs import subgroup_columns

    manifest = pd.DataFrame({
        "image": [f"{i}.dcm" for i in range(8)], "label": [0, 1] * 4, "scanner": ["A", "B"] * 4,
        "study_uid": ["1.2.826.0.1.3680043.8.498." + "1" * 30, "1.2.826.0.1.3680043.8.498." + "2" * 30] * 4,
        "series_uid": ["1.2.3", "1.2.4"] * 4, "accession_id": ["x", "y"] * 4, "position_mm": [0.0, 5.0] * 4,
    })  # fmt: skip
    assert subgroup_columns(manifest) == ["scanner"]


def test_a_curve_undefined_on_one_class_says_so_instead_of_empty_axes(monkeypatch):
    import io

    import matplotlib.pyplot as plt
    from PIL import Image

    from vit_ct.report import plots
    from vit_ct.report.detection import GRID

    class Evidence:  # the two attributes curve_figure reads of a model's evidence
        name = "vit-ct"
        undefined = np.full(len(GRID), np.nan)
        curves = {"scan": {"roc": (undefined, undefined, undefined)}}
        sections = {"scan": {"auroc": {"value": None}}}

    drawn, real_subplots = [], plt.subplots

    def subplots(*args, **kwargs):  # the figure's axes, kept to read what was drawn on them
        figure, axes = real_subplots(*args, **kwargs)
        drawn.append(axes)
        return figure, axes

    monkeypatch.setattr(plots.plt, "subplots", subplots)
    png = plots.curve_figure([Evidence()], "roc")
    (ax,) = drawn[0][0]
    assert [t.get_text() for t in ax.texts] == ["undefined: the scans reported\nhold one class only"]
    assert ax.get_legend() is None and Image.open(io.BytesIO(png)).format == "PNG"


def test_an_interval_over_fewer_patients_than_needed_is_undefined_and_said(tmp_path):
    from vit_ct.report.bootstrap import MIN_PATIENTS, estimate, patient_bootstrap

    label, prob = np.array([0, 1, 0, 1, 1, 0]), np.array([0.2, 0.8, 0.4, 0.3, 0.9, 0.1])

    def auroc(rows):
        return {"auroc": roc_auc_score(label[rows], prob[rows]) if len(set(label[rows])) == 2 else np.nan}

    one, _ = estimate(auroc, patient_bootstrap(["p1"] * 6, resamples=50), {"auroc": 6})
    assert one["auroc"]["ci95"] is None and one["auroc"]["value"] == pytest.approx(roc_auc_score(label, prob))
    assert one["auroc"]["ci95_undefined"] == f"1 patient, at least {MIN_PATIENTS} needed"
    enough, _ = estimate(auroc, patient_bootstrap([f"p{i}" for i in range(6)], resamples=50), {"auroc": 6})
    assert enough["auroc"]["ci95"] is not None and "ci95_undefined" not in enough["auroc"]

    out, manifest = fake_predict_output(tmp_path)  # its validation split: 4 patients
    report = tmp_path / "report"
    main(["report", str(out), "--manifest", str(manifest), "--output_dir", str(report), "--split", "val",
          "--bootstrap", "20"])  # fmt: skip
    auroc_val = json.loads((report / "report.json").read_text())["slice"]["auroc"]
    assert auroc_val["ci95"] is None and auroc_val["ci95_undefined"] == f"4 patients, at least {MIN_PATIENTS} needed"
    assert f"[interval undefined: 4 patients, at least {MIN_PATIENTS} needed]" in (report / "report.html").read_text()
