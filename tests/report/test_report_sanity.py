"""``vit-ct report --ckpt_path``: the maps' model-randomisation sanity check (Adebayo et al. 2018) in report.json and
report.html through the real command on a tiny trained checkpoint (the image floor fails, the rollout's verdict follows
its thresholds), a bad checkpoint named; and the image floor's map scores, which predict does not write, scored by the
report against a hand-computed slice."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pandas as pd
import pytest
from npy_manifest import manifest_args, write_npy_manifest
from predict_outputs import fake_predict_output

from vit_ct.cli import main
from vit_ct.data.manifests.manifest import read_manifest
from vit_ct.report import map_sanity, report_command
from vit_ct.report.inputs import MANIFEST_ROW
from vit_ct.report.map_quality import floor_scores, map_scores

NO_LOGGER = ["--trainer.logger", "false"]
STEPS = ["trained", "head", "block 1", "block 0", "patch embedding", "position embedding"]  # a 2-block ViT's cascade


def test_help_states_the_checks_default():
    assert report_command.SANITY_SLICES == map_sanity.SANITY_SLICES


def test_the_image_floor_is_scored_on_the_slice_as_the_model_reads_it(tmp_path):
    """An 8 x 8 slice read at 8 x 8 on the brain window (0 to 80 HU -> 0 to 1): one column of air (outside the head),
    tissue at 20 HU (0.25) and a 2 x 2 lesion at 60 HU (0.75). By hand, over the 56 head pixels: the maximum is on the
    lesion (pointing 1), energy 4 x 0.75 / (4 x 0.75 + 52 x 0.25) = 3/16, mask fraction 4/56, every lesion pixel above
    every other (pixel AUROC 1), the half-maximum region (> 0.375) is the lesion (Dice 1, HD95 0 px); the head floor
    spreads its energy evenly (energy = mask fraction)."""
    hu = np.full((8, 8), 20.0, np.float32)
    hu[:, 0] = -1000.0
    mask = np.zeros((8, 8), np.uint8)
    mask[3:5, 4:6] = 1
    hu[mask > 0] = 60.0
    np.save(tmp_path / "s.npy", hu)
    np.save(tmp_path / "m.npy", mask)
    (tmp_path / "manifest.csv").write_text("image,label,patient_id,split,mask\ns.npy,1,p0,test,m.npy\n")
    manifest = read_manifest(tmp_path / "manifest.csv", require_labels=False)
    slices = pd.DataFrame({"patient": ["p0"], "rollout_pointing": [0.0], MANIFEST_ROW: [0]})
    contract = {"img_size": 8, "patch_size": 4, "in_chans": 1, "windows": [[40.0, 80.0]], "read_options": None}
    scored = floor_scores(slices, manifest, contract, tolerance_mm=5.0).iloc[0]
    assert scored["floor_image_pointing"] == 1.0
    assert scored["floor_image_energy"] == pytest.approx(3 / 16)
    assert scored["floor_image_mask_fraction"] == pytest.approx(4 / 56)
    assert scored["floor_image_pixel_auroc"] == pytest.approx(1.0)
    assert scored["floor_image_dice"] == pytest.approx(1.0) and scored["floor_image_hd95_px"] == 0.0
    assert scored["floor_head_energy"] == pytest.approx(4 / 56)
    maps = map_scores(floor_scores(slices, manifest, contract, tolerance_mm=5.0), resamples=10, seed=0)
    assert maps["floor_image"]["energy_ratio"]["value"] == pytest.approx((3 / 16) / (4 / 56))
    assert maps["floor_image"]["pointing"]["n"] == 1
    assert floor_scores(slices, manifest, None, tolerance_mm=5.0) is slices  # another model's CSV: no contract


@pytest.mark.parametrize("ckpt", [None, "missing.ckpt", "not_a_checkpoint.ckpt"])
def test_without_or_with_a_bad_checkpoint(tmp_path, capsys, ckpt):
    out, manifest = fake_predict_output(tmp_path, patients=6)
    report = tmp_path / "report"
    args = ["report", str(out), "--manifest", str(manifest), "--output_dir", str(report), "--bootstrap", "20"]
    if ckpt is None:
        main(args)
        assert json.loads((report / "report.json").read_text())["sanity"] is None
        page = (report / "report.html").read_text(encoding="utf-8")
        assert "<h2>Map sanity check</h2><p>Not run: add <code>--ckpt_path CKPT</code>" in page
        return
    (tmp_path / "not_a_checkpoint.ckpt").write_text("a text file\n")
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--ckpt_path", str(tmp_path / ckpt)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert re.search(rf"--ckpt_path.*{ckpt}", err), err
    assert not report.exists()


@pytest.fixture(scope="module")
def predicted(tmp_path_factory):
    """(manifest, checkpoint, predict output) of a one-epoch fit of a 2-block ViT at 32 x 32, predicted on every row."""
    folder = tmp_path_factory.mktemp("report_sanity")
    manifest = write_npy_manifest(folder / "data", train=4, val=2, test=6)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        main(["fit", *manifest_args(manifest), *NO_LOGGER, "--trainer.max_epochs", "1",
              "--trainer.default_root_dir", str(folder / "run")])  # fmt: skip
        ckpt = folder / "run" / "checkpoints" / "last.ckpt"
        main(["predict", *manifest_args(manifest), *NO_LOGGER, "--ckpt_path", str(ckpt), "--output_dir",
              str(folder / "out")])  # fmt: skip
    return manifest, ckpt, folder / "out"


@pytest.mark.medium
def test_the_report_checks_the_maps_of_the_checkpoint(predicted, tmp_path):  # ~12 s with the fit and predict
    manifest, ckpt, out = predicted
    report = tmp_path / "report"
    main(["report", str(out), "--manifest", str(manifest), "--output_dir", str(report), "--bootstrap", "20",
          "--ckpt_path", str(ckpt), "--sanity_slices", "4"])  # fmt: skip
    record = json.loads((report / "report.json").read_text())
    assert {"slice", "scan", "maps", "calibration", "subgroups", "worst_cases", "rows", "settings"} <= set(record)
    sanity = record["sanity"]
    assert (sanity["split"], sanity["slices"], sanity["ckpt_path"]) == ("test", 4, str(ckpt.resolve()))
    assert "attention rollout in one pass" in sanity["checked"]
    floor, rollout = sanity["methods"]["floor: image"], sanity["methods"]["attention rollout"]
    for check in (floor, rollout):
        assert [s["step"] for s in check["steps"]] == STEPS and check["slices"] == 4
        assert check["criteria"] == {"spearman_mean_below": 0.5, "moved_at_least": 0.5}
    # the image reads no weight: every step keeps its ranking and its maxima, so it fails
    assert floor["verdict"] == "FAIL" and floor["first_changed"] is None
    assert all(s["spearman_mean"] == 1.0 and s["moved"] == 0.0 for s in floor["steps"])
    # the tiny model's rollout: whatever it gives, as its thresholds say
    last, criteria = rollout["steps"][-1], rollout["criteria"]
    passes = last["spearman_mean"] < criteria["spearman_mean_below"] and last["moved"] >= criteria["moved_at_least"]
    assert rollout["verdict"] == ("PASS" if passes else "FAIL")
    assert rollout["steps"][0]["spearman_mean"] == 1.0 and rollout["steps"][0]["moved"] == 0.0

    page = (report / "report.html").read_text(encoding="utf-8")
    assert "<h2>Map sanity check</h2>" in page and ("<b>PASS</b>" in page) == passes
    for file in ("sanity_rollout.png", "sanity_image.png"):
        png = (report / "figures" / file).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and base64.b64encode(png).decode() in page
    # predict writes no floor scores: the report scores the image floor on the same slices as the rollout
    predictions = pd.read_csv(out / "predictions.csv")
    assert "floor_image_pointing" not in predictions
    maps = record["maps"]
    assert maps["floor_image"]["pointing"]["n"] == maps["rollout"]["pointing"]["n"] > 0
    assert maps["floor_image"]["hd95_px"]["n"] == maps["rollout"]["pointing"]["n"]
