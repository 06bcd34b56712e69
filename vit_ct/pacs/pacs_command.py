"""``vit-ct pacs URL --study UID --ckpt_path CKPT --output_dir OUT``: a PACS round trip over DICOMweb. The study's CT
series are found (QIDO-RS) and retrieved (WADO-RS) into ``OUT/source/``, ``vit-ct predict`` runs on them as whole
scans into ``OUT/predict/`` with its DICOM objects (``--dicom_out true``: ``OUT/predict/dicom/<scan>/``), those are
stored back into the study (STOW-RS), and what was stored is printed and written to ``OUT/stored.json``.

Predict runs as its own process, the real command with its own messages; this one imports no torch, so ``vit-ct pacs
--help`` answers at once. Credentials come from the environment only (:mod:`vit_ct.pacs.connection`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from vit_ct.pacs.connection import PASSWORD, TIMEOUT_S, TOKEN, USER

STORED = "stored.json"


def pacs_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vit-ct pacs",
        description="Retrieve a study's CT series from a DICOMweb server (QIDO-RS, WADO-RS) into OUT/source/, run"
        " vit-ct predict on them as whole scans into OUT/predict/ with its DICOM objects (Parametric Map, SEG,"
        " Secondary Capture in the source study), store those back into the study (STOW-RS), and write what was"
        f" stored to OUT/{STORED}. Credentials from the environment only: {TOKEN} (bearer token), or {USER} and"
        f" {PASSWORD} (basic auth). Options not listed here go to vit-ct predict as they are (e.g. --trainer.*).",
        allow_abbrev=False,  # every option it does not know goes to predict, none is taken for a prefix of its own
        epilog="example: vit-ct pacs http://localhost:8042/dicom-web --study 1.2.826.0.1.3680043... --config"
        " configs/manifest.yaml --ckpt_path CKPT --output_dir pacs_out",
    )
    parser.add_argument("url", metavar="URL", help="the DICOMweb root, e.g. http://localhost:8042/dicom-web (Orthanc)")
    parser.add_argument("--study", required=True, metavar="UID", help="the StudyInstanceUID of the study to read")
    parser.add_argument("--output_dir", required=True, metavar="OUT", help="the folder to write into (new or empty)")
    parser.add_argument("--ckpt_path", metavar="CKPT", help="the checkpoint vit-ct predict runs (as in vit-ct predict)")
    parser.add_argument("-c", "--config", action="append", default=[], metavar="CONFIG", help="a config for vit-ct"
                        " predict (repeat to compose), e.g. configs/manifest.yaml")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, metavar="S", help="seconds to wait for the server"
                        f" to connect and for each answer (default {TIMEOUT_S:g})")  # fmt: skip
    parser.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run in OUT")
    return parser


def predict_command(args: argparse.Namespace, source: Path, out: Path, extra: list[str]) -> list[str]:
    """The ``vit-ct predict`` command line (``python -m vit_ct``: this interpreter's vit-ct) on the retrieved scans."""
    command = [sys.executable, "-m", "vit_ct", "predict"]
    for config in args.config:
        command += ["--config", config]
    if args.ckpt_path:
        command += ["--ckpt_path", args.ckpt_path]
    command += ["--data.init_args.scans", json.dumps([str(source)]), "--output_dir", str(out), "--dicom_out", "true"]
    return command + (["--overwrite", "true"] if args.overwrite else []) + extra


def clear_outputs(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty ``out`` unless ``overwrite``; then remove an earlier run's source and report (predict
    replaces its own folder)."""
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"--output_dir {out} is not empty; choose a new folder or add --overwrite to replace an "
                             "earlier vit-ct pacs run there")  # fmt: skip
        shutil.rmtree(out / "source", ignore_errors=True)
        (out / STORED).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = pacs_parser()
    args, extra = parser.parse_known_args(argv)
    from vit_ct.pacs.connection import PacsError, Server
    from vit_ct.pacs.retrieval import find_ct_series, retrieve_ct
    from vit_ct.pacs.storage import store_files

    out = Path(args.output_dir)
    source, predicted = out / "source", out / "predict"
    seconds: dict[str, float] = {}
    try:
        clear_outputs(out, args.overwrite)
        server = Server(args.url, timeout_s=args.timeout)
        start = time.perf_counter()
        series = find_ct_series(server, args.study)
        seconds["query"] = time.perf_counter() - start
        print(f"study {args.study} at {server.url}: {len(series)} CT series, retrieved into {source}")
        start = time.perf_counter()
        retrieve_ct(server, args.study, series, source)
        seconds["retrieve"] = time.perf_counter() - start
    except (PacsError, ValueError) as err:
        parser.exit(1, f"vit-ct pacs: {err}\n")

    start = time.perf_counter()
    command = predict_command(args, source, predicted, extra)
    result = subprocess.run(command)
    seconds["predict"] = time.perf_counter() - start
    if result.returncode != 0:
        parser.exit(result.returncode, f"vit-ct pacs: vit-ct predict failed (exit {result.returncode}, its message "
                    f"above); nothing was stored at {args.url} (the retrieved series are in {source})\n")  # fmt: skip

    objects = sorted((predicted / "dicom").rglob("*.dcm"))
    if not objects:
        parser.exit(1, f"vit-ct pacs: vit-ct predict wrote no DICOM object under {predicted / 'dicom'}; expected the "
                    "objects of --dicom_out true there; nothing was stored\n")  # fmt: skip
    start = time.perf_counter()
    report = store_files(server, objects, study=args.study)
    seconds["store"] = time.perf_counter() - start
    report.write(out / STORED, study=args.study, seconds=seconds)
    print(report.summary())
    print(f"what was stored, file by file: {out / STORED}")
    if report.failed:
        parser.exit(1, f"vit-ct pacs: {len(report.failed)} of {len(report.files)} objects were not stored at "
                    f"{args.url} (listed above and in {out / STORED})\n")  # fmt: skip
