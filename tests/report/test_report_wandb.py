"""``vit-ct report --wandb RUN``: the report's figures, figures table and headline values land in the W&B run of a
fit's run folder, read back from W&B's own offline run file; the fit's files stay as they were; a bad RUN is named."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import wandb
from conftest import quiet_trainer
from lightning.pytorch.loggers import WandbLogger
from predict_outputs import fake_predict_output
from wandb_records import finished_records, history_and_config, summary_of

from vit_ct.cli import main
from vit_ct.run.runs import run_dir, write_summary
from vit_ct.run.wandb_runs import wandb_dir


def fit_run_folder(root: Path) -> Path:
    """``root/runs/vit-ct/<run id>/`` as ``vit-ct fit`` leaves it, made by the functions fit makes it with (its W&B
    logger offline, ``run_dir``, ``write_summary``, which links ``runs/latest``) without training: one logged value,
    a checkpoint file; W&B torn down as the fit's process ends (see :func:`end_wandb_service`). Returns
    ``runs/latest``."""
    logger = WandbLogger(save_dir=str(root / "runs"), project="vit-ct", offline=True)
    trainer = quiet_trainer(logger=logger)
    try:
        logger.log_metrics({"val/auroc": 0.75}, step=0)
        folder = run_dir(trainer)
        (folder / "checkpoints").mkdir(parents=True)
        checkpoint = folder / "checkpoints" / "last.ckpt"
        checkpoint.write_bytes(b"a checkpoint's bytes")
        summary = {"run_dir": str(folder.resolve()), "best_checkpoint": str(checkpoint),
                   "last_checkpoint": str(checkpoint), "wandb_dir": wandb_dir(trainer)}  # fmt: skip
        write_summary(trainer, summary)
    finally:
        logger.experiment.finish()
        end_wandb_service()
    return root / "runs" / "latest"


def end_wandb_service() -> None:
    """What the end of a ``vit-ct`` process does (W&B's atexit hook): wait for W&B's service process to finish writing
    its runs' files, and stop it. ``run.finish()`` returns while the service may still be writing the run's file and
    its ``logs/debug-internal.log`` (seen: a fit folder's files changing after they were snapshotted, the notebook's
    run file read before its history row was in it), and a fit's run id still open in the service when the report
    resumes it would make the two sessions depend on how quickly the service closes the first."""
    wandb.teardown()


def files_of(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Each file's bytes and time; links left out (W&B links each run's ``logs/debug-core.log`` to its service's)."""
    files = [p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()]
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


@pytest.mark.medium
def test_the_report_reaches_the_fits_wandb_run(tmp_path, capsys):
    latest = fit_run_folder(tmp_path)
    run_id = latest.resolve().name
    (fit_wandb,) = (tmp_path / "runs" / "wandb").glob(f"offline-run-*-{run_id}")
    fit_files, wandb_files = files_of(latest.resolve()), files_of(fit_wandb)
    out, manifest = fake_predict_output(tmp_path)

    notebook = wandb.init(project="notebook", dir=str(tmp_path), id="notebook1")  # a run active in this process
    try:
        main(["report", str(out), "--manifest", str(manifest), "--bootstrap", "50", "--wandb", str(latest)])
        notebook.log({"after_the_report": 1})  # still active, and not logged into: the report had its own session
    finally:
        notebook.finish()
        end_wandb_service()  # the notebook's and the report's run files complete before they are read
    assert f"W&B run {run_id}" in capsys.readouterr().out
    (notebook_file,) = (tmp_path / "wandb").glob("offline-run-*-notebook1/run-notebook1.wandb")
    (logged,), _ = history_and_config(notebook_file)
    assert not [key for key in logged if key.startswith("report/")] and logged["after_the_report"] == 1
    record = json.loads((out / "report" / "report.json").read_text())

    # One W&B run: the report's session has the fit's id (offline, a second folder of that run); the fit's files
    # (checkpoint, summary, its W&B folder) are byte for byte and time for time as they were.
    sessions = sorted((tmp_path / "runs" / "wandb").glob("offline-run-*"))
    assert [p.name.endswith(f"-{run_id}") for p in sessions] == [True, True]
    (session,) = [p for p in sessions if p != fit_wandb]
    assert files_of(latest.resolve()) == fit_files and files_of(fit_wandb) == wandb_files
    run_file = session / f"run-{run_id}.wandb"
    (run,) = [r.run for r in finished_records(run_file) if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project) == (run_id, "vit-ct")

    # the figures as images, each the PNG the report wrote
    (logged,), _ = history_and_config(run_file)
    for png in (out / "report" / "figures").glob("*.png"):
        key = f"report/{png.stem}"
        assert logged[f"{key}/_type"] == "image-file"
        assert logged[f"{key}/sha256"] == hashlib.sha256(png.read_bytes()).hexdigest()
        assert (session / "files" / logged[f"{key}/path"]).read_bytes() == png.read_bytes()
    # the figures table: every figure of report.json with its interval and count
    assert logged["report/figures/_type"] == "table-file"
    table = json.loads((session / "files" / logged["report/figures/path"]).read_text())
    assert table["columns"] == ["model", "section", "figure", "value", "ci95_low", "ci95_high", "n"]
    rows = {(model, section, figure): rest for model, section, figure, *rest in table["data"]}
    auroc = record["slice"]["auroc"]
    assert rows["vit-ct", "slice", "auroc"] == [auroc["value"], *auroc["ci95"], auroc["n"]]
    pointing = record["maps"]["rollout"]["pointing"]
    assert rows["vit-ct", "maps/rollout", "pointing"] == [pointing["value"], *pointing["ci95"], pointing["n"]]
    assert rows["vit-ct", "calibration", "ece"][0] == record["calibration"]["ece"]["value"]
    maps = {(f"maps/{source}", figure) for source, figures in record["maps"].items() for figure in figures}
    expected = {(level, figure) for level in ("slice", "scan") for figure in record[level]} | {
        ("calibration", f) for f in ("ece", "brier", "ece_after", "brier_after")} | (maps - {  # fmt: skip
        ("maps/pointing_by_lesion_size", "area"), ("maps/pointing_by_lesion_size", "edges")})  # fmt: skip
    assert {(section, figure) for _, section, figure in rows} == expected
    # the headline values in the run's summary
    summary = summary_of(run_file)
    assert summary["report/slice/auroc"] == auroc["value"]
    assert summary["report/scan/auroc"] == record["scan"]["auroc"]["value"]
    assert summary["report/maps/rollout/pointing"] == pointing["value"]


@pytest.mark.parametrize("damage", ["no_run", "no_wandb"])
def test_a_run_folder_without_a_wandb_run_is_named(tmp_path, capsys, damage):
    folder = tmp_path / "runs" / "vit-ct" / "abc123"
    folder.mkdir(parents=True)
    if damage == "no_wandb":  # a fit logged without W&B (--trainer.logger false)
        (folder / "summary.json").write_text(json.dumps({"run_dir": str(folder), "wandb_dir": None}))
    out, manifest = fake_predict_output(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(out), "--manifest", str(manifest), "--bootstrap", "20", "--wandb", str(folder)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"--wandb {folder}:" in error and "runs/latest" in error
    assert ("no summary.json" if damage == "no_run" else "not logged to W&B") in error
    assert not (out / "report").exists()  # stopped before the report
    assert not (tmp_path / "runs" / "wandb").exists()  # and before any W&B run
