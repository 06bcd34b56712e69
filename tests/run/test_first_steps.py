"""A new user's first steps: the notebook command `make demo` prints starts, `--trainer.default_root_dir` moves the
run, and a run whose output goes to a file shows a line per epoch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_MODEL_ARGS, tiny_data_args

from vit_ct.cli import main
from vit_ct.run.summary import report

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs" / "demo.yaml")


@pytest.mark.medium
def test_the_notebook_command_make_demo_prints_starts():
    line = next(line for line in report("outputs/demo", {}).splitlines() if "jupyter lab" in line)
    command = line.split("review the maps")[1].split()
    assert command[0] == ".venv/bin/jupyter" and command[1] == "lab" and (ROOT / command[2]).is_file()
    # the Makefile installs the extra that declares jupyterlab
    installed = re.search(r'pip install --quiet -e "\.\[([a-z,]+)\]"', (ROOT / "Makefile").read_text()).group(1)
    extras = re.findall(r"^(\w+) = \[\n(.*?)^\]", (ROOT / "pyproject.toml").read_text(), flags=re.M | re.S)
    assert any('"jupyterlab' in deps for name, deps in extras if name in installed.split(","))
    # the exact command, from this environment's bin folder (`.venv/bin` under `make`), asked for its version
    jupyter = Path(sys.executable).with_name("jupyter")
    result = subprocess.run([str(jupyter), *command[1:], "--version"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", result.stdout.strip())


@pytest.mark.medium
def test_default_root_dir_places_the_run_and_epochs_are_printed_without_a_terminal(
    synthetic_set, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    main(["fit", "--config", DEMO, *tiny_data_args(synthetic_set), *TINY_MODEL_ARGS, "--trainer.max_epochs", "2",
          "--test_after_fit", "false", "--trainer.default_root_dir", str(elsewhere)])  # fmt: skip
    assert not (tmp_path / "runs").exists(), sorted(map(str, (tmp_path / "runs").rglob("*")))
    latest = elsewhere / "latest"
    assert latest.is_symlink() and (latest / "checkpoints" / "last.ckpt").is_file()
    assert latest.resolve().parent == elsewhere / "vit-ct"
    assert any(p.name.startswith("offline-run-") for p in (elsewhere / "wandb").iterdir())

    out = capsys.readouterr().out  # not a terminal: one line per epoch
    lines = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"]
    for line in lines:
        assert re.search(r"train/loss \d+\.\d{4}  val/loss \d+\.\d{4}  val/auroc \d+\.\d{4}.*  \d+\.\d s$", line), line


@pytest.mark.parametrize("given", ["save_dir", "dir"])
def test_an_explicit_logger_folder_wins_over_default_root_dir(tmp_path, given):
    cli = main(["--config", DEMO, "--trainer.default_root_dir", str(tmp_path / "root"),
                f"--trainer.logger.init_args.{given}", str(tmp_path / "mine")], run=False)  # fmt: skip
    assert cli.trainer.logger.save_dir == str(tmp_path / "mine")
