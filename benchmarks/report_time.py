"""How long ``vit-ct report`` takes on a predict output, each run a fresh process as a user starts it (imports, reading
the DICOM headers and masks, the bootstrap, the figures and the page), and whether its AUROC is the one ``vit-ct
test`` logged for the same slices (``runs/latest/summary.json``'s ``test/auroc``, where there is one). The target: the
demo's test split under 60 s on 2 cores, 1,000 bootstrap replicates.

    make demo && python -m benchmarks.report_time                # outputs/demo, data/synthetic/manifest.csv
    python -m benchmarks.report_time OUT --manifest M.csv --repeats 3

Run as a script it writes its record, ``benchmarks/records/report_time.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

TARGET_S = 60.0


def run_report(out: Path, manifest: Path, report: Path, bootstrap: int) -> float:
    """Wall seconds of one ``vit-ct report`` (``python -m vit_ct``: this checkout's code), which must succeed."""
    from benchmarks.recording import timed_vit_ct

    return timed_vit_ct("report", str(out), "--manifest", str(manifest), "--output_dir", str(report),
                        "--bootstrap", str(bootstrap))  # fmt: skip


def logged_test_auroc(summary: Path) -> float | None:
    """``test/auroc`` of a run's summary, None without one."""
    if not summary.is_file():
        return None
    return json.loads(summary.read_text()).get("metrics", {}).get("test/auroc")


def main(argv: list[str] | None = None, records: Path | None = None) -> dict:
    """Time the report and print the figures; with ``records`` (a folder) also write the record there."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="outputs/demo", help="the predict output (default outputs/demo)")
    parser.add_argument("--manifest", default="data/synthetic/manifest.csv", help="its labelled manifest")
    parser.add_argument("--repeats", type=int, default=3, help="runs, each a fresh process (default 3)")
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap replicates (default 1000)")
    parser.add_argument("--summary", default="runs/latest/summary.json", help="the run whose test/auroc to compare")
    parser.add_argument("--name", default="report_time", help="the record's name")
    args = parser.parse_args(argv)
    from benchmarks.recording import command_line, describe, git_state, machine, write_record

    out, manifest = Path(args.out), Path(args.manifest)
    git, started = git_state(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vit-ct-report-") as folder:
        # each run its own folder: vit-ct report refuses to write over an earlier report without --overwrite
        reports = [Path(folder) / f"report-{i}" for i in range(args.repeats)]
        times = [run_report(out, manifest, report, args.bootstrap) for report in reports]
        record = json.loads((reports[-1] / "report.json").read_text())
    auroc, test_auroc = record["slice"]["auroc"], logged_test_auroc(Path(args.summary))
    figures = {
        "report_min_s": round(min(times), 2),
        "report_median_s": round(statistics.median(times), 2),
        "target_s": TARGET_S,
        "met": statistics.median(times) < TARGET_S,
        "slices": record["rows"]["slices"],
        "scans": record["rows"]["scans"],
        "patients": record["rows"]["patients"],
        "bootstrap": args.bootstrap,
        "auroc": auroc["value"],
        "auroc_ci95": auroc["ci95"],
        "test_auroc_logged": test_auroc,
    }
    print(f"vit-ct report on {out} ({figures['slices']} slices, {args.bootstrap} replicates) on {describe(machine())}:")
    print(f"  {figures['report_median_s']} s median of {args.repeats} (min {figures['report_min_s']} s), target"
          f" {TARGET_S:.0f} s: {'met' if figures['met'] else 'NOT met'}")  # fmt: skip
    print(f"  AUROC {auroc['value']:.4f} {auroc['ci95']}" + (f", vit-ct test logged {test_auroc:.4f}"
                                                             if test_auroc is not None else ""))  # fmt: skip
    if records is not None:
        notes = {"times_s": [round(t, 2) for t in times], "out": str(out), "manifest": str(manifest)}
        write_record(args.name, figures, command=command_line("benchmarks.report_time", argv), notes=notes,
                     seconds=time.monotonic() - started, folder=records, git=git)  # fmt: skip
    return figures


if __name__ == "__main__":
    from benchmarks.recording import RECORDS

    main(records=RECORDS)
