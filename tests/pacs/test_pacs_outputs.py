"""What ``vit-ct pacs`` writes, against a real Orthanc (benchmarks/orthanc.py): a server's SOPInstanceUID never decides
where a retrieved file goes, ``--overwrite`` keeps an earlier run until the new one has stored something, and Ctrl-C
while storing leaves the record of every file."""

from __future__ import annotations

import http.server
import signal
import threading
from pathlib import Path

import pydicom
import pytest
from conftest import free_port
from orthanc_servers import needs_orthanc, write_study

from vit_ct.cli import main
from vit_ct.files import OUTPUT_RECORD, record_output, safe_name
from vit_ct.pacs.connection import Server
from vit_ct.pacs.retrieval import find_ct_series, retrieve_ct
from vit_ct.pacs.storage import StoreInterrupted, store_files


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@needs_orthanc
def test_a_hostile_sop_instance_uid_is_retrieved_inside_the_output(orthanc, tmp_path):  # noqa: F811
    files = write_study(tmp_path / "study", "pacs-0011")
    hostile = pydicom.dcmread(files[0])
    hostile.SOPInstanceUID = "../../../../../../X"
    hostile.file_meta.MediaStorageSOPInstanceUID = hostile.SOPInstanceUID
    hostile.save_as(files[0])
    server = Server(orthanc)
    assert len(store_files(server, files).stored) == len(files)  # the server takes it as it is
    study = hostile.StudyInstanceUID

    out = tmp_path / "a" / "b" / "c" / "d" / "e" / "f" / "out"
    before = {p for p in tmp_path.rglob("*")}
    retrieved = retrieve_ct(server, study, find_ct_series(server, study), out / "source")
    written = {p for p in tmp_path.rglob("*")} - before - set(out.parents)  # the folders up to OUT: made for it
    assert all(p.resolve().is_relative_to(out.resolve()) for p in written)  # nothing above the output folder
    (paths,) = retrieved.values()
    assert len(paths) == len(files)  # the slice is in the scan, under a safe name of its own
    assert f"{safe_name('../../../../../../X')}.dcm" in {p.name for p in paths}


@needs_orthanc
def test_a_failed_overwrite_leaves_the_earlier_run_as_it_was(orthanc, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "out"
    (out / "source" / "1.2.3").mkdir(parents=True)
    (out / "source" / "1.2.3" / "4.dcm").write_bytes(b"an earlier run's slice")
    (out / "stored.json").write_text('{"stored": 4}\n')
    record_output(out, "pacs")
    before = _tree(out)
    with pytest.raises(SystemExit) as failed:  # a study the server does not hold: nothing stored
        main(["pacs", orthanc, "--study", "1.2.3.4.5.6.7.8.9", "--output_dir", str(out), "--overwrite"])
    assert failed.value.code == 1
    err = capsys.readouterr().err
    assert "holds no study" in err and f"{out} holds the earlier run, as it was" in err
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing set aside is left beside it
    (out / "notes.txt").write_text("mine")  # a file pacs did not write: refused before the server is asked
    with pytest.raises(SystemExit):
        main(["pacs", orthanc, "--study", "1.2.3", "--output_dir", str(out), "--overwrite"])
    assert "did not write (notes.txt)" in capsys.readouterr().err and (out / "notes.txt").is_file()
    assert OUTPUT_RECORD in _tree(out)


class _SlowStow(http.server.BaseHTTPRequestHandler):
    """Reads a STOW-RS request, then answers nothing for a while (a PACS busy storing)."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.posted.set()
        self.server.release.wait(10)  # bounded: the test releases it

    def log_message(self, *args):
        pass


def test_ctrl_c_while_storing_reports_every_file(tmp_path, ctrl_c_raises):
    files = write_study(tmp_path / "study", "pacs-0012", n_slices=3)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _SlowStow)
    server.posted, server.release = threading.Event(), threading.Event()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    main_thread = threading.main_thread().ident  # Ctrl-C reaches the main thread, blocked in the request
    timer = threading.Thread(target=lambda: server.posted.wait(10) and signal.pthread_kill(main_thread, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(StoreInterrupted) as interrupted:
            store_files(Server(f"http://127.0.0.1:{server.server_port}/dicom-web", attempts=1), files, batch_bytes=1)
    finally:
        server.release.set()
        server.shutdown()
        timer.join()
    report = interrupted.value.report
    assert [f.path for f in report.files] == [str(p) for p in files]  # every file, in order
    first, *later = report.files
    assert not first.stored and "may be stored there or not" in first.reason
    assert first.sop_instance_uid == pydicom.dcmread(files[0]).SOPInstanceUID
    assert all("not sent: interrupted" in f.reason for f in later)
    record = report.write(tmp_path / "stored.json", interrupted=True)
    assert record.is_file()


@pytest.mark.medium
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_timeout_of_zero_or_less_is_refused_when_the_options_are_read(value, tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        main(["pacs", "http://127.0.0.1:9/dicom-web", "--study", "1.2.3", "--output_dir", str(tmp_path / "o"),
              "--timeout", value])  # fmt: skip
    assert refused.value.code == 2 and "expected a number of seconds above 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@needs_orthanc
@pytest.mark.parametrize(("group", "signum"), [(True, signal.SIGINT), (False, signal.SIGTERM)],
                         ids=["Ctrl-C (SIGINT to the process group)", "kill PID"])  # fmt: skip
def test_a_signal_during_predict_ends_pacs_in_one_line_with_nothing_stored(orthanc, tmp_path, group, signum):  # noqa: F811
    """``vit-ct pacs`` interrupted while its predict runs: predict's own line, then one of pacs', no traceback, the exit
    status of the signal, and nothing stored at the server."""
    from conftest import tiny_checkpoint_file
    from signalled import PAUSE, signal_when_ready, start_vit_ct

    files = write_study(tmp_path / "study", f"pacs-00{20 + int(group)}", n_slices=3)
    study = pydicom.dcmread(files[0]).StudyInstanceUID
    server = Server(orthanc)
    assert len(store_files(server, files).stored) == 3
    tiny_checkpoint_file(tmp_path / "tiny.ckpt")
    root = Path(__file__).resolve().parents[2]
    out, ready = tmp_path / "out", tmp_path / "ready"
    args = ["pacs", orthanc, "--study", study, "--ckpt_path", str(tmp_path / "tiny.ckpt"), "--config",
            str(root / "configs" / "demo.yaml"), "--config", str(root / "configs" / "manifest.yaml"), "--output_dir",
            str(out), "--model.network.embed_dim", "32", "--model.network.depth", "2", "--model.network.num_heads", "2",
            "--data.init_args.img_size", "32", "--data.init_args.windows", "[brain]", "--data.init_args.num_workers",
            "0", "--data.init_args.batch_size", "1", "--trainer.logger", "false", *PAUSE]  # fmt: skip
    status, output = signal_when_ready(start_vit_ct(args, tmp_path, ready=ready), ready, group=group, signum=signum)
    assert status == 128 + signum, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert f"vit-ct: interrupted ({name})" in output  # predict's own line
    assert output.rstrip().splitlines()[-1].startswith("vit-ct pacs: interrupted; nothing was stored")
    assert not (out / "stored.json").exists()
    series = find_ct_series(server, study)
    assert [s.instances for s in series] == [3]  # no object of this run reached the study
