"""A study's CT series from a DICOMweb server: found by QIDO-RS (``Modality=CT``), retrieved by WADO-RS as they are
stored (any transfer syntax), one folder of ``<SOPInstanceUID>.dcm`` files per series, as ``vit-ct predict
--data.init_args.scans`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vit_ct.files import atomic_write
from vit_ct.pacs.connection import NoCTSeries, Server, StudyNotFound

# DICOM JSON tags (PS3.18 F.2) of what the QIDO-RS answers hold
STUDY_UID, SERIES_UID, MODALITY = "0020000D", "0020000E", "00080060"
SERIES_NUMBER, SERIES_DESCRIPTION, INSTANCES = "00200011", "0008103E", "00201209"
ANY_TRANSFER_SYNTAX = (("application/dicom", "*"),)  # the stored bytes: no transcoding by the server
# CT Image, Enhanced CT, Legacy Converted Enhanced CT Image Storage: what is retrieved of a series of Modality CT (not,
# say, a Secondary Capture a viewer or vit-ct itself stored there with Modality CT)
CT_IMAGES = ("1.2.840.10008.5.1.4.1.1.2", "1.2.840.10008.5.1.4.1.1.2.1", "1.2.840.10008.5.1.4.1.1.2.2")


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


def study_series(server: Server, study: str) -> list[Series]:
    """Every series of ``study`` (any modality), by series number; :class:`StudyNotFound` if the server has no such
    study."""
    with server.asking(f"study {study} (QIDO-RS)"):
        studies = server.client.search_for_studies(search_filters={"StudyInstanceUID": study}, get_remaining=True)
        found = server.client.search_for_series(study, get_remaining=True) if studies else []
    if not studies:
        raise StudyNotFound(
            f"{server.url} holds no study with StudyInstanceUID {study}; expected the UID of a study stored there "
            "(the server's own viewer or a QIDO-RS query of /studies lists them)"
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
    SOP classes were left out."""
    import pydicom

    target = Path(folder) / series.uid
    paths, other = [], 0
    with server.asking(f"the instances of series {series.uid} of study {study} (WADO-RS)"):
        datasets = server.client.iter_series(study, series.uid, media_types=ANY_TRANSFER_SYNTAX)
        for dataset in datasets:
            if str(dataset.get("SOPClassUID", "")) not in CT_IMAGES:
                other += 1
                continue
            path = target / f"{dataset.SOPInstanceUID}.dcm"
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
