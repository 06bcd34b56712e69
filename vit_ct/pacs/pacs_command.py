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
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from vit_ct.files import (
    check_replaceable,
    record_output,
    signals_held,
)
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
    parser.add_argument("--timeout", type=positive_seconds, default=TIMEOUT_S, metavar="S", help="seconds to wait for"
                        " the server to connect and for each answer, and for all the pages of a search together"
                        f" (default {TIMEOUT_S:g})")  # fmt: skip
    parser.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run in OUT")
    return parser


def positive_seconds(text: str) -> float:
    """``--timeout``'s value: a number of seconds above 0 (0 or less would fail only at the first request)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds above 0, e.g. 30")
    return seconds


def predict_command(args: argparse.Namespace, source: Path, out: Path, extra: list[str]) -> list[str]:
    """The ``vit-ct predict`` command line (``python -m vit_ct``: this interpreter's vit-ct) on the retrieved scans."""
    command = [sys.executable, "-m", "vit_ct", "predict"]
    for config in args.config:
        command += ["--config", config]
    if args.ckpt_path:
        command += ["--ckpt_path", args.ckpt_path]
    command += ["--data.init_args.scans", json.dumps([str(source)]), "--output_dir", str(out), "--dicom_out", "true"]
    return command + extra


PACS = "pacs"  # the command, as its output record names it


def main(argv: list[str] | None = None) -> None:
    parser = pacs_parser()
    args, extra = parser.parse_known_args(argv)
    out = Path(args.output_dir)
    try:
        replacing = check_replaceable(out, PACS, overwrite=args.overwrite)
    except ValueError as err:
        parser.exit(1, f"vit-ct pacs: {err}\n")
    # An earlier output is set aside, not deleted, until this run's is complete (predict's files name the retrieved
    # slices where they are read, so the run is made in OUT itself); a run that ends with nothing stored puts it back.
    held = out.resolve()
    previous = held.with_name(f".{held.name}.{os.getpid()}-{secrets.token_hex(4)}.previous") if replacing else None
    if previous is not None:
        os.replace(out, previous)
    handler = signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's stop ends the run as Ctrl-C does
    try:
        try:
            message, status, stored = run(args, extra, out)
        except KeyboardInterrupt as interrupt:
            message, status, stored = interrupted(interrupt, args, out)
        with signals_held():
            if previous is not None and not stored:  # nothing reached the server: OUT as it was
                shutil.rmtree(out, ignore_errors=True)
                os.replace(previous, out)
                message += f"; {out} holds the earlier run, as it was"
            elif out.is_dir():  # this run's output, whole or not: what a later --overwrite may replace
                record_output(out, PACS)
                if previous is not None:
                    shutil.rmtree(previous)
                if not stored and (out / "source").is_dir():
                    message += f" (the retrieved series are in {out / 'source'})"
    finally:
        signal.signal(signal.SIGTERM, handler)
    if status:
        parser.exit(status, f"vit-ct pacs: {message}\n")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run(args: argparse.Namespace, extra: list[str], out: Path) -> tuple[str, int, bool]:
    """The round trip into ``out``; returns the closing message, the exit status (0: every object stored) and whether
    anything was stored."""
    from vit_ct.pacs.connection import PacsError, Server
    from vit_ct.pacs.retrieval import find_ct_series, retrieve_ct
    from vit_ct.pacs.storage import store_files

    source, predicted = out / "source", out / "predict"
    seconds: dict[str, float] = {}
    try:
        server = Server(args.url, timeout_s=args.timeout)
        start = time.perf_counter()
        series = find_ct_series(server, args.study)
        seconds["query"] = time.perf_counter() - start
        print(f"study {args.study} at {server.url}: {len(series)} CT series, retrieved into {source}")
        start = time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        retrieve_ct(server, args.study, series, source)
        seconds["retrieve"] = time.perf_counter() - start
    except (PacsError, ValueError) as err:
        return str(err), 1, False

    start = time.perf_counter()
    returncode = run_predict(predict_command(args, source, predicted, extra))
    seconds["predict"] = time.perf_counter() - start
    if returncode in (130, 143):  # predict was interrupted (and said so): this run stops as it would have
        raise KeyboardInterrupt("SIGTERM" if returncode == 143 else "SIGINT")
    if returncode != 0:
        return (
            f"vit-ct predict failed (exit {returncode}, its message above); nothing was stored at {server.url}",
            returncode,
            False,
        )

    objects = sorted((predicted / "dicom").rglob("*.dcm"))
    if not objects:
        return (
            f"vit-ct predict wrote no DICOM object under {predicted / 'dicom'}; expected the objects of"
            " --dicom_out true there; nothing was stored",
            1,
            False,
        )
    start = time.perf_counter()
    report = store_files(server, objects, study=args.study)
    seconds["store"] = time.perf_counter() - start
    report.write(out / STORED, study=args.study, seconds=seconds)
    print(report.summary())
    print(f"what was stored, file by file: {out / STORED}")
    if report.failed:
        return (
            f"{len(report.failed)} of {len(report.files)} objects were not stored at {server.url} (listed"
            f" above and in {out / STORED})",
            1,
            bool(report.stored),
        )
    return "", 0, True


def run_predict(command: list[str]) -> int:
    """Run ``vit-ct predict`` and return its exit status. Interrupted meanwhile, it is given the signal too (Ctrl-C in a
    terminal reaches it already; a repeat within its shutdown is ignored) and waited for, so that its own shutdown and
    its one line end before this command's."""
    process = subprocess.Popen(command)
    try:
        status = process.wait()
    except KeyboardInterrupt as interrupt:
        process.send_signal(signal.SIGTERM if "SIGTERM" in str(interrupt) else signal.SIGINT)
        status = process.wait()
    return 128 - status if status < 0 else status  # ended by signal N (its repeat, after its line): as a shell says it


def interrupted(interrupt: KeyboardInterrupt, args: argparse.Namespace, out: Path) -> tuple[str, int, bool]:
    """Ctrl-C or SIGTERM: what was stored before it is written to ``OUT/stored.json``; the closing line, the exit
    status (130; 143 for SIGTERM) and whether anything was stored."""
    from vit_ct.pacs.storage import StoreInterrupted

    status = 143 if "SIGTERM" in str(interrupt) else 130
    if not isinstance(interrupt, StoreInterrupted):
        return "interrupted; nothing was stored", status, False
    report = interrupt.report
    with signals_held():  # the record of what the server now holds is written whole
        report.write(out / STORED, study=args.study, interrupted=True)
    return (
        f"interrupted while storing: {len(report.stored)} of {len(report.files)} objects were stored at"
        f" {report.url} before it; each file's fate is in {out / STORED}",
        status,
        True,
    )
