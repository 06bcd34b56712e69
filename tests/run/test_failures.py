"""Nothing silently wrong: predict never mixes two runs in one folder, failed runs leave nothing half-made, undefined
metrics are NaN, bad options and checkpoints are named, and errors print one clear message."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import DEMO_LEVERS, quiet_trainer
from npy_manifest import BEST_BY_VAL_AUROC, manifest_args, write_npy_manifest
from sklearn.metrics import roc_auc_score

from vit_ct import ViTClassifier
from vit_ct.cli import main
from vit_ct.files import OUTPUT_RECORD
from vit_ct.metrics import classification as metrics
from vit_ct.metrics.classification import DefinedBinaryAUROC, DefinedMulticlassAUROC, DefinedMultilabelAUROC
from vit_ct.run.checkpoint import AtomicCheckpointIO

TINY = {**DEMO_LEVERS, "embed_dim": 32, "depth": 2, "num_heads": 2, "img_size": 32, "in_chans": 1}
NO_LOGGER = ["--trainer.logger", "false"]


def _checkpoint(path: Path) -> Path:
    """A tiny model's checkpoint, as `vit-ct fit` writes it (in_chans 1: the brain window of manifest_args)."""
    torch.manual_seed(0)
    trainer = quiet_trainer()
    trainer.strategy.connect(ViTClassifier.from_hparams(**TINY))
    trainer.save_checkpoint(path)
    return path


@pytest.fixture
def data(tmp_path, monkeypatch):
    """(manifest, checkpoint) in a fresh working folder: 4 train, 3 val, 2 test slices."""
    monkeypatch.chdir(tmp_path)
    return write_npy_manifest(tmp_path / "data", train=4, val=3), _checkpoint(tmp_path / "model.ckpt")


def _predict(manifest: Path, ckpt: Path, out: Path, *extra: str) -> None:
    main(["predict", *manifest_args(manifest), *NO_LOGGER, "--ckpt_path", str(ckpt), "--output_dir", str(out), *extra])


def _files(folder: Path) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


@pytest.mark.medium
def test_predict_refuses_a_used_output_folder_and_overwrite_keeps_nothing_of_the_old_run(data, tmp_path):
    manifest, ckpt = data
    out = tmp_path / "out"
    _predict(manifest, ckpt, out, "--data.init_args.predict_split", "val")
    first = _files(out)
    assert len(pd.read_csv(out / "predictions.csv")) == 3

    with pytest.raises(
        ValueError, match=r"out is not empty: it holds an earlier output of vit-ct predict.*--overwrite true"
    ):
        _predict(manifest, ckpt, out, "--data.init_args.predict_split", "test")
    assert _files(out) == first  # untouched

    # a file predict did not write (named like a rank's partial table): --overwrite refuses to delete it, OUT untouched
    stray = out / ".predictions.rank1.csv"
    stray.write_text(pd.read_csv(out / "predictions.csv").assign(index=99).to_csv())
    with pytest.raises(ValueError, match=r"out is not empty and holds 1 file\(s\) that vit-ct predict did not write"
                       r" \(\.predictions\.rank1\.csv\)"):  # fmt: skip
        _predict(manifest, ckpt, out, "--data.init_args.predict_split", "test", "--overwrite", "true")
    assert stray.is_file()
    stray.unlink()
    assert _files(out) == first
    _predict(manifest, ckpt, out, "--data.init_args.predict_split", "test", "--overwrite", "true")
    table = pd.read_csv(out / "predictions.csv")
    assert len(table) == 2 and not table["image"].duplicated().any()
    written = {"predictions.csv", "run.json", "scans.csv", "maps", "overlays", *table["rollout"], *table["overlay"],
               OUTPUT_RECORD}  # fmt: skip
    assert set(_files(out)) == written  # not one file of the first run survives beside the new ones
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no partial folder left


