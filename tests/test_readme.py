"""Every command of the README's ```bash blocks runs, on a tiny set with few steps but at the input sizes the configs
really resolve to, so that a documented command that stops working, or a chain of them whose configs and checkpoints
disagree (fit -> predict, the demo recipe on your own slices, a checkpoint's windows), fails `make test`. The blocks
are parsed from README.md and the pages it sends readers to for commands (docs/scaling.md): a new block is covered
without editing this file, and a command this file cannot run fails until it is given a runner or a listed reason to
skip.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import pytest
from conftest import ROOT, TINY_MODEL_ARGS, tiny_data_args
from npy_manifest import write_npy_manifest

from vit_ct.model import shipped

README = ROOT / "README.md"
PAGES = (README, ROOT / "docs" / "scaling.md")  # the Markdown whose ```bash blocks a reader runs
VENV = Path(sys.executable).parent.parent

# Commands not run here, each with its reason: only what needs the network, a GPU, a server of its own, or would run
# this suite itself.
SKIPPED = {
    ("make", "test"): "runs the whole test suite, this test included",
    ("make", "check"): "runs the quick tier of the test suite, which holds tests of this file",
    (".venv/bin/pytest",): "runs the test suite, this test included",
    ("torchrun",): "needs GPU nodes and a rendezvous host ($HEAD)",
    ("srun",): "needs a SLURM cluster with GPUs",
}
GPU_ONLY = "needs a GPU (--trainer.accelerator gpu)"
HUB = "needs the network: a --model.pretrained tag's weights come from the Hugging Face hub (test_pretrained.py runs"
HUB += " it offline)"

# Small data and few steps, appended to a command (later arguments win), chosen by the configs it names; never the
# input size (data.img_size), which stays what the configs and checkpoints resolve to.
TINY_MANIFEST = ["--data.init_args.batch_size", "4", "--data.init_args.num_workers", "0"]
# The README's placeholders: "a checkpoint of yours" (the newest run's last checkpoint), a DICOM archive and a NIfTI
# volume (built by user_files); replaced also inside an argument, as in `[DICOM_DIR]`.
PLACEHOLDERS = {"CKPT": "runs/latest/checkpoints/last.ckpt", "DICOM_DIR": "dicom", "VOLUME.nii.gz": "volume.nii.gz"}


class Command(NamedTuple):
    line: int  # of its page, where the command starts
    argv: list[str]
    page: str = "README.md"

    def __str__(self) -> str:
        return f"{self.page} line {self.line}: {shlex.join(self.argv)}"


def readme_blocks(text: str, page: str = "README.md") -> list[list[Command]]:
    """The commands of each ```bash block: continuation lines joined, comments dropped."""
    blocks, block, pending, start = [], None, "", 0
    for number, line in enumerate(text.splitlines(), start=1):
        if block is None:
            if line.strip() == "```bash":
                block = []
            continue
        if line.strip() == "```":
            blocks.append(block)
            block = None
            continue
        if not pending:
            start = number
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            argv = shlex.split(pending, comments=True)
            if argv:
                block.append(Command(start, argv, page))
            pending = ""
    return blocks


BLOCKS = [block for path in PAGES for block in readme_blocks(path.read_text(), str(path.relative_to(ROOT)))]


def skip_reason(command: Command) -> str | None:
    for prefix, reason in SKIPPED.items():
        if tuple(command.argv[: len(prefix)]) == prefix:
            return reason
    argv = command.argv
    if any(a == "--trainer.accelerator" and b == "gpu" for a, b in zip(argv, argv[1:], strict=False)):
        return GPU_ONLY
    tags = [b for a, b in zip(argv, argv[1:], strict=False) if a == "--model.pretrained"]
    if tags and tags[-1] not in ("null", "None") and not shipped.is_shipped(tags[-1]):  # shipped weights: offline
        return HUB
    return None


def data_classes(argv: list[str]) -> set[str]:
    """The data modules the configs a command names build (the class name of each config's `data.class_path`)."""
    import yaml

    configs = [Path(b) for a, b in zip(argv, argv[1:], strict=False) if a == "--config"]
    paths = [(yaml.safe_load((ROOT / c).read_text()) or {}).get("data", {}).get("class_path", "") for c in configs]
    return {path.rsplit(".", 1)[-1] for path in paths if path}


