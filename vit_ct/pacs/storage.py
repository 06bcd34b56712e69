"""Storing DICOM files on a DICOMweb server (STOW-RS) and the report of what was stored: per file its SOPInstanceUID
and whether the server accepted it or why not, so that nothing half-stored goes unreported, even when the server
stops answering midway (the files not yet sent are listed with that reason).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from vit_ct.files import atomic_write
from vit_ct.pacs.connection import PacsError, Server

BATCH_BYTES = 32 * 2**20  # files per STOW-RS request up to this size: a failure midway loses at most one request
# STOW-RS FailureReason codes (PS3.18 Table I.2-1 / PS3.4 Annex B) in words
FAILURE_REASONS = {
    0x0110: "processing failure",
    0x0112: "no such object instance",
    0x0122: "SOP class not supported",
    0x0124: "not authorized",
    0xA700: "out of resources",
    0xA900: "data set does not match SOP class",
    0xC000: "cannot understand",
    0xC122: "referenced transfer syntax not supported",
    0xC123: "referenced SOP instance not supported by the server",
}


@dataclass
class StoredFile:
    """What became of one file: ``stored`` True when the server listed it as accepted."""

    path: str
    sop_instance_uid: str | None
    stored: bool
    reason: str = ""  # why not, in the server's words where it gave some
    retrieve_url: str = ""  # where the server says it can be read back


class StoreInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM while files were being stored; ``report`` says what became of each file up to then."""

    def __init__(self, report: StoreReport) -> None:
        super().__init__("interrupted while storing")
        self.report = report


@dataclass
class StoreReport:
    """Every file asked for, in order, and the server they went to."""

    url: str
    files: list[StoredFile]

    @property
    def stored(self) -> list[StoredFile]:
        return [f for f in self.files if f.stored]

    @property
    def failed(self) -> list[StoredFile]:
        return [f for f in self.files if not f.stored]

    def summary(self) -> str:
        """One line, then one per file that was not stored."""
        lines = [f"stored {len(self.stored)} of {len(self.files)} DICOM files at {self.url}"]
        lines += [
            f"  not stored: {f.path} ({f.sop_instance_uid or 'no SOPInstanceUID'}): {f.reason}" for f in self.failed
        ]
        return "\n".join(lines)

    def write(self, path: Path, **context) -> Path:
        """``path`` as JSON: ``url``, ``context`` (e.g. the study), ``stored`` / ``failed`` counts and ``files`` (each
        file's fields)."""
        body = {"url": self.url, **context, "stored": len(self.stored), "failed": len(self.failed),
                "files": [asdict(f) for f in self.files]}  # fmt: skip
        with atomic_write(path) as tmp:
            tmp.write_text(json.dumps(body, indent=2) + "\n")
        return Path(path)


def store_files(
    server: Server, paths: list[Path], *, study: str | None = None, batch_bytes: int = BATCH_BYTES
) -> StoreReport:
    """Store ``paths`` (DICOM files) with STOW-RS, a batch of files per request; returns the report of every file.

    Args:
        server: Where to store them.
        paths: The files, reported in this order.
        study: The StudyInstanceUID they must belong to (STOW-RS to ``/studies/{study}``: the server refuses any
            other study's instance), or None for any.
        batch_bytes: Files per request up to about this many bytes.

    A file that is no DICOM file, or has no SOPInstanceUID, is reported, not sent. When a request fails as a whole
    (the server stops, refuses or times out), its files and every later one are reported unstored with that error,
    and nothing more is sent. Ctrl-C (a ``KeyboardInterrupt``) raises :class:`StoreInterrupted` with the report of
    every file: the request in flight may or may not have been stored, the later files were not sent.
    """
    import pydicom

    report = StoreReport(server.url, [])
    batch: list[tuple[Path, pydicom.Dataset]] = []
    try:
        _store_all(server, list(map(Path, paths)), report, batch, study, batch_bytes)
    except KeyboardInterrupt as interrupt:
        listed, in_flight = {f.path for f in report.files}, {str(path): dataset for path, dataset in batch}
        for path in map(str, paths):
            if path in listed:
                continue
            if path in in_flight:
                uid, reason = str(in_flight[path].SOPInstanceUID), "interrupted while the server was storing it: it"
                reason += " may be stored there or not (its STOW-RS answer never came)"
            else:
                uid, reason = None, "not sent: interrupted before it was sent"
            report.files.append(StoredFile(path, uid, False, reason))
        raise StoreInterrupted(report) from interrupt
    return report


