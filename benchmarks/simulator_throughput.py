"""Slices per second of the simulators, one torch thread per process (as in a DataLoader or writer worker):

- the scan alone at 256 px, the demo's numerical path ("sampled": grid_sample projector, conv2d blur) against the
  sparse-matrix path ("matrix"), alternated call by call on the same slices, per batch size and per stage;
- the on-the-fly simulator (vit_ct.sim.simulator): anatomy + scan + windows + resize to the model grid, per worker at
  several slice sizes and heads per batch, and through a DataLoader with several workers;
- the scanner-randomised cohort (vit_ct.sim.cohort) per process, anatomy alone and with the scan, and its writer
  (python -m vit_ct.sim.pretraining) end to end with its disk size.

Prints markdown tables and, run as a script, writes its record (``benchmarks/records/simulator_throughput.json``);
~5 minutes on 2 cores:

    .venv/bin/python -m benchmarks.simulator_throughput [--sizes 128 256] [--seconds 8] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.recording import RECORDS, command_line, markdown_table, table, write_record
from vit_ct.run.hardware import describe_machine
from vit_ct.sim.cohort import CohortConfig, simulate_cohort_patient
from vit_ct.sim.phantom import PhantomConfig, simulate_slices
from vit_ct.sim.pretraining import PROGRESS, write_pretraining_set
from vit_ct.sim.projector import default_angles, filtered_back_projection, forward_project, fourier_filter
from vit_ct.sim.scanner import MU_WATER_PER_MM, gaussian_blur, simulate_acquisition
from vit_ct.sim.simulator import SimulatedSliceStream, StreamLoader

FIELD_OF_VIEW_MM = 230.0


def stream(
    size: int, args, *, epoch_size: int, slices_per_head: int = 1, method: str = "sampled"
) -> SimulatedSliceStream:
    return SimulatedSliceStream(
        config=PhantomConfig(size=size, pixel_spacing_mm=FIELD_OF_VIEW_MM / size, beam_hardening=args.beam_hardening),
        windows=args.windows,
        img_size=args.img_size,
        epoch_size=epoch_size,
        batch_size=args.batch_size,
        slices_per_head=slices_per_head,
        scan_method=method,
    )


def per_worker_rate(size: int, slices_per_head: int, args, method: str = "sampled") -> float:
    """Slices/s of one process for about ``args.seconds``, after one warm-up batch (geometry caches)."""
    source = stream(size, args, epoch_size=10**6, slices_per_head=slices_per_head, method=method)
    for _ in source.simulate_batch(0, epoch=0):
        pass
    n, batch, start = 0, 1, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        n += sum(1 for _ in source.simulate_batch(batch, epoch=0))
        batch += 1
    return n / (time.perf_counter() - start)


def loader_rate(size: int, args) -> float:
    """Slices/s of a second pass through a StreamLoader with ``args.workers`` persistent workers."""
    source = stream(size, args, epoch_size=args.batch_size * args.workers * args.loader_batches)
    loader = StreamLoader(source, batch_size=args.batch_size, num_workers=args.workers, persistent_workers=True)
    for _ in loader:  # starts the workers
        pass
    start = time.perf_counter()
    for _ in loader:
        pass
    return len(source) / (time.perf_counter() - start)


def scan_rates(batch: int, args) -> dict[str, float]:
    """ms per slice of scanning the same 256 px batch of demo slices with each method, calls alternated
    ``args.repeats`` times after one warm-up call each (the matrices are built then); medians."""
    hu = np.stack([s.hu_true for s in simulate_slices(np.random.default_rng(0), PhantomConfig(), batch, acquire=False)])
    times = {"sampled": [], "matrix": []}
    for repeat in range(args.repeats + 1):
        for method in times:
            generators = [torch.Generator().manual_seed(i) for i in range(batch)]
            start = time.perf_counter()
            simulate_acquisition(hu, generator=generators, kernel="hann", beam_hardening=0.05, method=method)
            if repeat:
                times[method].append((time.perf_counter() - start) / batch * 1e3)
    return {method: statistics.median(values) for method, values in times.items()}


def stage_times(args) -> list[tuple[str, float, float]]:
    """ms per slice of each stage of the scan of a batch of ``args.stage_batch`` demo slices at 256 px, for each
    method (stages alternated method by method, medians of ``args.repeats``), and of drawing their anatomy."""
    slices = simulate_slices(np.random.default_rng(0), PhantomConfig(), args.stage_batch, acquire=False)
    hu = torch.from_numpy(np.stack([s.hu_true for s in slices]))
    angles = default_angles(128)
    mu = gaussian_blur((MU_WATER_PER_MM * (1 + hu / 1000)).clamp(min=0), 0.8)
    sinogram = forward_project(mu, angles, pixel_spacing_mm=0.9)
    n0 = 1.5e6 * torch.exp(-sinogram)
    padded = 512
    spectrum = torch.stack([fourier_filter(padded, "hann")] * len(hu))[:, None]
    stages = {
        "anatomy (demo phantom)": lambda method: simulate_slices(np.random.default_rng(1), PhantomConfig(),
                                                                 args.stage_batch, acquire=False),
        "blur": lambda method: gaussian_blur(mu, 0.8, by_shifts=method == "matrix"),
        "forward projection": lambda method: forward_project(mu, angles, pixel_spacing_mm=0.9, method=method),
        "Poisson counts": lambda method: torch.poisson(n0),
        "filtering (FFT)": lambda method: torch.fft.ifft(torch.fft.fft(sinogram.double(), n=padded) * spectrum).real,
        "filtering + back-projection": lambda method: filtered_back_projection(
            sinogram, angles, filter_name="hann", pixel_spacing_mm=0.9, method=method
        ),
    }  # fmt: skip
    for method in ("sampled", "matrix"):  # warm-up: geometry caches and matrices
        for stage in stages.values():
            stage(method)
    rows = []
    for name, stage in stages.items():
        times = {"sampled": [], "matrix": []}
        for _ in range(args.repeats):
            for method in times:
                start = time.perf_counter()
                stage(method)
                times[method].append((time.perf_counter() - start) / len(hu) * 1e3)
        rows.append((name, statistics.median(times["sampled"]), statistics.median(times["matrix"])))
    return rows


def cohort_rates(args) -> dict[str, float]:
    """Slices/s of one process drawing cohort patients of ``args.cohort_slices`` slices at 256 px, anatomy alone
    (acquire=False) and with the scan, alternated patient by patient after a warm-up patient; by the wall clock and
    per second of the process's CPU time (what a core gives when other jobs share the machine)."""
    config = CohortConfig()
    simulate_cohort_patient(0, 0, args.cohort_slices, config)
    spent = {(acquire, clock): 0.0 for acquire in (False, True) for clock in ("wall", "cpu")}
    for index in range(1, args.cohort_patients + 1):
        for acquire in (False, True):
            wall, cpu = time.perf_counter(), time.process_time()
            simulate_cohort_patient(0, index, args.cohort_slices, config, acquire=acquire)
            spent[acquire, "wall"] += time.perf_counter() - wall
            spent[acquire, "cpu"] += time.process_time() - cpu
    n = args.cohort_patients * args.cohort_slices
    return {
        f"{'anatomy + scan' if acquire else 'anatomy only'}, {clock}": n / t for (acquire, clock), t in spent.items()
    }