def tiny_args(argv: list[str], synthetic_set: Path) -> list[str]:
    classes = data_classes(argv)
    args = list(TINY_MODEL_ARGS)
    if "CTSliceDataModule" in classes:  # a manifest: small batches, no workers (the later config wins the class)
        args += TINY_MANIFEST
    elif "SyntheticCTDataModule" in classes:
        args += tiny_data_args(synthetic_set, img_size=None)
    if argv[1] == "fit":
        args += ["--trainer.max_epochs", "1"]
    if "ddp" in argv:  # one process here; DDP itself is tested on 2 CPU processes in test_distributed.py
        args += ["--trainer.devices", "1", "--trainer.strategy", "auto"]
    return args


def runnable(command: Command, synthetic_set: Path) -> list[str]:
    """The command as it runs here: this environment's executables, placeholders filled, tiny sizes appended."""
    argv = [fill_placeholders(a) for a in command.argv]
    if argv[:2] in (["vit-ct", "manifest"], ["vit-ct", "report"]):  # no model, no data module: nothing to shrink
        return [str(VENV / "bin" / "vit-ct"), *argv[1:]]
    if argv[0] == "vit-ct":
        return [str(VENV / "bin" / "vit-ct"), *argv[1:], *tiny_args(argv, synthetic_set)]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    if argv[:2] == ["make", "demo"]:
        # Never reinstall (-o: no network in tests); the demo's own commands with tiny sizes, in this folder.
        tiny = [*tiny_data_args(synthetic_set, img_size=None), *TINY_MODEL_ARGS, "--trainer.max_epochs", "1"]
        return ["make", "-f", str(ROOT / "Makefile"), "-o", f"{VENV}/.installed", f"VENV={VENV}",
                f"ARGS={shlex.join(tiny)}", *argv[1:]]  # fmt: skip
    if argv[0] == "make":
        return ["make", "-C", str(ROOT), "-o", f"{VENV}/.installed", f"VENV={VENV}", *argv[1:]]
    raise AssertionError(f"{command}: no way to run it here; give tests/test_readme.py a runner or a listed reason")


def fill_placeholders(argument: str) -> str:
    for placeholder, value in PLACEHOLDERS.items():
        argument = argument.replace(placeholder, value)
    return argument


def user_files(folder: Path, synthetic_set: Path) -> None:
    """What the README's commands expect beside them: configs/, my.csv (labelled, with the multi-label columns of
    the README's example), new.csv (unlabelled), Kaggle's RSNA layout (stage_2_train.csv, stage_2_train/), CQ500's
    (CQ500/), a DICOM archive (dicom/: two synthetic patients' series) and a NIfTI volume (volume.nii.gz: one
    patient's slices)."""
    import nibabel as nib
    import numpy as np
    from cq500_layout import write_cq500
    from rsna_files import phantom_hu, write_ct_dicom

    from vit_ct import load_ct_slice

    patients = sorted((synthetic_set.parent / "images").iterdir())[:2]
    for patient in patients:
        shutil.copytree(patient, folder / "dicom" / patient.name)
    slices = [load_ct_slice(path) for path in sorted(patients[0].glob("*.dcm"))]
    affine = np.diag([0.9, 0.9, 5.0, 1.0])  # mm per voxel, as a scanner's volume gives it
    nib.save(nib.Nifti1Image(np.stack(slices, axis=-1).astype(np.int16), affine), folder / "volume.nii.gz")

    (folder / "configs").symlink_to(ROOT / "configs")
    table = pd.read_csv(write_npy_manifest(folder / "slices", train=4, val=2, test=2))
    table["image"] = "slices/" + table["image"]
    table["mask"] = "slices/" + table["mask"]
    for name in ("epidural", "subdural", "any"):
        table[name] = table["label"]
    table.to_csv(folder / "my.csv", index=False)
    table[["image", "patient_id"]].to_csv(folder / "new.csv", index=False)

    images = folder / "stage_2_train"
    images.mkdir()
    rows = []
    for i in range(8):
        write_ct_dicom(images / f"ID_{i:04d}.dcm", phantom_hu(32, i), f"ID_patient{i % 4}")
        labels = [0, 0, 0, 0, i % 2, i % 2]  # epidural ... subdural, any
        names = ["epidural", "intraparenchymal", "intraventricular", "subarachnoid", "subdural", "any"]
        rows += [(f"ID_{i:04d}_{name}", value) for name, value in zip(names, labels, strict=True)]
    pd.DataFrame(rows, columns=["ID", "Label"]).to_csv(folder / "stage_2_train.csv", index=False)
    write_cq500(folder / "CQ500")