def _store_all(server: Server, paths: list[Path], report: StoreReport, batch: list, study, batch_bytes: int) -> None:
    """:func:`store_files`' loop; ``batch`` holds the files of the request being prepared or sent."""
    import pydicom

    size, stopped = 0, ""
    for path in paths:
        if stopped:
            report.files.append(StoredFile(str(path), _uid_of(path), False, stopped))
            continue
        try:
            dataset = pydicom.dcmread(path)
        except Exception as err:  # pydicom raises several kinds for files that are not DICOM
            report.files.append(StoredFile(str(path), None, False, f"not read as DICOM: {err}"))
            continue
        if "SOPInstanceUID" not in dataset:
            report.files.append(StoredFile(str(path), None, False, "no SOPInstanceUID: not a storable instance"))
            continue
        batch.append((path, dataset))
        size += path.stat().st_size
        if size >= batch_bytes:
            stopped = _store_batch(server, batch, report, study)
            batch.clear()
            size = 0
    if batch and not stopped:
        _store_batch(server, batch, report, study)
        batch.clear()


def _store_batch(server: Server, batch: list, report: StoreReport, study: str | None) -> str:
    """Send one batch and add its files to ``report``; returns the error that stopped it ("" when the server answered
    for every file)."""
    import requests

    uids = [str(dataset.SOPInstanceUID) for _, dataset in batch]
    answer = None
    try:
        where = f" into study {study}" if study else ""
        with server.asking(f"storing {len(batch)} instances{where} (STOW-RS)"):
            try:
                answer = server.client.store_instances([dataset for _, dataset in batch], study_instance_uid=study)
            except requests.exceptions.HTTPError as err:
                # 409: some or all failed (Orthanc: any), the body says which and why (PS3.18 10.5.3)
                answer = _failure_answer(err.response)
                if answer is None:
                    raise
    except PacsError as err:
        failed = zip(batch, uids, strict=True)
        report.files += [StoredFile(str(path), uid, False, f"not stored: {err}") for (path, _), uid in failed]
        return str(err)
    accepted = {str(item.ReferencedSOPInstanceUID): item for item in answer.get("ReferencedSOPSequence", [])}
    refused = {str(item.ReferencedSOPInstanceUID): item for item in answer.get("FailedSOPSequence", [])}
    for (path, _), uid in zip(batch, uids, strict=True):
        if uid in accepted:
            url = str(accepted[uid].get("RetrieveURL", ""))
            report.files.append(StoredFile(str(path), uid, True, retrieve_url=url))
        elif uid in refused:
            report.files.append(StoredFile(str(path), uid, False, _failure_reason(refused[uid])))
        else:
            report.files.append(StoredFile(str(path), uid, False, "the server's STOW-RS answer does not list it"))
    return ""


def _failure_answer(response):
    """The STOW-RS answer (a Dataset) inside an HTTP error (409 Conflict, 400), or None where it holds none."""
    import pydicom

    if response is None or response.status_code in (401, 403) or not response.content:
        return None
    try:
        answer = pydicom.Dataset.from_json(response.json())
    except ValueError:
        return None
    return answer if "FailedSOPSequence" in answer or "ReferencedSOPSequence" in answer else None


def _failure_reason(item) -> str:
    code = item.get("FailureReason")
    if code is None:
        return "refused by the server (no FailureReason given)"
    code = int(code)
    return f"refused by the server: FailureReason {code:#06x} ({FAILURE_REASONS.get(code, 'unlisted code')})"


def _uid_of(path: Path) -> str | None:
    """A file's SOPInstanceUID, read from its header only, or None where it has none."""
    import pydicom

    try:
        return str(pydicom.dcmread(path, stop_before_pixels=True, specific_tags=["SOPInstanceUID"]).SOPInstanceUID)
    except Exception:
        return None
