"""OpenMP waiting and threads by what shares the cores, measured on the real commands, side by side in one run.

Before: every process waited passively (``OMP_WAIT_POLICY=PASSIVE``, which vit-ct used to set on import) and every
DDP rank took every usable CPU. After (vit_ct.run.threads): a run alone keeps OpenMP's default waiting; the ranks of a
CPU DDP job split the CPUs and the ranks it starts wait passively; DataLoader workers and the simulator's worker
processes run one thread each. "Before" is reproduced with the environment variables the code honours (a value the
user sets wins), so both run the same code. Each case alternates before / after, ``--repeats`` times:

- ``alone``: ``vit-ct fit --config configs/demo.yaml``, ``--epochs`` epochs, no validation, no logger, fp32 (per-epoch
  seconds from the command's own epoch lines);
- ``ddp``: the same fit on 2 CPU processes (gloo);
- ``workers``: the same fit with 2 DataLoader workers reading the DICOM files every epoch (no cache);
- ``simulator``: building a synthetic set of 24 patients x 4 slices with 2 worker processes.

    python -m benchmarks.wait_policy [--epochs 3] [--repeats 2] [--cases alone ddp workers simulator]

Run as a script it writes its record, ``benchmarks/records/wait_policy.json``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VIT_CT = str(Path(sys.executable).with_name("vit-ct"))
DEMO_DATA = ROOT / "data" / "synthetic"  # where `make demo` builds the set (built by the first run if absent)
OPENMP = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")
EPOCH_LINE = re.compile(r"^epoch \d+/\d+ .* ([0-9.]+) s$")


def environment(before: bool, case: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OPENMP}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    if before:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        if case == "ddp":  # every rank took every usable CPU
            env["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
    return env


def fit_command(case: str, epochs: int) -> list[str]:
    command = [VIT_CT, "fit", "--config", str(ROOT / "configs" / "demo.yaml"), "--data.init_args.root", str(DEMO_DATA),
               "--trainer.max_epochs", str(epochs), "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
               "--test_after_fit", "false", "--trainer.precision", "32-true", "--trainer.enable_progress_bar",
               "false"]  # fmt: skip
    if case == "ddp":
        command += ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    if case == "workers":
        command += ["--data.init_args.num_workers", "2", "--data.init_args.cache", "false"]
    return command


SIMULATOR = """
import sys
from vit_ct.sim.synthetic import build_synthetic_dataset
build_synthetic_dataset(sys.argv[1], n_patients=24, slices_per_patient=4, num_workers=2, progress=False)
"""


def run(case: str, before: bool, epochs: int) -> tuple[float, list[float]]:
    """Wall seconds of one run, and its epochs' seconds (fits)."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-c", SIMULATOR, str(Path(folder) / "set")] if case == "simulator" else None
        command = command or fit_command(case, epochs)
        start = time.perf_counter()
        result = subprocess.run(command, cwd=folder, env=environment(before, case), capture_output=True, text=True)
        wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{case} ({'before' if before else 'after'}) failed:\n{result.stderr[-3000:]}")
    epochs_s = [float(m.group(1)) for line in result.stdout.splitlines() if (m := EPOCH_LINE.match(line.strip()))]
    return wall, epochs_s


def main(argv: list[str] | None = None, records: Path | None = None) -> None:
    """Measure and print the table; with ``records`` (a folder) also write the record ``wait_policy.json`` there."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cases", nargs="+", default=["alone", "ddp", "workers", "simulator"])
    args = parser.parse_args(argv)
    start = time.perf_counter()
    from benchmarks.recording import command_line, markdown_table, table, write_record
    from vit_ct.run.hardware import describe_machine

    if "simulator" not in args.cases or len(args.cases) > 1:  # the demo set, once, outside the timings
        subprocess.run([*fit_command("alone", 0)], cwd=tempfile.gettempdir(), env=environment(False, "alone"),
                       check=True, capture_output=True)  # fmt: skip
    rows = []
    for case in args.cases:
        results = {True: [], False: []}
        for _ in range(args.repeats):
            for before in (True, False):  # alternated, so that a slow moment of the machine hits both
                results[before].append(run(case, before, args.epochs))
        rows.append((case, results))
    print(f"\nOpenMP waiting and threads on {describe_machine()}; {args.repeats} alternated runs of each\n")
    cells, figures = [], {}
    for case, results in rows:
        walls = {k: [w for w, _ in v] for k, v in results.items()}
        epochs = {k: " ; ".join(" / ".join(f"{e:.1f}" for e in es) for _, es in v) for k, v in results.items()}
        before, after = statistics.mean(walls[True]), statistics.mean(walls[False])
        figures[f"{case}_before_over_after"] = before / after
        cells.append([case, ", ".join(f"{w:.1f}" for w in walls[True]), ", ".join(f"{w:.1f}" for w in walls[False]),
                      before / after, epochs[True] or "-", epochs[False] or "-"])  # fmt: skip
    columns = ["case", "before: all passive (s)", "after (s)", "before / after", "epochs before (s)",
               "epochs after (s)"]  # fmt: skip
    results_table = table(columns, cells, [None, None, None, ".2f", None, None])
    print(markdown_table(results_table))
    if records is not None:
        notes = {"epochs": args.epochs, "repeats": args.repeats, "precision": "32-true"}
        write_record("wait_policy", figures, command=command_line("benchmarks.wait_policy", argv),
                     tables={"wait_policy": results_table}, seconds=time.perf_counter() - start, notes=notes,
                     folder=records)  # fmt: skip


if __name__ == "__main__":
    from benchmarks.recording import RECORDS

    main(records=RECORDS)
