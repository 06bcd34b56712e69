"""A study's CT series from a DICOMweb server: found by QIDO-RS (``Modality=CT``), retrieved by WADO-RS as they are
stored (any transfer syntax), one folder of ``<SOPInstanceUID>.dcm`` files per series, as ``vit-ct predict
--data.init_args.scans`` reads them. A search is paged here (:func:`search`), not by ``dicomweb-client``'s
``get_remaining``, which asks for the same page forever of a server that ignores ``offset``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vit_ct.files import atomic_write, inside, safe_name
from vit_ct.pacs.connection import NoCTSeries, NotDicomWeb, OffsetIgnored, Server, StudyNotFound, TooManyResults

# DICOM JSON tags (PS3.18 F.2) of what the QIDO-RS answers hold
STUDY_UID, SERIES_UID, MODALITY = "0020000D", "0020000E", "00080060"
SERIES_NUMBER, SERIES_DESCRIPTION, INSTANCES = "00200011", "0008103E", "00201209"
ANY_TRANSFER_SYNTAX = (("application/dicom", "*"),)  # the stored bytes: no transcoding by the server
# CT Image, Enhanced CT, Legacy Converted Enhanced CT Image Storage: what is retrieved of a series of Modality CT (not,
# say, a Secondary Capture a viewer or vit-ct itself stored there with Modality CT)
CT_IMAGES = ("1.2.840.10008.5.1.4.1.1.2", "1.2.840.10008.5.1.4.1.1.2.1", "1.2.840.10008.5.1.4.1.1.2.2")
# Series one study may hold before its search is taken for a server paging wrongly: a CT study holds a few to tens,
# the largest (many phases, a series per image) hundreds to a few thousand; 10,000 results of ~1 kB each stay ~10 MB.
MAX_SERIES = 10_000


@dataclass(frozen=True)
class Series:
    """One series of the study as the server lists it."""

    uid: str
    modality: str
    number: int | None = None
    description: str = ""
    instances: int | None = None  # as the server counts them; None where it does not say


def _value(item: dict, tag: str):
    values = item.get(tag, {}).get("Value") or [None]
    return values[0]


def search(
    server: Server, what: str, page: Callable[[int], list], key: str, most: int, only: str | None = None
) -> list[dict]:
    """Every result of a QIDO-RS search, page by page as ``dicomweb-client``'s ``get_remaining`` pages (``offset``
    advanced by each page's length, the server choosing how many a page holds, until an empty page), but bounded:

    - a result that is not DICOM JSON with its ``key`` UID (e.g. the ids that Orthanc's REST API at the server's
      root answers with), or with another UID than ``only``: :class:`NotDicomWeb`;
    - a page with no UID that earlier pages did not bring: :class:`OffsetIgnored` (asking on would not end);
    - more than ``most`` distinct UIDs: :class:`TooManyResults`;
    - all pages together longer than ``server.query_s``: :class:`DeadlinePassed`.

    Args:
        server: The server; its errors are named as :meth:`Server.asking` names them.
        what: What is asked for, in words, for the messages (e.g. "the series of study 1.2.3 (QIDO-RS)").
        page: The results from an offset on, e.g. ``lambda offset: client.search_for_series(uid, offset=offset)``.
        key: The DICOM JSON tag of the UID that tells results apart (e.g. ``SERIES_UID``).
        most: The most distinct results the search can have.
        only: The one UID every result must have (a search for one study), if any.

    Returns:
        The results in the server's order, the first of each UID.
    """
    found: dict[str, dict] = {}
    offset = pages = 0
    with server.query(what):
        while True:
            server.in_time(what, f"{pages} pages, {len(found)} results" if pages else "")
            results = page(offset)
            pages += 1
            if not results:
                return list(found.values())
            uids = [_uid(server, what, item, key) for item in results]
            if only is not None and any(uid != only for uid in uids):
                other = next(uid for uid in uids if uid != only)
                raise NotDicomWeb(
                    f"{server.url} answered {what} with {other}, not the {only} asked for; expected only results "
                    f"for {only} (a DICOMweb server that filters by it; {server.root_hint})"
                )
            if all(uid in found for uid in uids):
                raise OffsetIgnored(
                    f"{server.url} answered page {pages} of {what} (offset={offset}) with only results of earlier "
                    f"pages ({len(found)} of them): it ignores QIDO-RS's offset, so asking for more would never end; "
                    f"expected a DICOMweb server that pages ({server.root_hint})"
                )
            for uid, item in zip(uids, results, strict=True):
                found.setdefault(uid, item)
            if len(found) > most:
                raise TooManyResults(
                    f"{server.url} answered {what} with more than {most} results ({len(found)} after {pages} pages); "
                    f"expected at most {most}: is the server paging right? ({server.root_hint})"
                )
            offset += len(results)


def _uid(server: Server, what: str, item, key: str) -> str:
    """The ``key`` UID of one QIDO-RS result; :class:`NotDicomWeb` if it is no DICOM JSON object holding it."""
    uid = _value(item, key) if isinstance(item, dict) and isinstance(item.get(key), dict) else None
    if not isinstance(uid, str) or not uid:
        shown = repr(item)
        shown = shown if len(shown) <= 100 else f"{shown[:100]}..."
        raise NotDicomWeb(
            f"{server.url} answered {what} with {shown}, which is not a DICOM JSON result with the UID {key}; "
            f"expected a DICOMweb (QIDO-RS) answer ({server.root_hint})"
        )
    return uid


def study_series(server: Server, study: str) -> list[Series]:
    """Every series of ``study`` (any modality), by series number; :class:`StudyNotFound` if the server has no such
    study. Each search is bounded (:func:`search`): the study's to that one study, its series' to
    :data:`MAX_SERIES`, each to ``server.query_s`` seconds."""
    studies = search(
        server,
        f"study {study} (QIDO-RS)",
        lambda offset: server.client.search_for_studies(search_filters={"StudyInstanceUID": study}, offset=offset),
        STUDY_UID,
        most=1,
        only=study,
    )
    if not studies:
        raise StudyNotFound(
            f"{server.url} holds no study with StudyInstanceUID {study}; expected the UID of a study stored there "
            "(the server's own viewer or a QIDO-RS query of /studies lists them)"
        )
    found = search(
        server,
        f"the series of study {study} (QIDO-RS)",
        lambda offset: server.client.search_for_series(study, offset=offset),
        SERIES_UID,
        most=MAX_SERIES,
    )
    series = [
        Series(
            uid=_value(item, SERIES_UID),
            modality=_value(item, MODALITY) or "",
            number=_value(item, SERIES_NUMBER),
            description=_value(item, SERIES_DESCRIPTION) or "",
            instances=_value(item, INSTANCES),
        )
        for item in found
    ]
    return sorted(series, key=lambda s: (s.number is None, s.number or 0, s.uid))


def find_ct_series(server: Server, study: str) -> list[Series]:
    """The CT series of ``study``; :class:`NoCTSeries` naming the modalities it holds if there is none."""
    series = study_series(server, study)
    ct = [s for s in series if s.modality == "CT"]
    if not ct:
        held = ", ".join(f"{s.modality or '?'} ({s.uid})" for s in series) or "no series at all"
        raise NoCTSeries(
            f"study {study} at {server.url} holds no CT series ({held}); expected at least one series of Modality CT"
        )
    return ct


def retrieve_series(server: Server, study: str, series: Series, folder: Path) -> tuple[list[Path], int]:
    """Retrieve the CT images of ``series`` into ``folder/<SeriesInstanceUID>/<SOPInstanceUID>.dcm``, each file
    written whole or not at all; returns the files, in the order the server sent them, and how many instances of other
    SOP classes were left out. The UIDs are the server's: made safe as names (:func:`vit_ct.files.safe_name`), so a
    UID such as ``../../X`` is written inside ``folder`` under a name of its own, never above it."""
    import pydicom

    target = inside(folder, safe_name(series.uid))
    paths, other = [], 0
    with server.asking(f"the instances of series {series.uid} of study {study} (WADO-RS)"):
        datasets = server.client.iter_series(study, series.uid, media_types=ANY_TRANSFER_SYNTAX)
        for dataset in datasets:
            if str(dataset.get("SOPClassUID", "")) not in CT_IMAGES:
                other += 1
                continue
            path = inside(target, f"{safe_name(dataset.get('SOPInstanceUID', ''))}.dcm")
            with atomic_write(path) as tmp:
                pydicom.dcmwrite(tmp, dataset, enforce_file_format=True)
            paths.append(path)
    return paths, other


def retrieve_ct(server: Server, study: str, series: list[Series], folder: Path) -> dict[str, list[Path]]:
    """The CT images of each of ``series`` (:func:`retrieve_series`), series UID -> files; a series without CT images
    is left out with a line saying so, and :class:`NoCTSeries` if none has any."""
    retrieved = {}
    for one in series:
        paths, other = retrieve_series(server, study, one, folder)
        left_out = f", {other} instances of other SOP classes left out" if other else ""
        print(f"  series {one.uid} ({one.description or 'no description'}): {len(paths)} CT images{left_out}")
        if paths:
            retrieved[one.uid] = paths
    if not retrieved:
        raise NoCTSeries(
            f"the CT series of study {study} at {server.url} hold no CT image (WADO-RS); expected CT Image Storage "
            "instances in at least one"
        )
    return retrieved
