"""What the PACS round trip adds to predict: ``vit-ct pacs`` (query, retrieve, predict, store its DICOM objects) on a
40-slice synthetic head CT stored in a local Orthanc, each run a fresh process as a user starts it. The target: under
5 s added on 2 cores. ``added_s`` is paired: each round trip's wall time minus the predict inside it (its own
process, timed by vit-ct pacs in ``stored.json``), so that the noise between two predict runs on a shared machine
does not swamp the second or so the DICOMweb part takes; ``vit-ct predict`` alone on the same series is timed too.

    python -m benchmarks.pacs_round_trip                       # 40 slices of 256 x 256, the default ViT, untrained
    python -m benchmarks.pacs_round_trip --slices 40 --repeats 3 --ckpt_path CKPT --config configs/manifest.yaml

Needs Debian's ``orthanc`` and ``orthanc-dicomweb`` (benchmarks/orthanc.py starts it on a free loopback port). Run as a
script it writes its record, ``benchmarks/records/pacs_round_trip.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 5.0


def write_study(folder: Path, slices: int, size: int) -> list[Path]:
    """A synthetic patient's CT series (one study), ``slices`` slices of ``size`` x ``size``."""
    from vit_ct.sim.phantom import PhantomConfig
    from vit_ct.sim.synthetic import simulate_patient, write_slices

    simulated = simulate_patient(0, 1, slices, PhantomConfig(size=size, pixel_spacing_mm=230.0 / size))
    write_slices(simulated, seed=0, pid="bench-0001", images=folder / "images", masks=folder / "masks")
    return sorted((folder / "images").glob("*.dcm"))


def default_checkpoint(path: Path) -> Path:
    """``ViTClassifier()``'s checkpoint, untrained: the time is the network's, not its weights'."""
    import lightning as L
    import torch

    from vit_ct import ViTClassifier

    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(ViTClassifier())
    trainer.save_checkpoint(path)
    return path


def timed(command: list[str], cwd: Path) -> float:
    """Wall seconds of ``command``, which must succeed."""
    start = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:5])} ... failed ({result.returncode}): {result.stdout[-2000:]}"
                           f"{result.stderr[-3000:]}")  # fmt: skip
    return seconds


def main(argv: list[str] | None = None, records: Path | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slices", type=int, default=40, help="slices of the scan (default 40)")
    parser.add_argument("--size", type=int, default=256, help="rows = columns of each slice (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each command (default 3)")
    parser.add_argument("--ckpt_path", help="the checkpoint (default: ViTClassifier()'s, untrained)")
    parser.add_argument("--config", action="append", default=[], help="predict's configs (default configs/manifest)")
    parser.add_argument("--name", default="pacs_round_trip", help="the record's name")
    args = parser.parse_args(argv)
    from benchmarks.orthanc import running_orthanc
    from benchmarks.recording import command_line, describe, git_state, machine, write_record
    from vit_ct.pacs.connection import Server
    from vit_ct.pacs.storage import store_files

    configs = args.config or [str(ROOT / "configs" / "manifest.yaml")]
    git, started = git_state(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vit-ct-pacs-") as tmp:
        folder = Path(tmp)
        files = write_study(folder / "study", args.slices, args.size)
        ckpt = args.ckpt_path or str(default_checkpoint(folder / "model.ckpt"))
        common = [arg for config in configs for arg in ("--config", config)] + ["--ckpt_path", ckpt]
        with running_orthanc(folder / "orthanc") as url:
            import pydicom

            study = pydicom.dcmread(files[0]).StudyInstanceUID
            assert len(store_files(Server(url), files).stored) == len(files), "the study did not store"
            vit_ct = [sys.executable, "-m", "vit_ct"]
            round_trips, parts = [], []
            for k in range(args.repeats):
                out = folder / f"pacs{k}"
                round_trips.append(timed([*vit_ct, "pacs", url, "--study", study, *common, "--output_dir", str(out)],
                                         folder))  # fmt: skip
                parts.append(json.loads((out / "stored.json").read_text()))
            source = json.dumps([str(folder / "pacs0" / "source")])
            predicts = [
                timed(
                    [
                        *vit_ct,
                        "predict",
                        *common,
                        "--data.init_args.scans",
                        source,
                        "--dicom_out",
                        "true",
                        "--output_dir",
                        str(folder / f"predict{k}"),
                    ],
                    folder,
                )  # fmt: skip
                for k in range(args.repeats)
            ]
    added = statistics.median(t - p["seconds"]["predict"] for t, p in zip(round_trips, parts, strict=True))
    steps = {step: round(statistics.median(p["seconds"][step] for p in parts), 2) for step in parts[0]["seconds"]}
    figures = {
        "round_trip_median_s": round(statistics.median(round_trips), 2),
        "predict_median_s": round(statistics.median(predicts), 2),
        "added_s": round(added, 2),
        "round_trip_minus_predict_alone_s": round(statistics.median(round_trips) - statistics.median(predicts), 2),
        "target_s": TARGET_S,
        "met": added < TARGET_S,
        "slices": args.slices,
        "size": args.size,
        "objects_stored": parts[0]["stored"],
        **{f"{step}_s": seconds for step, seconds in steps.items()},
    }
    print(f"vit-ct pacs on a {args.slices}-slice scan ({args.size} x {args.size}) on {describe(machine())}:")
    print(f"  round trip {figures['round_trip_median_s']} s, of which {added:.2f} s besides its own predict (target"
          f" {TARGET_S:g} s: {'met' if figures['met'] else 'NOT met'}); predict alone {figures['predict_median_s']} s"
          f" (medians of {args.repeats})")  # fmt: skip
    print("  inside the round trip: " + ", ".join(f"{step} {s} s" for step, s in steps.items()))
    if records is not None:
        notes = {"round_trips_s": [round(t, 2) for t in round_trips], "predicts_s": [round(t, 2) for t in predicts],
                 "predicts_inside_s": [round(p["seconds"]["predict"], 2) for p in parts],
                 "checkpoint": args.ckpt_path or "ViTClassifier() untrained", "configs": configs}  # fmt: skip
        write_record(args.name, figures, command=command_line("benchmarks.pacs_round_trip", argv), notes=notes,
                     seconds=time.monotonic() - started, folder=records, git=git)  # fmt: skip
    return figures


if __name__ == "__main__":
    from benchmarks.recording import RECORDS

    main(records=RECORDS)
