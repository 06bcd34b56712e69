"""Names from outside never decide where a file goes, and ``--overwrite`` never deletes what a command did not write.

A manifest cell (``patient_id``, ``scan``), a DICOM attribute or a server's answer (a SOPInstanceUID) may hold ``/``,
``..`` or bytes that are not UTF-8: every writer makes such a name safe with one function
(:func:`vit_ct.files.safe_name`) and checks the path stays in its folder (:func:`vit_ct.files.inside`). Each command
with ``--overwrite`` replaces only a folder holding its own earlier output (its record, :func:`record_output`).
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import pandas as pd
import pytest
from conftest import DEMO, MANIFEST, TINY_MODEL_ARGS, run_vit_ct
from predict_outputs import fake_predict_output

from vit_ct.cli import main
from vit_ct.files import (
    OUTPUT_RECORD,
    check_replaceable,
    foreign_files,
    inside,
    record_output,
    replace_folder,
    safe_name,
    signals_held,
)
from vit_ct.predict.writer import overlay_caption, summary_line

HOSTILE = ["../../../X", "..", ".", "", "/etc/passwd", "a/b", "a\\b", "name with spaces", "slice\udcff", "é" * 300]


def _tree(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


@pytest.mark.parametrize("text", HOSTILE)
def test_a_safe_name_is_one_component_inside_its_folder(text, tmp_path):
    name = safe_name(text)
    assert name and "/" not in name and "\\" not in name and not name.startswith(".")
    assert len(name.encode()) < 255 and name.isascii()
    assert inside(tmp_path, name).parent == tmp_path
    (tmp_path / name).write_text("x")  # a real file name on this system


def test_safe_names_keep_plain_names_and_never_join_two_texts():
    assert safe_name("1.2.826.0.1.3680043.8.498.1") == "1.2.826.0.1.3680043.8.498.1"  # a UID as it is
    assert safe_name("patient_07") == "patient_07"
    names = [safe_name(t) for t in ["a/b", "a_b", "a\\b", "a b", "../a_b"]]
    assert len(set(names)) == len(names)  # different texts, different files
    assert safe_name("a/b") == safe_name("a/b")  # and the same text the same file, run after run


def test_inside_refuses_what_would_leave_the_folder(tmp_path):
    for escaping in ("../x", "/etc/passwd", "a/../../x"):
        with pytest.raises(ValueError, match="would be written outside"):
            inside(tmp_path, escaping)
    link = tmp_path / "link"
    link.symlink_to(tmp_path.parent)
    with pytest.raises(ValueError, match="would be written outside"):
        inside(tmp_path, "link", "x")


def test_replaceable_only_when_every_file_is_the_commands_own(tmp_path):
    out = tmp_path / "out"
    assert check_replaceable(out, "predict", overwrite=False) is False  # absent
    (out / "maps").mkdir(parents=True)
    (out / "maps" / "a.npy").write_bytes(b"1")
    record_output(out, "predict")
    with pytest.raises(ValueError, match="holds an earlier output of vit-ct predict.*--overwrite"):
        check_replaceable(out, "predict", overwrite=False)
    assert check_replaceable(out, "predict", overwrite=True) is True
    with pytest.raises(ValueError, match="did not write"):  # another command's output is not this one's
        check_replaceable(out, "report", overwrite=True)
    (out / "maps" / "verdicts.csv").write_text("a reviewer's work")  # added after the run, deep inside
    assert foreign_files(out, "predict") == ["maps/verdicts.csv"]
    with pytest.raises(ValueError, match=r"holds 1 file\(s\) that vit-ct predict did not write \(maps/verdicts.csv\)"):
        check_replaceable(out, "predict", overwrite=True)
    (out / OUTPUT_RECORD).write_text("not json")  # a damaged record proves nothing
    assert foreign_files(out, "predict") == [OUTPUT_RECORD, "maps/a.npy", "maps/verdicts.csv"]


def test_a_swap_is_not_cut_in_two_by_ctrl_c(tmp_path, ctrl_c_raises):
    old, new = tmp_path / "out", tmp_path / ".out.1-ab.partial"
    old.mkdir()
    (old / "old.txt").write_text("old")
    new.mkdir()
    (new / "new.txt").write_text("new")
    with pytest.raises(KeyboardInterrupt), signals_held():
        # SIGINT inside the block, raised once the block is done; sent to the main thread, as the kernel sends a
        # Ctrl-C (os.kill may hand it to another thread a test left running, which runs the handler too late)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        replace_folder(new, old)
    assert _tree(tmp_path) == {"out", "out/new.txt"}


@pytest.mark.slow
def test_predict_with_hostile_patient_ids_writes_only_inside_its_output(synthetic_set, tiny_checkpoint, tmp_path):  # noqa: F811
    """The scan's NIfTI volumes, views and DICOM objects of a manifest whose patient_id is ``../../../X`` (and others)
    lie inside ``--output_dir``, named safely; nothing is written anywhere else."""
    table = pd.read_csv(synthetic_set)
    patients = list(table["patient_id"].unique())
    hostile = {p: name for p, name in zip(patients, ["../../../X", "/tmp/abs", "a/b", ".."], strict=False)}
    table["patient_id"] = [hostile.get(p, p) for p in table["patient_id"]]
    table["image"] = [str((synthetic_set.parent / p).resolve()) for p in pd.read_csv(synthetic_set)["image"]]
    table = table.drop(columns=[c for c in ("mask",) if c in table])
    work = tmp_path / "a" / "b" / "c"
    work.mkdir(parents=True)
    manifest = work / "hostile.csv"
    table.to_csv(manifest, index=False)
    before = _tree(tmp_path)
    out = work / "out"
    run_vit_ct("predict", "--config", DEMO, "--config", MANIFEST, *TINY_MODEL_ARGS, "--data.init_args.img_size", "32",
            "--data.manifest", str(manifest), "--ckpt_path", str(tiny_checkpoint), "--output_dir", str(out),
            "--dicom_out", "true", cwd=work)  # fmt: skip
    outside = {p for p in _tree(tmp_path) - before if not p.startswith("a/b/c/out")}
    assert outside == set(), outside
    assert not Path("/tmp/abs").exists()
    scans = pd.read_csv(out / "scans.csv", dtype={"scan": str})
    assert set(hostile.values()) <= set(scans["scan"])  # the ids as the manifest wrote them, in the table
    for _, row in scans[scans["scan"].isin(hostile.values())].iterrows():
        for column in ("ct", "rollout", "views"):
            path = (out / row[column]).resolve()
            assert path.is_file() and path.parent == (out / "scans").resolve()
            assert Path(row[column]).name.startswith(safe_name(row["scan"]))
    predictions = pd.read_csv(out / "predictions.csv", dtype={"scan": str})
    for scan, overlay in zip(predictions["scan"], predictions["overlay"], strict=True):  # traceable to its scan
        assert Path(overlay).name.split("_", 1)[1].startswith(safe_name(scan, unique=False)[:40])
        assert (out / overlay).resolve().parent == (out / "overlays").resolve()
    objects = pd.read_csv(out / "dicom" / "objects.csv", dtype={"scan": str}).dropna(subset=["file"])
    for scan, files in objects.groupby("scan"):
        assert {Path(f).parts[1] for f in files["file"]} == {safe_name(scan)}
        assert all((out / f).resolve().is_relative_to(out.resolve()) for f in files["file"])


def _report(out: Path, manifest: Path, report: Path, *extra: str) -> None:
    main(["report", str(out), "--manifest", str(manifest), "--output_dir", str(report), "--bootstrap", "10", *extra])


@pytest.mark.medium
def test_report_never_deletes_the_predict_output_it_reads_nor_other_files(tmp_path, capsys):
    out, manifest = fake_predict_output(tmp_path)
    record_output(out, "predict")  # as predict leaves it
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    (tmp_path / "mine.txt").write_text("a user's file beside the predict output")
    for target in (out, tmp_path):  # the predict output itself, the folder above it
        for extra in ([], ["--overwrite"]):
            with pytest.raises(SystemExit) as refused:
                _report(out, manifest, target, *extra)
            assert refused.value.code == 2
            assert f"--output_dir {target}" in capsys.readouterr().err
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != "mine.txt"}
    assert after == before and (tmp_path / "mine.txt").is_file()

    elsewhere = tmp_path / "elsewhere"  # a folder of the user's: refused with or without --overwrite
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        _report(out, manifest, elsewhere, "--overwrite")
    assert "did not write (notes.txt)" in capsys.readouterr().err and (elsewhere / "notes.txt").is_file()

    report = tmp_path / "report"
    _report(out, manifest, report)
    first = json.loads((report / OUTPUT_RECORD).read_text())
    assert first["command"] == "report" and "report.json" in first["files"]
    _report(out, manifest, report, "--overwrite")  # its own earlier report: replaced whole
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".report.")]  # no staging folder left


def test_predict_ends_with_a_line_saying_what_it_wrote(tmp_path):
    out = tmp_path / "out"
    (out / "maps").mkdir(parents=True)
    pd.DataFrame({"image": ["a.dcm", "b.dcm"], "prob": [0.1, 0.9]}).to_csv(out / "predictions.csv", index=False)
    pd.DataFrame({"scan": ["s1"], "prob": [0.9]}).to_csv(out / "scans.csv", index=False)
    (out / "dicom" / "s1").mkdir(parents=True)
    (out / "dicom" / "s1" / "pm.dcm").write_bytes(b"")
    (out / "skipped.csv").write_text("path,reason\n")
    assert summary_line(out) == (
        f"vit-ct predict wrote {out}: 2 slices (predictions.csv, maps/, overlays/); 1 scan (scans.csv); 1 DICOM object"
        " (dicom/); what was left out, with the reasons: skipped.csv"
    )


def test_an_overlay_caption_names_its_case_the_model_s_reading_and_a_doubt_about_the_domain():
    binary = {"image": "PATIENT/2020/HEAD/IM0005", "prob": 0.8234, "label": 1, "scan": "1.2.840.99.7", "slice": 3,
              "outside_domain": ""}  # fmt: skip
    assert overlay_caption(binary) == ["1.2.840.99.7 / IM0005 [3]", "P(lesion) 0.823, label 1"]
    multi = {"image": "a.dcm", "prob_any": 0.9, "prob_subdural": 0.7, "prob_epidural": 0.01, "prob_sah": 0.2,
             "prob_tta_any": 0.95, "outside_domain": "BodyPartExamined is CHEST"}  # fmt: skip
    assert overlay_caption(multi) == [
        "a.dcm",
        "P(any) 0.90, P(subdural) 0.70, P(sah) 0.20",
        "not a head CT? BodyPartExamined is CHEST",
    ]
    long = overlay_caption({"image": "x" * 30 + "IM0005.dcm", "prob": 0.5, "scan": "s" * 30})[0]
    assert len(long) == 44 and long.startswith("…") and long.endswith("IM0005.dcm")  # the end tells cases apart


def test_manifest_overwrite_replaces_a_manifest_never_another_file(tmp_path, capsys):
    from vit_ct.sim.phantom import PhantomConfig
    from vit_ct.sim.synthetic import simulate_patient, write_slices

    slices = simulate_patient(7, 1, 2, PhantomConfig(size=64, pixel_spacing_mm=3.6))
    write_slices(slices, seed=7, pid="p-0001", images=tmp_path / "scan", masks=tmp_path / "masks")
    sheet = tmp_path / "my.csv"
    sheet.write_text("patient,notes\n1,a spreadsheet of the user's\n")
    with pytest.raises(SystemExit):
        main(["manifest", str(tmp_path / "scan"), "--output", str(sheet), "--overwrite"])
    assert "my.csv exists and is not a manifest" in capsys.readouterr().err
    assert sheet.read_text() == "patient,notes\n1,a spreadsheet of the user's\n"
    manifest = tmp_path / "m.csv"
    main(["manifest", str(tmp_path / "scan"), "--output", str(manifest)])
    main(["manifest", str(tmp_path / "scan"), "--output", str(manifest), "--overwrite"])  # a manifest: replaced
    assert len(pd.read_csv(manifest)) == 2