def test_every_readme_command_is_run_or_skipped_for_a_listed_reason(tmp_path):
    commands = [command for block in BLOCKS for command in block]
    assert len(BLOCKS) >= 5 and len(commands) >= 15, "the README's ```bash blocks were not found"
    weights = [c for c in commands if "--model.weights" in c.argv and "configs/manifest.yaml" in c.argv]
    assert weights, "the README's 'starting from the demo's weights' command is parsed"
    for command in commands:
        if skip_reason(command) is None:
            runnable(command, tmp_path)  # raises for a command with no runner
    assert skip_reason(Command(0, ["vit-ct", "fit", "--trainer.accelerator", "gpu"])) == GPU_ONLY
    with pytest.raises(AssertionError, match="no way to run it here"):
        runnable(Command(0, ["curl", "https://example.org"]), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "block", BLOCKS, ids=[f"block{i}-{'-'.join(b[0].argv[:2]) if b else 'empty'}" for i, b in enumerate(BLOCKS, 1)]
)
def test_readme_block_runs(block, tmp_path, synthetic_set):
    user_files(tmp_path, synthetic_set)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    env.pop("WANDB_SERVICE", None)
    ran = []
    for command in block:
        reason = skip_reason(command)
        if reason is not None:
            print(f"skipped, {reason}: {command}")
            continue
        argv = runnable(command, synthetic_set)
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        ran.append(command)
    if not ran:
        pytest.skip("every command of this block is skipped: " + "; ".join(filter(None, map(skip_reason, block))))
    shutil.rmtree(tmp_path / "runs", ignore_errors=True)


def documented_runs() -> list[Command]:
    """The README's `vit-ct fit / validate / test / predict` commands that run here."""
    runs = ("fit", "validate", "test", "predict")
    return [c for b in BLOCKS for c in b if c.argv[:1] == ["vit-ct"] and c.argv[1] in runs and not skip_reason(c)]


@pytest.mark.slow
def test_every_documented_composition_gives_the_model_the_input_its_checkpoint_expects(
    tmp_path, synthetic_set, monkeypatch
):
    """Each documented command built as `vit-ct` builds it (its configs composed, `CKPT` a demo checkpoint at the demo's
    own input size, placeholders filled) but not run: the model is built for the data's input, and where the command
    names a checkpoint (`--ckpt_path`, or a vit-ct checkpoint in `--model.weights`) the data prepares slices exactly
    as that checkpoint records, whatever the configs say."""
    from vit_ct.cli import VitCTCLI, main
    from vit_ct.data.transforms.contract import InputContract
    from vit_ct.run.checkpoint import read_checkpoint

    user_files(tmp_path, synthetic_set)
    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", "configs/demo.yaml", *tiny_data_args(synthetic_set, img_size=None), *TINY_MODEL_ARGS,
          "--trainer.max_epochs", "1", "--test_after_fit", "false"])  # fmt: skip
    demo = InputContract.from_checkpoint(read_checkpoint(PLACEHOLDERS["CKPT"]))
    assert (demo.img_size, len(demo.windows)) == (192, 2)  # the demo's input, recorded in its checkpoint
    monkeypatch.setattr(VitCTCLI, "_run_subcommand", lambda self, subcommand: None)  # build, do not run
    commands = documented_runs()
    assert sum("--ckpt_path" in c.argv for c in commands) >= 3 and any("--model.weights" in c.argv for c in commands)
    for command in commands:
        argv = [fill_placeholders(a) for a in command.argv[1:]]
        cli = main([*argv, *tiny_args(command.argv, synthetic_set)[len(TINY_MODEL_ARGS) :]])
        model, data = cli.model, cli.datamodule
        assert (model.hparams.img_size, model.hparams.in_chans) == (data.img_size, data.num_channels), str(command)
        named = dict(zip(argv, argv[1:], strict=False))
        checkpoint = named.get("--ckpt_path") or named.get("--model.weights")
        if checkpoint:
            expected = InputContract.from_checkpoint(read_checkpoint(checkpoint))
            assert data.input_contract(model.hparams.patch_size) == expected, str(command)
