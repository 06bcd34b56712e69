"""The PACS commands at the edges of DICOMweb: a QIDO-RS search ends, in a named error naming the URL, against a
server that never would let dicomweb-client's paging end (Orthanc's REST root given instead of its DICOMweb root, a
server that ignores ``offset``, one with more series than a study holds, one that pages slowly without end: the
``--timeout`` deadline); and a URL with ``user:password@`` is refused with the password masked, shown nowhere (not in
the output, not in a file) since credentials come from the environment only. The servers here are
benchmarks/orthanc.py's real Orthanc and tiny stdlib ``http.server`` ones on loopback ports, each serving a bounded
number of requests."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pydicom
import pytest
from conftest import free_port
from orthanc_servers import needs_orthanc, require_orthanc, write_study

from benchmarks.orthanc import running_orthanc
from vit_ct.pacs import retrieval
from vit_ct.pacs.connection import (
    DeadlinePassed,
    NotDicomWeb,
    OffsetIgnored,
    Server,
    TooManyResults,
    masked_url,
)
from vit_ct.pacs.retrieval import find_ct_series
from vit_ct.pacs.storage import store_files

STUDY = "1.2.826.0.1.3680043.8.498.1"
SECRET = "S3cret-pw"


@pytest.fixture(scope="module")
def orthanc_root(tmp_path_factory):
    """A real Orthanc holding one study: (its root URL, the REST API's, without ``/dicom-web``; the study's UID)."""
    require_orthanc()
    folder = tmp_path_factory.mktemp("orthanc-root")
    with running_orthanc(folder / "orthanc") as url:
        files = write_study(folder / "study", "pacs-0101", n_slices=1)
        assert store_files(Server(url), files).files[0].stored
        yield url.removesuffix("/dicom-web"), pydicom.dcmread(files[0]).StudyInstanceUID


def run_pacs(url: str, study: str, out: Path, *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real ``vit-ct pacs`` in a subprocess, stopped after 60 s at most."""
    command = [sys.executable, "-m", "vit_ct", "pacs", url, "--study", study, "--output_dir", str(out), "--ckpt_path",
               str(out.parent / "whatever.ckpt")]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=out.parent, env=env)


@needs_orthanc
def test_orthancs_root_instead_of_its_dicomweb_root_is_named_at_once(orthanc_root):
    """Orthanc's REST API answers ``/studies`` with its own ids whatever ``offset`` says: get_remaining never ended."""
    root, study = orthanc_root
    start = time.monotonic()
    with pytest.raises(NotDicomWeb, match=rf"{root} answered study {study} \(QIDO-RS\) with '[0-9a-f-]+', which is not"
                       rf" a DICOM JSON result .* for Orthanc that is {root}/dicom-web"):  # fmt: skip
        find_ct_series(Server(root), study)
    assert time.monotonic() - start < 5


@needs_orthanc
def test_the_command_given_orthancs_root_exits_at_once_with_one_line(orthanc_root, tmp_path):
    root, study = orthanc_root
    start = time.monotonic()
    run = run_pacs(root, study, tmp_path / "out")
    assert time.monotonic() - start < 30
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    [line] = run.stderr.strip().splitlines()
    assert line.startswith(f"vit-ct pacs: {root} answered study {study} (QIDO-RS) with '")
    assert line.endswith(f"for Orthanc that is {root}/dicom-web)")


def study_json(uid: str) -> dict:
    return {"0020000D": {"vr": "UI", "Value": [uid]}}


def series_json(uid: str) -> dict:
    return {"0020000E": {"vr": "UI", "Value": [uid]}, "00080060": {"vr": "CS", "Value": ["CT"]}}


