"""A real PACS for the tests and benchmarks: Debian's Orthanc (``orthanc``) with its DICOMweb plugin
(``orthanc-dicomweb``), started from a temporary JSON config on a free loopback port with its storage in a temporary
folder, no DICOM port, and stopped after. ``running_orthanc(folder)`` yields the DICOMweb root URL.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ORTHANC = shutil.which("Orthanc") or ("/usr/sbin/Orthanc" if os.access("/usr/sbin/Orthanc", os.X_OK) else None)
PLUGIN = "/usr/share/orthanc/plugins/libOrthancDicomWeb.so"
MISSING = [name for name, there in (("orthanc", ORTHANC), ("orthanc-dicomweb", Path(PLUGIN).is_file())) if not there]
INSTALL = "Debian/Ubuntu: apt-get install orthanc orthanc-dicomweb"
# CI must run these tests, not skip them: there (CI set, as CI services and .ci/run do) a missing Orthanc fails them.
IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
START_S = 30.0


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now (for a test's or a benchmark's server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def orthanc_config(folder: Path, port: int, users: dict[str, str] | None) -> dict:
    """Orthanc's configuration: HTTP on ``port`` of loopback only, DICOMweb at ``/dicom-web/``, storage and index in
    ``folder``, no DICOM (DIMSE) server, basic auth for ``users`` where given."""
    return {
        "Name": "vit-ct-test",
        "HttpPort": port,
        "RemoteAccessAllowed": False,
        "DicomServerEnabled": False,
        "StorageDirectory": str(folder / "storage"),
        "IndexDirectory": str(folder / "storage"),
        "Plugins": [PLUGIN],
        "DicomWeb": {"Enable": True, "Root": "/dicom-web/"},
        "AuthenticationEnabled": bool(users),
        "RegisteredUsers": users or {},
        "SaveJobs": False,
    }


@contextlib.contextmanager
def running_orthanc(folder: Path, *, users: dict[str, str] | None = None) -> Iterator[str]:
    """Start Orthanc in ``folder`` and yield its DICOMweb root (``http://127.0.0.1:PORT/dicom-web``) once it answers
    there; stop it after. ``users``: ``{name: password}`` for basic auth (then a request without them gets 401)."""
    if MISSING:
        raise RuntimeError(f"{' and '.join(MISSING)} not installed ({INSTALL})")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = folder / "orthanc.json"
    config.write_text(json.dumps(orthanc_config(folder, port, users), indent=2))
    log = folder / "orthanc.log"
    with log.open("w") as output:
        process = subprocess.Popen([ORTHANC, str(config)], cwd=folder, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/dicom-web"
    try:
        _wait_until_answering(url, process, log)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_until_answering(url: str, process: subprocess.Popen, log: Path) -> None:
    """Poll ``url/studies`` until Orthanc answers (200, or 401 with authentication on)."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"Orthanc exited ({process.returncode}) while starting: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/studies", timeout=2):
                return
        except urllib.error.HTTPError as err:
            if err.code == 401:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"Orthanc did not answer at {url} within {START_S:g} s: {log.read_text()[-3000:]}")