def writer_rate(args) -> dict[str, float]:
    """The pretraining writer with ``args.workers`` workers: slices/s end to end (worker start-up, matrices, DICOM and
    PNG included) by the wall clock and per CPU-second of all its processes, slices/s in its steady state (between
    the first and the last patient done, from the progress markers' times), and its disk use in MB per 1,000 slices."""
    root = Path(tempfile.mkdtemp(prefix="vit-ct-pretraining-")) / "set"

    def cpu_seconds() -> float:  # this process and its finished children (the workers)
        used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return sum(u.ru_utime + u.ru_stime for u in used)

    try:
        cpu, start = cpu_seconds(), time.time()
        write_pretraining_set(root, n_patients=args.writer_patients, slices_per_patient=args.cohort_slices,
                              num_workers=max(1, args.workers), progress=False)  # fmt: skip
        cpu, seconds = cpu_seconds() - cpu, time.time() - start
        done = sorted(p.stat().st_mtime for p in (root / PROGRESS).glob("*.json"))
        n = args.writer_patients * args.cohort_slices
        steady = (len(done) - 1) * args.cohort_slices / (done[-1] - done[0])
        return {
            "end to end, wall": n / seconds,
            "end to end, per CPU-second": n / cpu,
            "steady state (first to last patient done), wall": steady,
            "MB per 1,000 slices": sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / n * 1000 / 1e6,
        }
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)


