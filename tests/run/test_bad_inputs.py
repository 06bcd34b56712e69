"""Bad input a user may hand any command, each refused in one line naming the file and what was expected, or read
with what was assumed said once: a pickled checkpoint (never unpickled, torch's advice to load it anyway never
repeated), start weights of the wrong shapes or of another architecture, a file name that is not UTF-8, a report's
interval over too few patients, and scan labels other than 0/1 or a blank ``label`` beside ``scan_label``. (A
truncated NIfTI volume of a public dataset: tests/data/test_manifest_datasets_cli.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import DEMO_LEVERS
from npy_manifest import manifest_args, write_npy_manifest
from predict_outputs import fake_predict_output

from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.data.manifests.manifest import read_manifest

VIT_CT = str(Path(sys.executable).with_name("vit-ct"))
MARKER = "vit-ct-unpickled-marker"  # the file unpickling the hostile checkpoint would create
TINY = {**DEMO_LEVERS, "embed_dim": 32, "depth": 2, "num_heads": 2, "img_size": 32, "in_chans": 1}


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A command as a user runs it (W&B offline), its output and status kept."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _refusal(run: subprocess.CompletedProcess, named: str) -> str:
    """The one line in which a failed command names ``named`` (the file at fault) and says why, asserting that it
    failed, named it in that one line only and printed no traceback (its other lines: Lightning's info lines, and
    vit-ct's hint of where the error was raised and how to see its traceback)."""
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if named in line]
    assert len(lines) == 1, run.stderr[-3000:]
    return lines[0]


# --- A: start weights of another shape or architecture ---------------------------------------------------------------


def _vit_tensors(model) -> dict[str, torch.Tensor]:
    return {k.removeprefix("vit."): v.contiguous() for k, v in model.state_dict().items() if k.startswith("vit.")}


@pytest.mark.medium
def test_start_weights_of_another_architecture_are_named_in_one_line_by_the_command(tmp_path):
    from safetensors.torch import save_file

    from vit_ct import ViTClassifier

    other = ViTClassifier.from_hparams(**{**TINY, "embed_dim": 64, "depth": 3, "patch_size": 8})  # 80 tensors: none fit
    path = tmp_path / "other.safetensors"
    save_file(_vit_tensors(other), str(path))
    manifest = write_npy_manifest(tmp_path / "data", train=2, val=2)
    run = _run(VIT_CT, "validate", *manifest_args(manifest), "--trainer.logger", "false", "--model.weights",
               str(path), cwd=tmp_path)  # fmt: skip
    assert _refusal(run, str(path)) == (
        f"vit-ct: error: weights file {path} holds another architecture (embed_dim 64, depth 3, patch_size 8) than the"
        " model (embed_dim 32, depth 2, patch_size 16): first tensor that does not fit: cls_token: (1, 1, 64) in the"
        " file, (1, 1, 32) in the model; build the model as the file's (--model.network.embed_dim,"
        " --model.network.depth, --model.network.patch_size, and its --model.network.num_heads) or give weights of"
        " the model's architecture"
    )
    assert "size mismatch" not in run.stderr


def test_a_tensor_of_the_wrong_shape_is_named_instead_of_timms_reshape_error(tmp_path):
    from safetensors.torch import save_file

    from vit_ct import ViTClassifier

    tensors = _vit_tensors(ViTClassifier.from_hparams(**TINY))
    tensors["pos_embed"] = tensors["pos_embed"][0]  # (5, 32): timm's resampling failed on it, naming no file
    path = tmp_path / "flat.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(ValueError) as refused:
        ViTClassifier.from_hparams(**TINY, weights=str(path))
    assert str(refused.value) == (
        f"weights file {path}: tensor pos_embed: (5, 32) in the file, (1, 5, 32) in the model, though the file's other"
        " tensors show the model's architecture (embed_dim 32, depth 2, patch_size 16); expected a ViT state dict whose"
        " tensors have the model's shapes"
    )
    tensors = _vit_tensors(
        ViTClassifier.from_hparams(**{**TINY, "depth": 3})
    )  # one block more, every shape the model's
    save_file(tensors, str(path))
    deeper = (
        r"\(embed_dim 32, depth 3, patch_size 16\) than the model \(embed_dim 32, depth 2, patch_size 16\):"
        r" first tensor that does not fit: blocks\.2\.\S+: \([\d, ]+\) in the file, absent from the model"
    )
    with pytest.raises(ValueError, match=deeper):
        ViTClassifier.from_hparams(**TINY, weights=str(path))
    grid = _vit_tensors(
        ViTClassifier.from_hparams(**{**TINY, "img_size": 48})
    )  # another grid (3 x 3) is resampled, as before
    save_file(grid, str(path))
    assert ViTClassifier.from_hparams(**TINY, weights=str(path)).vit.pos_embed.shape == (1, 5, 32)


