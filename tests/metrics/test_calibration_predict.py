"""``vit-ct predict --calibration FILE``: the temperature ``vit-ct report`` fitted, applied to P(lesion) as
``prob_calibrated`` beside the model's ``prob``, against the hand-computed formula; bad files named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import TINY_MODEL_ARGS, run_vit_ct, tiny_data_args

from vit_ct.metrics.temperature import read_temperature, scale

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")


def test_scaling_by_hand():
    # logit(0.8) = ln 4; / 2 = ln 2; sigmoid(ln 2) = 2 / 3. T = 1 leaves P as it is; the order never changes.
    assert scale(np.array([0.8]), 2.0)[0] == pytest.approx(2 / 3, abs=1e-12)
    prob = np.array([0.01, 0.3, 0.5, 0.9, 0.999])
    np.testing.assert_allclose(scale(prob, 1.0), prob, atol=1e-12)
    assert (np.diff(scale(prob, 0.5)) > 0).all() and scale(np.array([0.5]), 3.0)[0] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "does not exist"),
        ("not json", "is not a JSON object"),
        ('{"t": 1}', "holds no number `temperature`"),
        ('{"temperature": "2"}', "holds no number `temperature`"),
        ('{"temperature": -1.5}', "is not positive"),
        ("[1, 2]", "is not a JSON object"),
    ],
)
def test_a_bad_calibration_file_is_named(tmp_path, content, expected):
    path = tmp_path / "calibration.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=expected) as error:
        read_temperature(path)
    assert str(path) in str(error.value)


@pytest.mark.slow
def test_predict_applies_the_reports_temperature(synthetic_set, tmp_path):
    common = ["--config", DEMO, *tiny_data_args(synthetic_set), *TINY_MODEL_ARGS, "--trainer.precision", "32-true"]
    run_vit_ct("fit", *common, "--trainer.max_epochs", "1", "--test_after_fit", "false", cwd=tmp_path)
    ckpt = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())["last_checkpoint"]
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"temperature": 2.5}))
    predict = ["predict", *common, "--ckpt_path", ckpt, "--data.init_args.predict_split", "test"]
    run_vit_ct(*predict, "--output_dir", str(tmp_path / "out"), "--calibration", str(calibration), cwd=tmp_path)
    table = pd.read_csv(tmp_path / "out" / "predictions.csv")
    assert list(table.columns[:3]) == ["image", "prob", "prob_calibrated"]
    expected = 1 / (1 + ((1 - table["prob"]) / table["prob"]) ** (1 / 2.5))  # sigmoid(logit(p) / T), by hand
    np.testing.assert_allclose(table["prob_calibrated"], expected, rtol=1e-6)
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["calibration"] == {"file": str(calibration.resolve()), "temperature": 2.5}

    # without the option: no column, run.json says so; a bad file stops predict before it reads a slice
    run_vit_ct(*predict, "--output_dir", str(tmp_path / "plain"), cwd=tmp_path)
    assert "prob_calibrated" not in pd.read_csv(tmp_path / "plain" / "predictions.csv").columns
    assert json.loads((tmp_path / "plain" / "run.json").read_text())["calibration"] is None
    calibration.write_text('{"temperature": 0}')
    env = {**os.environ, "WANDB_MODE": "offline"}
    vit_ct = str(Path(sys.executable).with_name("vit-ct"))
    bad = subprocess.run([vit_ct, *predict, "--output_dir", str(tmp_path / "bad"), "--calibration", str(calibration)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert bad.returncode != 0 and f"--calibration {calibration}" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "bad").exists()