@contextlib.contextmanager
def qido_server(answer: Callable[[str, int], list | bytes], *, most_requests: int = 100) -> Iterator[tuple[str, list]]:
    """A stdlib HTTP server on a free loopback port whose every GET is answered with ``answer(path, offset)``: a list,
    sent as DICOM JSON, or bytes, sent as an HTML page. Yields (its DICOMweb root URL, the paths asked for). It serves
    ``most_requests`` at most, for 30 s at most, and stops when the test is done."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            split = urlsplit(self.path)
            asked.append(self.path)
            body = answer(split.path, int(parse_qs(split.query).get("offset", ["0"])[0]))
            html = isinstance(body, bytes)
            data = body if html else json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html" if html else "application/dicom+json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # quiet
            pass

    class Server_(HTTPServer):
        def handle_error(self, request, client_address):  # a client that gave up on a slow page: nothing to say
            pass

    server = Server_(("127.0.0.1", free_port()), Handler)
    server.timeout = 0.1  # handle_request returns this often without a request, to see `done`
    done = threading.Event()

    def serve():
        until = time.monotonic() + 30
        while not done.is_set() and len(asked) < most_requests and time.monotonic() < until:
            server.handle_request()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/dicom-web", asked
    finally:
        done.set()
        thread.join(timeout=10)
        server.server_close()


def paged(results: list, offset: int, size: int = 2) -> list:
    """What a server that pages right answers: ``size`` results from ``offset`` on."""
    return results[offset : offset + size]


@pytest.mark.parametrize("level", ["studies", "series"])
def test_a_server_that_ignores_offset_is_named_instead_of_paged_forever(level):
    series = [series_json(f"1.2.3.{i}") for i in range(3)]

    def answer(path: str, offset: int) -> list:
        if path.endswith("/series"):
            return series if level == "series" else paged(series, offset)
        return [study_json(STUDY)] if level == "studies" else paged([study_json(STUDY)], offset)

    with qido_server(answer) as (url, asked):
        start = time.monotonic()
        page = "page 2 of study" if level == "studies" else "page 2 of the series of study"
        with pytest.raises(OffsetIgnored, match=rf"{url} answered {page} {STUDY} \(QIDO-RS\) \(offset=\d\) with "
                           r"only results of earlier pages .* it ignores QIDO-RS's offset.* "
                           r"e\.g\. http://host:8042/dicom-web"):  # fmt: skip
            find_ct_series(Server(url), STUDY)
        assert time.monotonic() - start < 5
        assert len(asked) == (2 if level == "studies" else 2 + 2)  # the studies' 2 pages (1 result, none), 2 of series


def test_more_series_than_a_study_holds_or_another_study_is_named(monkeypatch):
    endless = [series_json(f"1.2.3.{i}") for i in range(1000)]

    def answer(path: str, offset: int) -> list:
        return paged(endless, offset, size=20) if path.endswith("/series") else paged([study_json(STUDY)], offset)

    monkeypatch.setattr(retrieval, "MAX_SERIES", 50)
    with qido_server(answer) as (url, asked):
        with pytest.raises(TooManyResults, match=rf"{url} answered the series of study {STUDY} \(QIDO-RS\) with more "
                           r"than 50 results \(60 after 3 pages\); expected at most 50"):  # fmt: skip
            find_ct_series(Server(url), STUDY)
        assert len(asked) == 2 + 3

    def unfiltered(path: str, offset: int) -> list:  # every study, whatever StudyInstanceUID asks for
        return paged([study_json(STUDY), study_json("1.2.9")], offset)

    with qido_server(unfiltered) as (url, _), pytest.raises(NotDicomWeb) as refused:
        find_ct_series(Server(url), STUDY)
    assert str(refused.value).startswith(f"{url} answered study {STUDY} (QIDO-RS) with 1.2.9, not the {STUDY} asked")


def test_an_html_page_instead_of_dicom_json_is_named():
    page = b"<!DOCTYPE html><html>a web server's root</html>"
    with qido_server(lambda path, offset: page) as (url, _), pytest.raises(NotDicomWeb) as refused:
        find_ct_series(Server(url), STUDY)
    assert str(refused.value).startswith(f"{url} answered study {STUDY} (QIDO-RS) with something that is not JSON")


@pytest.mark.medium
def test_a_server_that_pages_slowly_without_end_is_stopped_by_the_deadline():
    """Each page after 0.25 s with new series, without end: the whole search stops at its deadline (the timeout, all
    pages together), not at the first timeout of one page, and dicomweb-client's tries again add nothing after it."""

    def answer(path: str, offset: int) -> list:
        if not path.endswith("/series"):
            return paged([study_json(STUDY)], offset)
        time.sleep(0.25)
        return [series_json(f"1.2.3.{offset + i}") for i in range(5)]

    with qido_server(answer) as (url, asked):
        start = time.monotonic()
        with pytest.raises(DeadlinePassed, match=rf"{url} did not finish answering the series of study {STUDY} "
                           r"\(QIDO-RS\) within 1\.5 s, all its requests together"):  # fmt: skip
            find_ct_series(Server(url, timeout_s=1.5), STUDY)  # 3 attempts: a try again would wait 2 s first
        elapsed = time.monotonic() - start
        assert 1.5 <= elapsed < 2.5, elapsed
        assert 2 + 3 <= len(asked) <= 2 + 7  # the studies' 2 pages, then about 6 of series (one cut short)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"http://alice:{SECRET}@host:8042/dicom-web", "http://alice:***@host:8042/dicom-web"),
        (f"https://alice:{SECRET}/x@host/dicom-web", "https://alice:***@host/dicom-web"),  # not "host alice, port S3"
        (f"http://alice:{SECRET}@x@host/dicom-web", "http://alice:***@host/dicom-web"),
        (f"http://{SECRET}@host/dicom-web", "http://***@host/dicom-web"),  # a user alone may be a token
        (f"alice:{SECRET}@host/dicom-web", "alice:***@host/dicom-web"),
        ("http://host:8042/dicom-web", "http://host:8042/dicom-web"),
    ],
)
def test_masked_url_shows_no_password(url, shown):
    assert masked_url(url) == shown


@pytest.mark.parametrize(
    "url", [f"http://alice:{SECRET}@host:8042/dicom-web", f"http://{SECRET}@host/dicom-web", f"a:{SECRET}@host/x"]
)
def test_a_url_with_user_info_is_refused_without_its_password(url):
    with pytest.raises(ValueError, match=rf"DICOMweb URL {re.escape(masked_url(url))} holds user info") as refused:
        Server(url, environ={})
    message = str(refused.value)
    assert SECRET not in message
    for variable in ("VIT_CT_DICOMWEB_USER", "VIT_CT_DICOMWEB_PASSWORD", "VIT_CT_DICOMWEB_TOKEN"):
        assert variable in message


@pytest.mark.parametrize(
    ("url", "why"), [("ftp://host/dicom-web", "has scheme 'ftp'"), ("host:8042/dicom-web", "has no scheme")]
)
def test_a_url_that_is_not_http_is_refused(url, why):
    with pytest.raises(ValueError, match=f"DICOMweb URL '{url}' {why}; expected an http:// or https:// URL"):
        Server(url, environ={})


@pytest.mark.medium
def test_the_command_refuses_a_url_with_a_password_and_shows_it_nowhere(tmp_path):
    url = f"http://alice:{SECRET}@127.0.0.1:{free_port()}/dicom-web"  # nothing listens there either
    run = run_pacs(url, STUDY, tmp_path / "out")
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stderr.startswith(f"vit-ct pacs: DICOMweb URL {masked_url(url)} holds user info")
    assert SECRET not in run.stdout + run.stderr
    for path in tmp_path.rglob("*"):
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path