def main(argv: list[str] | None = None, records: Path | None = None) -> None:
    """Measure and print the tables; with ``records`` (a folder) also write the record there."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 256], help="simulated slice sizes, pixels")
    parser.add_argument("--img-size", type=int, default=128, help="model grid side")
    parser.add_argument("--windows", nargs="+", default=["brain", "subdural"], help="HU windows (channels)")
    parser.add_argument("--heads", type=int, nargs="+", default=[1, 4], help="slices per head (one scan batch)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=8.0, help="timing per per-worker row")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader / writer workers (0: skip those rows)")
    parser.add_argument("--loader-batches", type=int, default=3, help="batches per worker in the loader rows")
    parser.add_argument("--beam-hardening", type=float, default=0.0)
    parser.add_argument("--scan-batches", type=int, nargs="+", default=[1, 4, 16], help="batch sizes of the scan rows")
    parser.add_argument("--repeats", type=int, default=5, help="alternated calls per method in the scan rows")
    parser.add_argument("--stage-batch", type=int, default=16, help="batch size of the per-stage rows")
    parser.add_argument("--cohort-slices", type=int, default=16, help="slices per cohort patient")
    parser.add_argument("--cohort-patients", type=int, default=4, help="patients per cohort row")
    parser.add_argument("--writer-patients", type=int, default=16, help="patients of the writer rows")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(1)  # what a DataLoader worker gets

    stages = stage_times(args)
    scans = [(batch, scan_rates(batch, args)) for batch in args.scan_batches]
    rows = []
    for size in args.sizes:
        for heads in args.heads:
            rows.append((f"{size} px, 1 process, {heads} slice(s) per head", per_worker_rate(size, heads, args)))
            if heads > 1:
                rate = per_worker_rate(size, heads, args, method="matrix")
                rows.append((f"{size} px, 1 process, {heads} slices per head, scan_method matrix", rate))
        if args.workers:
            rows.append((f"{size} px, StreamLoader, {args.workers} workers", loader_rate(size, args)))
    cohort = cohort_rates(args)
    for name, rate in cohort.items():
        rows.append((f"cohort, 256 px, 1 process, {args.cohort_slices} slices per patient: {name}", rate))
    megabytes = None
    if args.workers:
        writer = writer_rate(args)
        megabytes = writer.pop("MB per 1,000 slices")
        for name, rate in writer.items():
            rows.append((f"pretraining writer, {args.workers} workers, {args.writer_patients} x {args.cohort_slices} "
                         f"slices, DICOM + PNG ({megabytes:.0f} MB per 1,000 slices): {name}", rate))  # fmt: skip

    print(f"\nmeasured on {describe_machine()}, {os.cpu_count()} CPU cores, torch threads 1 per process\n")
    stage_table = table([f"stage, batch of {args.stage_batch} demo slices at 256 px", "sampled (demo), ms/slice",
                         "matrix, ms/slice"], [list(stage) for stage in stages], [None, ".1f", ".1f"])  # fmt: skip
    scan_table = table(["scan of 256 px demo slices", "sampled (demo), ms/slice", "matrix, ms/slice", "speed-up"],
                       [[f"batch of {batch}", rate["sampled"], rate["matrix"], rate["sampled"] / rate["matrix"]]
                        for batch, rate in scans], [None, ".1f", ".1f", "{:.1f}x"])  # fmt: skip
    simulator_table = table(["simulator", "slices/s"], [list(row) for row in rows], [None, ",.1f"])
    print(markdown_table(stage_table) + "\n\n" + markdown_table(scan_table))
    print(
        f"\nsimulated {FIELD_OF_VIEW_MM:.0f} mm field of view -> {len(args.windows)} windows at "
        f"{args.img_size}x{args.img_size}, beam hardening {args.beam_hardening}\n"
    )
    print(markdown_table(simulator_table))
    if records is not None:
        figures = {"writer_mb_per_1000_slices": megabytes, "cohort_per_cpu_s": cohort["anatomy + scan, cpu"]}
        figures |= {f"scan_speedup_batch{batch}": rate["sampled"] / rate["matrix"] for batch, rate in scans}
        notes = {"torch_threads": 1, "workers": args.workers, "img_size": args.img_size, "windows": args.windows,
                 "field_of_view_mm": FIELD_OF_VIEW_MM, "beam_hardening": args.beam_hardening}  # fmt: skip
        write_record("simulator_throughput", figures, command=command_line("benchmarks.simulator_throughput", argv),
                     tables={"stages": stage_table, "scans": scan_table, "simulators": simulator_table},
                     seconds=time.perf_counter() - start, notes=notes, folder=records)  # fmt: skip


if __name__ == "__main__":
    main(records=RECORDS)