# --- B: a pickled checkpoint ------------------------------------------------------------------------------------------


class Hostile:
    """An object whose unpickling would create a file: the test of "never runs code from a file"."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.fixture
def pickled(tmp_path) -> Path:
    path = tmp_path / "pickled.ckpt"
    torch.save({"state_dict": {"vit.pos_embed": torch.zeros(1)}, "extra": Hostile(tmp_path / MARKER)}, path)
    return path


@pytest.mark.medium
@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-m", "vit_ct.review", "--ckpt_path", "{ckpt}", "--output_dir", "review"],
        [sys.executable, "-m", "vit_ct.review.sanity_command", "{ckpt}", "--manifest", "{manifest}", "--output_dir",
         "sanity"],
        [VIT_CT, "report", "out", "--manifest", "{manifest}", "--ckpt_path", "{ckpt}"],
        [VIT_CT, "predict", "--data.manifest", "{manifest}", "--ckpt_path", "{ckpt}", "--output_dir", "predicted"],
    ],
    ids=["review", "sanity", "report", "predict"],
)  # fmt: skip
def test_a_pickled_checkpoint_is_refused_in_one_line_and_never_unpickled(command, pickled, tmp_path):
    out, manifest = fake_predict_output(tmp_path)
    args = [a.replace("{ckpt}", str(pickled)).replace("{manifest}", str(manifest)) for a in command]
    run = _run(*args, cwd=tmp_path)
    refusal = _refusal(run, str(pickled))
    assert str(pickled) in refusal, refusal
    assert "it holds Python objects (e.g. io.open) that only unpickling would make, which can run code" in refusal
    assert "weights_only" not in run.stderr + run.stdout  # torch's advice to load it with weights_only=False
    assert not (tmp_path / MARKER).exists()  # nothing of the file ran


# --- C: file names that are not UTF-8 ---------------------------------------------------------------------------------


@pytest.mark.medium
def test_a_file_name_that_is_not_utf8_is_named_with_its_byte_escaped(synthetic_set, tmp_path):
    dicom = sorted((synthetic_set.parent / "images").rglob("*.dcm"))[:2]
    scan = tmp_path / "scan"
    scan.mkdir()
    shutil.copy(dicom[0], scan / "ok.dcm")
    shutil.copy(dicom[1], os.fsdecode(os.fsencode(scan) + b"/slice\xff.dcm"))  # a Latin-1 name: '\udcff' in Python
    for command in ([VIT_CT, "manifest", "scan", "--output", "m.csv"],
                    [VIT_CT, "predict", "--model.pretrained", "vit-ct/headct-tiny-256", "--data.init_args.scans",
                     "[scan]", "--output_dir", "predicted", "--trainer.logger", "false"]):  # fmt: skip
        run = _run(*command, cwd=tmp_path)
        assert f"{scan}/slice\\xff.dcm: a name that is not UTF-8" in _refusal(run, "slice")
        assert "codec" not in run.stderr and not (tmp_path / "m.csv").exists()
    assert not (tmp_path / "predicted" / "predictions.csv").exists()

    # A file that is no slice is skipped as before, its name escaped where it is listed
    (scan / "slice\udcff.dcm").rename(scan / "slice.dcm")
    (scan / "notes\udcff.txt").write_text("not a DICOM file")
    run = _run(VIT_CT, "manifest", "scan", "--output", "m.csv", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert f"  {scan}/notes\\xff.txt: not a DICOM file" in run.stdout
    assert pd.read_csv(tmp_path / "m.skipped.csv")["path"].tolist() == [f"{scan}/notes\\xff.txt"]

    listed = tmp_path / "latin1.csv"
    listed.write_bytes(b"image,label\nok.dcm,0\nslice\xff.dcm,1\n")
    with pytest.raises(ValueError) as refused:
        read_manifest(listed)
    assert str(refused.value).startswith(
        f"manifest {listed} is not UTF-8 text: line 3 holds byte(s) of another encoding (shown as \\x..:"
        " slice\\xff.dcm,1)"
    )


# --- E: an interval over too few patients -----------------------------------------------------------------------------


def test_a_report_on_one_patient_gives_no_interval_and_says_why(tmp_path):
    from vit_ct.cli import main
    from vit_ct.report.bootstrap import MIN_PATIENTS

    out, manifest = fake_predict_output(tmp_path, patients=1, slices=8, seed=3)  # patient P00: its split is val
    report = tmp_path / "report"
    main(["report", str(out), "--manifest", str(manifest), "--output_dir", str(report), "--bootstrap", "20"])
    figures = json.loads((report / "report.json").read_text())["slice"]
    shown = [f for f in figures.values() if isinstance(f, dict) and f.get("value") is not None]
    assert shown and all(f["ci95"] is None for f in shown)
    assert {f["ci95_undefined"] for f in shown} == {f"1 patient, at least {MIN_PATIENTS} needed"}
    page = (report / "report.html").read_text()
    assert f"interval undefined: 1 patient, at least {MIN_PATIENTS} needed" in page and "[0.333, 0.333]" not in page


# --- F: what labels other than 0/1 and a blank label beside scan_label are read as -----------------------------------


def _scan_labelled(folder: Path, header: str, rows: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(len(rows)):
        np.save(folder / f"s{i}.npy", np.full((8, 8), 35.0 + i, np.float32))  # distinct: no copies
    path = folder / "m.csv"
    path.write_text("\n".join([header, *(f"s{i}.npy,{row}" for i, row in enumerate(rows))]) + "\n")
    return path


def test_scan_labels_above_1_are_said_once_to_be_lesions_in_a_binary_run(tmp_path):
    scans = ["0,a,pa,train", "0,a,pa,train", "2,b,pb,train", "2,b,pb,train", "3,c,pc,val", "0,d,pd,val"]
    path = _scan_labelled(tmp_path, "image,scan_label,scan,patient_id,split", scans)
    data = CTSliceDataModule(manifest=str(path), windows=["brain"], img_size=8, num_workers=0, cache=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for stage in ("fit", "validate", "fit"):  # each stage checks the manifest again
            data.check(stage, num_classes=2)
    said = [str(w.message) for w in caught if "read as lesion" in str(w.message)]
    assert said == [f"manifest {path}: scan_label: values 2, 3 read as lesion (any value > 0 is a lesion in a binary"
                    " task)"]  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CTSliceDataModule(manifest=str(path), windows=["brain"], img_size=8, num_workers=0, cache=False).check(
            "fit", num_classes=4
        )  # a multi-class model's classes: nothing assumed
    assert not [w for w in caught if "read as lesion" in str(w.message)]


def test_a_report_says_a_binary_models_labels_above_1_are_lesions(tmp_path):
    from vit_ct.cli import main

    out, manifest = fake_predict_output(tmp_path)
    text = manifest.read_text().splitlines()
    text[1] = text[1].replace(".npy,1,", ".npy,2,").replace(".npy,0,", ".npy,2,")  # the first slice: label 2
    manifest.write_text("\n".join(text) + "\n")
    with pytest.warns(UserWarning, match=r"manifest\.csv: label: value 2 read as lesion \(any value > 0 is a lesion"):
        main(["report", str(out), "--manifest", str(manifest), "--output_dir", str(tmp_path / "r"), "--bootstrap", "5"])


def test_a_blank_label_beside_scan_label_says_how_the_two_combine(tmp_path):
    rows = ["0,0,a,pa", ",1,b,pb", "1,1,b,pb", ",0,c,pc"]
    path = _scan_labelled(tmp_path, "image,label,scan_label,scan,patient_id", rows)
    with pytest.raises(ValueError) as refused:
        read_manifest(path)
    assert str(refused.value) == (
        f"manifest {path}: column 'label' must hold integers >= 0; bad value on lines 3, 5; 'scan_label' is there too,"
        " but it is not read: scan labels stand in for 'label' only where the manifest has no 'label' column, never for"
        " its empty cells (fill every row's 'label', or remove the 'label' column to train from 'scan_label', one label"
        " per scan)"
    )
    with pytest.warns(UserWarning, match=r"'label' is empty on lines 3, 5, which are read as unlabelled; 'scan_label'"
                      " is there too, but scan labels stand in for 'label' only where"):  # fmt: skip
        table = read_manifest(path, require_labels=False)
    assert table["label"].isna().tolist() == [False, True, False, True] and not table.attrs.get("scan_labels")