@pytest.mark.medium
def test_a_crash_mid_predict_leaves_the_old_outputs_whole(data, tmp_path):
    manifest, ckpt = data
    out = tmp_path / "out"
    _predict(manifest, ckpt, out, "--data.init_args.predict_split", "val")
    first = _files(out)
    crash = ["--trainer.callbacks+=probes.FailAtBatch", "--trainer.callbacks.batch", "1"]
    with pytest.raises(RuntimeError, match="probe"):
        _predict(manifest, ckpt, out, "--overwrite", "true", *crash)
    assert _files(out) == first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


@pytest.mark.medium
def test_overwrite_through_a_link_replaces_the_target_and_keeps_the_link(data, tmp_path):
    manifest, ckpt = data
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "out"
    link.symlink_to(target, target_is_directory=True)
    _predict(manifest, ckpt, link, "--data.init_args.predict_split", "val")
    _predict(manifest, ckpt, link, "--data.init_args.predict_split", "test", "--overwrite", "true")
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert len(pd.read_csv(target / "predictions.csv")) == 2


def test_overwrite_never_deletes_the_runs_own_inputs(data, tmp_path):
    manifest, _ = data
    out = tmp_path / "out"
    out.mkdir()
    ckpt = _checkpoint(out / "model.ckpt")
    with pytest.raises(ValueError, match=r"--overwrite would delete .*model.ckpt"):
        _predict(manifest, ckpt, out, "--overwrite", "true")
    assert ckpt.is_file()


