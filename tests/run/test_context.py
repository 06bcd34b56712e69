"""A slice read with its neighbours through the commands: `fit` with ``data.context_mm`` records the context in the
checkpoint's input contract, every later command and the review read slices as it was trained, and weights of single
slices start a model with context as they read the slice itself."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd
import pydicom
import pytest
import torch
from conftest import TINY_MODEL_ARGS, tiny_data_args

from vit_ct import ViTClassifier
from vit_ct.cli import main
from vit_ct.data.transforms.contract import CHECKPOINT_KEY, InputContract
from vit_ct.inspection.loading import review_datamodule

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")
QUIET = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]
pytestmark = pytest.mark.medium


def fit(manifest, folder, *more):
    main(["fit", "--config", DEMO, *tiny_data_args(manifest), *TINY_MODEL_ARGS, *QUIET, "--trainer.max_epochs", "1",
          "--test_after_fit", "false", "--trainer.default_root_dir", str(folder), *more])  # fmt: skip
    return folder / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def with_context(synthetic_set, tmp_path_factory) -> Path:
    return fit(synthetic_set, tmp_path_factory.mktemp("context"), "--data.init_args.context_mm", "20")


def test_a_fit_with_context_records_it_and_predict_follows_it(with_context, synthetic_set, tmp_path, caplog):
    checkpoint = torch.load(with_context, weights_only=True, map_location="cpu")
    contract = InputContract.from_dict(checkpoint[CHECKPOINT_KEY])
    assert (contract.context_mm, contract.in_chans, contract.slices) == (20.0, 6, 3)
    assert checkpoint["hyper_parameters"]["context_mm"] == 20.0
    assert checkpoint["state_dict"]["vit.patch_embed.proj.0.weight"].shape[1] == 6
    with caplog.at_level(logging.INFO):  # demo.yaml reads single slices: the checkpoint's context wins, said once
        cli = main(["predict", "--config", DEMO, *tiny_data_args(synthetic_set), *QUIET, "--ckpt_path",
                    str(with_context), "--output_dir", str(tmp_path / "out"), "--dicom_out", "true"])  # fmt: skip
    said = [r.getMessage() for r in caplog.records]
    assert (
        f"input follows the checkpoint: data.context_mm: 20.0 (as {with_context} was trained; the config said None)"
        in said
    )
    assert cli.datamodule.num_channels == 6
    assert any("context 20 mm below and above: 24 slices" in line for line in said)
    predictions = pd.read_csv(tmp_path / "out" / "predictions.csv", dtype={"scan": str})
    assert len(predictions) == 24
    # the PACS objects of each scan, from maps of slices read with their neighbours: the slice's own grid and source
    objects = pd.read_csv(tmp_path / "out" / "dicom" / "objects.csv", dtype={"scan": str})
    for scan_id, rows in predictions.groupby("scan"):
        listed = objects[objects["scan"] == scan_id]
        assert sorted(listed["kind"].unique()) == ["pm", "sc", "seg", "sr"]
        assert (listed["kind"] == "sc").sum() == len(rows)
        pm = pydicom.dcmread(tmp_path / "out" / listed.loc[listed["kind"] == "pm", "file"].item())
        sources = {pydicom.dcmread(synthetic_set.parent / image).SOPInstanceUID for image in rows["image"]}
        assert (
            pm.NumberOfFrames == len(rows)
            and {
                f.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID
                for f in pm.PerFrameFunctionalGroupsSequence
            }
            == sources
        )


def test_the_reports_sanity_check_reads_slices_with_the_checkpoints_context(with_context, synthetic_set, tmp_path):
    out, report = tmp_path / "out", tmp_path / "report"
    main(["predict", "--config", DEMO, *tiny_data_args(synthetic_set), *QUIET, "--ckpt_path", str(with_context),
          "--output_dir", str(out)])  # fmt: skip
    main(["report", str(out), "--manifest", str(synthetic_set), "--output_dir", str(report), "--bootstrap", "20",
          "--ckpt_path", str(with_context), "--sanity_slices", "4"])  # fmt: skip
    sanity = json.loads((report / "report.json").read_text())["sanity"]
    rollout = sanity["methods"]["attention rollout"]
    assert sanity["slices"] == 4 and rollout["slices"] == 4 and rollout["verdict"] in ("PASS", "FAIL")
    assert rollout["steps"][0]["spearman_mean"] == 1.0  # the trained model against itself


def test_the_review_reads_slices_with_the_checkpoints_context(with_context, synthetic_set):
    model = ViTClassifier.load_from_checkpoint(with_context)
    assert model.input_contract.context_mm == 20.0
    data = review_datamodule(model, synthetic_set, split="test", batch_size=4)
    data.setup("test")
    batch = next(iter(data.test_dataloader()))
    assert data.context_mm == 20.0 and batch["image"].shape[1] == 6


def test_a_fine_tune_adds_context_to_a_checkpoint_of_single_slices(synthetic_set, tmp_path, caplog):
    alone = fit(synthetic_set, tmp_path / "alone")
    with caplog.at_level(logging.INFO):
        cli = main(["fit", "--config", DEMO, *tiny_data_args(synthetic_set), *QUIET, "--trainer.max_epochs", "0",
                    "--model.weights", str(alone), "--data.init_args.context_mm", "20",
                    "--trainer.default_root_dir", str(tmp_path / "tuned")])  # fmt: skip
    said = [r.getMessage() for r in caplog.records]
    assert (
        f"input as configured: data.context_mm: 20.0, each slice with its neighbours 20 mm below and above; the weights"
        f" {alone} read each slice alone: the model starts with their kernels on the slice's own channels, zeros on"
        " the neighbours'"
    ) in said
    assert cli.model.input_contract.context_mm == 20.0 and cli.model.hparams.in_chans == 6
    start = torch.load(alone, weights_only=True, map_location="cpu")["state_dict"]["vit.patch_embed.proj.0.weight"]
    kernels = cli.model.vit.patch_embed.proj[0].weight.detach()
    torch.testing.assert_close(kernels[:, :2], start)
    assert not kernels[:, 2:].any()

    caplog.clear()  # the other start rule, as a config says it
    with caplog.at_level(logging.INFO):
        cli = main(["fit", "--config", DEMO, *tiny_data_args(synthetic_set), *QUIET, "--trainer.max_epochs", "0",
                    "--model.weights", str(alone), "--data.init_args.context_mm", "20",
                    "--model.network.neighbour_start", "inflated",
                    "--trainer.default_root_dir", str(tmp_path / "inflated")])  # fmt: skip
    said = [r.getMessage() for r in caplog.records]
    assert any(line.endswith("the model starts with their kernels spread over the slice and its neighbours, a third"
                             " on each (neighbour_start: inflated)") for line in said), said  # fmt: skip
    kernels = cli.model.vit.patch_embed.proj[0].weight.detach()
    for k in range(3):
        torch.testing.assert_close(kernels[:, 2 * k : 2 * k + 2], start / 3)
