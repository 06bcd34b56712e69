"""Slices per second of the on-the-fly simulator (vit_ct.sim.simulator): anatomy + scan + windows + resize to the model
grid, per worker (one process, one torch thread, as in a DataLoader worker) at several slice sizes and heads per
batch, and through a DataLoader with several workers. Prints a markdown table; ~2 minutes on 2 cores:

    .venv/bin/python benchmarks/simulator_throughput.py [--sizes 128 256] [--seconds 8] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from vit_ct.run.hardware import describe_machine
from vit_ct.sim.phantom import PhantomConfig
from vit_ct.sim.simulator import SimulatedSliceStream, StreamLoader

FIELD_OF_VIEW_MM = 230.0


def stream(size: int, args, *, epoch_size: int, slices_per_head: int = 1) -> SimulatedSliceStream:
    return SimulatedSliceStream(
        config=PhantomConfig(size=size, pixel_spacing_mm=FIELD_OF_VIEW_MM / size, beam_hardening=args.beam_hardening),
        windows=args.windows,
        img_size=args.img_size,
        epoch_size=epoch_size,
        batch_size=args.batch_size,
        slices_per_head=slices_per_head,
    )


def per_worker_rate(size: int, slices_per_head: int, args) -> float:
    """Slices/s of one process for about ``args.seconds``, after one warm-up batch (geometry caches)."""
    source = stream(size, args, epoch_size=10**6, slices_per_head=slices_per_head)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 256], help="simulated slice sizes, pixels")
    parser.add_argument("--img-size", type=int, default=128, help="model grid side")
    parser.add_argument("--windows", nargs="+", default=["brain", "subdural"], help="HU windows (channels)")
    parser.add_argument("--heads", type=int, nargs="+", default=[1, 4], help="slices per head (one scan batch)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=8.0, help="timing per per-worker row")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers of the loader rows (0: skip)")
    parser.add_argument("--loader-batches", type=int, default=3, help="batches per worker in the loader rows")
    parser.add_argument("--beam-hardening", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # what a DataLoader worker gets

    rows = []
    for size in args.sizes:
        for heads in args.heads:
            rows.append((f"{size} px, 1 process, {heads} slice(s) per head", per_worker_rate(size, heads, args)))
        if args.workers:
            rows.append((f"{size} px, StreamLoader, {args.workers} workers", loader_rate(size, args)))

    print(
        f"\nsimulated {FIELD_OF_VIEW_MM:.0f} mm field of view -> {len(args.windows)} windows at "
        f"{args.img_size}x{args.img_size}, beam hardening {args.beam_hardening}, {os.cpu_count()} CPU cores, "
        f"torch threads 1 per process\n"
    )
    print(f"measured on {describe_machine()}\n")
    print("| simulator | slices/s |")
    print("|---|---:|")
    for name, value in rows:
        print(f"| {name} | {value:,.1f} |")


if __name__ == "__main__":
    main()