def test_killed_writes_leave_no_temporary_file_after_the_next_save(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = folder / f".last.ckpt.{dead.pid}.tmp"
    stale.touch()  # what a SIGKILL during a save leaves: 0 bytes
    alive = folder / f".last.ckpt.{os.getppid()}.tmp"  # another live process is writing this one
    alive.touch()
    AtomicCheckpointIO().save_checkpoint({"step": torch.tensor(1)}, folder / "last.ckpt")
    assert not stale.exists() and alive.exists() and (folder / "last.ckpt").is_file()


@pytest.mark.medium
def test_a_failed_fit_removes_its_run_folder_and_latest_never_points_at_a_run_without_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    manifest = write_npy_manifest(tmp_path / "data", train=4, val=2)
    earlier = tmp_path / "runs" / "vit-ct" / "earlier"
    earlier.mkdir(parents=True)
    (tmp_path / "runs" / "latest").symlink_to(earlier.resolve(), target_is_directory=True)
    fail = ["--trainer.callbacks+=probes.FailAtBatch"]
    with pytest.raises(RuntimeError, match="probe"):
        main(["fit", *manifest_args(manifest), *fail])  # the W&B logger: runs/vit-ct/<id>/config.yaml is written
    assert [p.name for p in (tmp_path / "runs" / "vit-ct").iterdir()] == ["earlier"]

    main(["fit", *manifest_args(manifest), "--trainer.max_epochs", "0"])  # completes, but writes no checkpoint
    assert (tmp_path / "runs" / "latest").resolve() == earlier.resolve()

    with pytest.raises(ValueError, match="missing.ckpt does not exist"):
        main(["fit", *manifest_args(manifest), "--ckpt_path", str(tmp_path / "missing.ckpt")])
    assert len(list((tmp_path / "runs" / "vit-ct").iterdir())) == 2  # earlier + the max_epochs 0 run: none new


def _fit(manifest: Path, root: Path, *extra: str) -> None:
    args = [*manifest_args(manifest), *NO_LOGGER, "--trainer.default_root_dir", str(root), "--trainer.max_epochs", "1"]
    main(["fit", *args, *extra])


def test_test_after_fit_without_validation_tests_the_last_checkpoint(tmp_path, caplog):
    manifest = write_npy_manifest(tmp_path / "data", train=4, val=2)
    with caplog.at_level(logging.INFO):
        _fit(
            manifest,
            tmp_path / "run",
            "--test_after_fit",
            "true",
            "--trainer.limit_val_batches",
            "0",
            *BEST_BY_VAL_AUROC,
        )
    assert "testing the last checkpoint" in caplog.text and "last.ckpt" in caplog.text
    assert "test/auroc" in json.loads((tmp_path / "run" / "summary.json").read_text())["metrics"]


def test_test_after_fit_without_test_rows_is_skipped_before_training(tmp_path, caplog):
    manifest = write_npy_manifest(tmp_path / "data", train=4, val=2, test=0)
    with caplog.at_level(logging.INFO):
        _fit(manifest, tmp_path / "run", "--test_after_fit", "true")
    assert "has no rows in split 'test'; fitting without the test after it" in caplog.text
    metrics = json.loads((tmp_path / "run" / "summary.json").read_text())["metrics"]
    assert "val/auroc" in metrics and not any(k.startswith("test/") for k in metrics)


def test_one_class_validation_logs_nan_auroc_and_chooses_no_best_checkpoint(tmp_path, recwarn, monkeypatch):
    monkeypatch.setitem(metrics._warned, "undefined", False)  # as in a fresh process
    manifest = write_npy_manifest(tmp_path / "data", train=4, val=1)  # the one validation slice has no bleed
    cli = main(["fit", *manifest_args(manifest), *NO_LOGGER, "--trainer.default_root_dir", str(tmp_path / "run"),
                "--trainer.max_epochs", "2", *BEST_BY_VAL_AUROC])  # fmt: skip
    assert torch.isnan(cli.trainer.callback_metrics["val/auroc"])
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints == ["last.ckpt"]  # no "best-...-aurocnan.ckpt" (before: best-epoch00-auroc0.0000.ckpt)
    assert cli.trainer.checkpoint_callback.best_model_path == ""
    messages = [str(w.message) for w in recwarn if "AUROC is undefined" in str(w.message)]
    assert len(messages) == 1  # once, though computed at every validation


def test_slice_figures_are_nan_where_the_scored_slices_do_not_define_them_and_sklearns_elsewhere():
    """Scan labels label only the slices of scans without a lesion (-1 elsewhere): sensitivity and F1 are undefined
    there (torchmetrics gave 0, printed as a measured 0), accuracy too where no slice is scored at all."""
    from sklearn.metrics import accuracy_score, f1_score, recall_score

    from vit_ct.run.summary import metric_lines

    p = torch.tensor([0.9, 0.2, 0.7, 0.4, 0.6, 0.1])
    negatives_only = torch.tensor([0, 0, -1, -1, 0, -1])  # a split labelled by scan: lesion scans' slices unknown
    figures = metrics.classification_metrics("binary", 1, "test/")
    values = {k: float(v) for k, v in figures(p, negatives_only).items()}
    assert math.isnan(values["test/sensitivity"]) and math.isnan(values["test/auroc"])
    assert values["test/specificity"] == pytest.approx(1 / 3) and values["test/accuracy"] == pytest.approx(1 / 3)
    assert values["test/f1"] == 0.0  # two slices called a lesion, none there: F1 is 0, defined
    nothing = metrics.classification_metrics("binary", 1, "test/")
    assert all(math.isnan(float(v)) for v in nothing(p, torch.full((6,), -1)).values())
    target = torch.tensor([0, 1, 1, 0, 1, 0])
    both = {k: float(v) for k, v in metrics.classification_metrics("binary", 1, "test/")(p, target).items()}
    called = (p > 0.5).long()
    assert both["test/sensitivity"] == pytest.approx(recall_score(target, called))
    assert both["test/specificity"] == pytest.approx(recall_score(1 - target, 1 - called))
    assert both["test/accuracy"] == pytest.approx(accuracy_score(target, called))
    assert both["test/f1"] == pytest.approx(f1_score(target, called))

    lines = metric_lines({**values, "test/scan_auroc": 1.0}, "test")
    assert lines[0] == "test  accuracy 0.3333  specificity 0.3333  f1 0.0000  scan_auroc 1.0000"
    assert lines[1].startswith("  undefined here (logged as NaN): auroc, sensitivity: the scored slices hold")
    assert "nan" not in " ".join(lines)


def test_auroc_is_nan_where_undefined_and_sklearn_elsewhere():
    torch.manual_seed(0)
    p = torch.rand(8)
    binary = DefinedBinaryAUROC()
    binary.update(p, torch.zeros(8, dtype=torch.long))
    assert torch.isnan(binary.compute())
    target = torch.tensor([0, 0, 1, 1, 0, 1, 0, 1])
    binary = DefinedBinaryAUROC()
    binary.update(p, target)
    assert float(binary.compute()) == pytest.approx(roc_auc_score(target, p), abs=1e-6)

    # class 2 never occurs: one-vs-rest AUROC of classes 0 and 1 only (torchmetrics counted class 2 as 0)
    probs = torch.softmax(torch.randn(8, 3), -1)
    multiclass = DefinedMulticlassAUROC(num_classes=3)
    multiclass.update(probs, target)
    expected = np.mean([roc_auc_score(target == c, probs[:, c]) for c in (0, 1)])
    assert float(multiclass.compute()) == pytest.approx(expected, abs=1e-6)

    labels = torch.stack([target, torch.ones(8, dtype=torch.long)], dim=1)  # the second label is always positive
    multilabel = DefinedMultilabelAUROC(num_labels=2)
    multilabel.update(torch.rand(8, 2), labels)
    assert float(multilabel.compute()) == pytest.approx(roc_auc_score(target, multilabel.preds[0][:, 0]), abs=1e-6)
    never = DefinedMultilabelAUROC(num_labels=2)
    never.update(torch.rand(8, 2), torch.ones(8, 2, dtype=torch.long))
    assert torch.isnan(never.compute())


def test_progress_bar_off_is_honoured(tmp_path):
    manifest = write_npy_manifest(tmp_path / "data", train=2, val=2)
    cli = main([*manifest_args(manifest), *NO_LOGGER, "--trainer.enable_progress_bar", "false"], run=False)
    assert cli.trainer.progress_bar_callback is None


@pytest.mark.parametrize("option", [["--output_dir", "out"], ["--overwrite", "true"]])
def test_predict_options_are_refused_elsewhere(tmp_path, option):
    manifest = write_npy_manifest(tmp_path / "data", train=2, val=2)
    with pytest.raises(ValueError, match=rf"{option[0]} is an option of `vit-ct predict`, not of `vit-ct fit`"):
        _fit(manifest, tmp_path / "run", *option)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("lr", [0.0, -1e-3, float("nan"), float("inf")])
def test_lr_must_be_positive_and_finite(lr):
    with pytest.raises(ValueError, match=r"model.optimisation.lr must be a finite number > 0"):
        ViTClassifier.from_hparams(**TINY, lr=lr)


@pytest.mark.medium
def test_bad_ckpt_path_is_named_with_what_was_expected(data, tmp_path):
    manifest, ckpt = data
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])  # a copy interrupted half-way
    state_dict = tmp_path / "weights.pth"
    torch.save(ViTClassifier.from_hparams(**TINY).vit.state_dict(), state_dict)  # a network's weights, not a checkpoint
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint\n")
    bare = tmp_path / "bare.ckpt"  # a state dict under Lightning's key, in a file Lightning did not write
    torch.save({"state_dict": ViTClassifier.from_hparams(**TINY).state_dict()}, bare)
    for path, expected in [(truncated, "not a torch.save archive"), (text, "not a torch.save archive"),
                           (state_dict, "holds no `state_dict`.*--model.weights"),
                           (bare, "not written by Lightning.*--model.weights")]:  # fmt: skip
        for subcommand in ("test", "fit"):
            with pytest.raises(ValueError, match=rf"checkpoint {path}.*{expected}"):
                main([subcommand, *manifest_args(manifest), *NO_LOGGER, "--ckpt_path", str(path)])


def _command(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", **env}
    environment.pop("WANDB_SILENT", None)  # what a user sees, W&B's own warnings included
    command = [str(Path(sys.executable).with_name("vit-ct")), *args]
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_an_error_prints_its_message_not_a_traceback(tmp_path):
    manifest = write_npy_manifest(tmp_path / "data", train=2, val=2)
    args = ["fit", *manifest_args(manifest), *NO_LOGGER, "--model.optimisation.lr", "0"]
    plain = _command(*args, cwd=tmp_path)
    assert plain.returncode == 1
    assert "vit-ct: error: model.optimisation.lr must be a finite number > 0" in plain.stderr
    assert "VIT_CT_DEBUG=1" in plain.stderr and "Traceback" not in plain.stderr
    for debug in (_command(*args, "--debug", cwd=tmp_path), _command(*args, cwd=tmp_path, VIT_CT_DEBUG="1")):
        assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr


@pytest.mark.slow
def test_a_run_logs_no_wandb_deprecation_noise_nor_lightnings_advertisement(tmp_path):
    manifest = write_npy_manifest(tmp_path / "data", train=2, val=2)
    args = ["fit", *manifest_args(manifest), "--trainer.max_epochs", "1"]
    run = _command(*args, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "anonymous" not in run.stdout + run.stderr
    assert "litlogger" not in run.stdout + run.stderr  # Lightning's tip to install its cloud logger, on every run
    assert list((tmp_path / "runs" / "wandb").glob("offline-run-*"))  # W&B did run


@pytest.mark.slow
@pytest.mark.ddp
def test_two_process_predict_writes_each_slice_once(data, tmp_path):
    manifest, ckpt = data
    out = tmp_path / "out"
    ddp = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    args = ["predict", *manifest_args(manifest), *NO_LOGGER, *ddp, "--ckpt_path", str(ckpt), "--output_dir", str(out)]
    run = _command(*args, "--data.init_args.predict_split", "val", cwd=tmp_path, OMP_NUM_THREADS="1")
    assert run.returncode == 0, run.stderr[-3000:]
    table = pd.read_csv(out / "predictions.csv")
    assert len(table) == 3 and not table["image"].duplicated().any()  # 3 slices on 2 ranks: one padded repeat
    written = {"predictions.csv", "run.json", "scans.csv", "maps", "overlays", *table["rollout"], *table["overlay"],
               OUTPUT_RECORD}  # fmt: skip
    assert set(_files(out)) == written
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    run = _command(*args, "--data.init_args.predict_split", "test", "--overwrite", "true", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(pd.read_csv(out / "predictions.csv")) == 2 and len(list((out / "maps").iterdir())) == 2


# --- the second probe: each case a new user hit, with the one line it now gets ---------------------------------------


def test_ckpt_path_naming_a_folder_says_which_file_to_pass(data, tmp_path):
    manifest, ckpt = data
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(ckpt.read_bytes())
    with pytest.raises(ValueError, match=rf"checkpoint {run} is a folder; .*it holds checkpoints/last.ckpt: pass that"):
        main(["test", *manifest_args(manifest), *NO_LOGGER, "--ckpt_path", str(run)])


@pytest.mark.medium
def test_an_output_folder_that_cannot_be_made_is_refused_before_any_slice_is_read(data, tmp_path, monkeypatch):
    _, ckpt = data
    missing_manifest = tmp_path / "never-read.csv"  # an error about it would mean the slices were read first
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match=r"--output_dir .*a-file/out lies under .*a-file, which is a file"):
        _predict(missing_manifest, ckpt, tmp_path / "a-file" / "out")
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    # as root (CI) every folder is writable: the check asks os.access, which is made to answer as for another user
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != readonly and real_access(p, mode))
    with pytest.raises(ValueError, match=r"--output_dir .*readonly/out: cannot write in .*readonly \(permission"):
        _predict(missing_manifest, ckpt, readonly / "out")
    assert not [p for p in tmp_path.rglob(".out.*")]


@pytest.mark.medium
def test_skipped_files_are_listed_inside_the_output_folder(data, tmp_path):
    manifest, ckpt = data
    broken = manifest.parent / "s000.npy"
    broken.write_bytes(b"not an array")
    out = tmp_path / "out"
    _predict(manifest, ckpt, out, "--data.init_args.on_bad_file", "skip")
    skipped = pd.read_csv(out / "bad_files.csv")
    assert skipped["path"].tolist() == [str(broken)] and skipped["line"].tolist() == [2]
    assert not (tmp_path / "bad_files.csv").exists()  # the working folder: where it went before
    assert len(pd.read_csv(out / "predictions.csv")) == 8


@pytest.mark.medium
def test_a_refused_rerun_still_removes_a_killed_runs_partial_folder(data, tmp_path):
    manifest, ckpt = data
    out = tmp_path / "out"
    _predict(manifest, ckpt, out, "--data.init_args.predict_split", "val")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = tmp_path / f".out.{dead.pid}-0123abcd.partial"  # what a predict killed mid-run leaves
    (leftover / "maps").mkdir(parents=True)
    with pytest.raises(ValueError, match="is not empty"):
        _predict(manifest, ckpt, out)
    assert not leftover.exists()


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [("--data.init_args.predict_split", "tset", "data.predict_split: got 'tset'; expected Literal['train', 'val',"
      " 'test']"), ("--trainer.max_epochs", "x", "trainer.max_epochs: got 'x'; expected <class 'int'>")],
)  # fmt: skip
def test_a_value_of_the_wrong_kind_ends_in_one_line_naming_the_option(data, option, value, said, capsys):
    manifest, _ = data
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *manifest_args(manifest), *NO_LOGGER, option, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"vit-ct fit: error: {said} (`vit-ct fit --help` lists the options)"]  # no usage dump


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [("--data.init_args.batch_size", "0", "data.batch_size must be a positive number of slices, got 0"),
     ("--data.init_args.num_workers", "-1", "data.num_workers must be 0 (load in the main process) or more, got -1"),
     ("--data.init_args.windows", "[brian]", "data.windows: unknown window preset 'brian'")],
)  # fmt: skip
def test_a_value_the_data_refuses_is_reported_without_the_parsers_dump(data, option, value, said, capsys):
    from vit_ct.run.console import print_error

    manifest, _ = data
    with pytest.raises(ValueError) as error:  # from Python the error is raised; the command prints it
        main(["fit", *manifest_args(manifest), *NO_LOGGER, option, value])
    assert print_error(error.value) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"vit-ct: error: {said}") and len(err) == 2  # the message, then where it was raised
    assert "Given value" not in "\n".join(err) and "slice_module.py" in err[1]


@pytest.mark.slow
def test_predict_with_a_checkpoint_prints_no_warning_a_user_cannot_act_on(data, tmp_path):
    manifest, _ = data
    # slices of known pixel size: without it, the one note on scoring in pixels is a warning a user can act on
    table = pd.read_csv(manifest)
    table["pixel_spacing_mm"] = 0.8
    table.to_csv(manifest, index=False)
    _command("fit", *manifest_args(manifest), *NO_LOGGER, "--trainer.max_epochs", "1", "--trainer.default_root_dir",
             str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    run = _command("predict", *manifest_args(manifest), *NO_LOGGER, "--ckpt_path", str(ckpt), "--output_dir",
                   str(tmp_path / "out"), cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    output = run.stdout + run.stderr
    assert "callbacks used to create the checkpoint need to be provided" not in output
    assert "LeafSpec" not in output and "Warning" not in output, output[-3000:]
