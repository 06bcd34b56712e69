"""Slices per second from a folder of DICOM CT slices: plain pydicom reading against CTSliceDataModule's training
loader (vit_ct.data.io.reader + windows + resize to the model grid), with and without workers, with the in-memory cache
(first epoch, which fills it, against a cached epoch) and with the disk cache (filled by the manifest check).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pydicom
import torch

from benchmarks.ct_files import write_ct
from benchmarks.recording import RECORDS, command_line, markdown_table, table, write_record
from vit_ct.data.io.reader import load_ct_slice
from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.run.hardware import describe_machine

USAGE = """example:
  .venv/bin/python -m benchmarks.loader_throughput                  # 300 slices of 512 x 512: about a minute
  .venv/bin/python -m benchmarks.loader_throughput --n 1000 --workers 4 --img-size 224

Each row reads every slice once (the loader rows: one pass over the training split, no augmentation, so the
numbers measure reading and preprocessing). "cache, first epoch" includes filling the cache; the manifest check
(every file read by the loaders and hashed once, before the first epoch) is timed on its own row, and again on a later
run, when the verdicts come from its record. The disk cache's loader rows window each batch on the CPU, as a CPU run
does (on a GPU this happens on the GPU).
"""


def write_dicoms(folder: Path, n: int, size: int, seed: int = 0) -> list[Path]:
    """`n` int16 CT slices (stored = HU + 1024): a 'head' of brain and bone in air, with 5 HU noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size] - (size - 1) / 2
    r = np.hypot(yy, xx) / (size / 2)
    base = np.select([r < 0.72, r < 0.8], [35.0, 1000.0], -1000.0)
    paths = []
    for i in range(n):
        hu = base + rng.normal(0, 5, (size, size))
        path = write_ct(folder / f"slice{i:05d}.dcm", hu, f"P{i // 10:04d}")
        paths.append(path)
    return paths


def rate(n: int, seconds: float) -> float:
    return n / seconds


def time_loader(data: CTSliceDataModule, epochs: int = 1) -> list[float]:
    """Seconds per pass over the training loader."""
    loader = data.train_dataloader()
    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        for batch in loader:
            data.on_after_batch_transfer(batch, 0)  # the disk cache's batches are windowed here (no-op otherwise)
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None, records: Path | None = None) -> None:
    """Measure and print the table; with ``records`` (a folder) also write the record ``loader_throughput.json``."""
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=300, help="slices written")
    parser.add_argument("--size", type=int, default=512, help="rows and columns of each slice")
    parser.add_argument("--img-size", type=int, default=256, help="model grid side")
    parser.add_argument("--windows", nargs="+", default=["brain", "subdural", "bone"], help="HU windows (channels)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers of the worker rows")
    args = parser.parse_args(argv)
    begin = time.perf_counter()
    torch.set_num_threads(1)  # workers are processes; one thread each keeps the comparison fair on few cores

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        paths = write_dicoms(folder, args.n, args.size)
        lines = ["image,label,split"] + [f"{p.name},{i % 2},{'val' if i < 2 else 'train'}" for i, p in enumerate(paths)]
        (folder / "manifest.csv").write_text("\n".join(lines) + "\n")
        n_train = args.n - 2

        start = time.perf_counter()
        for p in paths[2:]:
            pydicom.dcmread(p).pixel_array  # noqa: B018 -- decode is the point
        rows = [("plain `pydicom.dcmread(p).pixel_array`, sequential", rate(n_train, time.perf_counter() - start))]

        start = time.perf_counter()
        for p in paths[2:]:
            load_ct_slice(p)
        rows.append(("`load_ct_slice` (HU, checks), sequential", rate(n_train, time.perf_counter() - start)))

        def datamodule(**kwargs) -> CTSliceDataModule:
            return CTSliceDataModule(
                str(folder / "manifest.csv"), windows=args.windows, img_size=args.img_size,
                batch_size=args.batch_size, augment=False, cache_dir=str(folder / "cache"), **kwargs,
            )  # fmt: skip

        data = datamodule(cache=False, num_workers=0)
        start = time.perf_counter()
        data.check("fit")
        rows.append(
            ("manifest check, first run (read, hash every file once)", rate(args.n, time.perf_counter() - start))
        )
        start = time.perf_counter()
        datamodule(cache=False, num_workers=0).check("fit")
        rows.append(("manifest check, later run (verdicts from its record)", rate(args.n, time.perf_counter() - start)))
        data.setup("fit")
        rows.append(("loader, no cache, 0 workers", rate(n_train, time_loader(data)[0])))

        data = datamodule(cache=False, num_workers=args.workers)
        data.setup("fit")
        rows.append((f"loader, no cache, {args.workers} workers", rate(n_train, min(time_loader(data, 2)))))

        data = datamodule(cache=True, num_workers=0)
        data.check("fit")  # not part of the epoch
        start = time.perf_counter()
        data.setup("fit")  # fills the cache
        _first, cached = time_loader(data, 2)
        rows.append(
            ("loader, cache, 0 workers: first epoch (fills it)", rate(n_train, time.perf_counter() - start - cached))
        )
        rows.append(("loader, cache, 0 workers: cached epoch", rate(n_train, cached)))

        data = datamodule(cache=True, num_workers=args.workers)
        data.setup("fit")
        rows.append((f"loader, cache, {args.workers} workers: cached epoch", rate(n_train, min(time_loader(data, 2)))))

        data = datamodule(cache="disk", num_workers=0)
        start = time.perf_counter()
        data.setup("fit")  # reads and preprocesses every slice once (the verdicts are in the record)
        rows.append(("disk cache: filling it (every slice read once)", rate(args.n, time.perf_counter() - start)))
        for workers in (0, args.workers):
            data = datamodule(cache="disk", num_workers=workers)
            data.setup("fit")
            rows.append((f"loader, disk cache, {workers} workers", rate(n_train, min(time_loader(data, 2)))))

    plain = rows[0][1]
    cpu = os.cpu_count()
    print(f"\n{args.n} DICOM slices {args.size}x{args.size} int16 -> {len(args.windows)} windows at "
          f"{args.img_size}x{args.img_size}, batch {args.batch_size}, {cpu} CPU cores, torch threads 1\n")  # fmt: skip
    print(f"measured on {describe_machine()}\n")
    results = table(["reading", "slices/s", "x plain pydicom"], [[name, value, value / plain] for name, value in rows],
                    [None, ",.0f", ".2f"])  # fmt: skip
    print(markdown_table(results))
    if records is not None:
        notes = {"slices": args.n, "size": args.size, "img_size": args.img_size, "windows": args.windows,
                 "batch_size": args.batch_size, "workers": args.workers, "torch_threads": 1}  # fmt: skip
        write_record("loader_throughput", {"plain_pydicom_per_s": plain}, tables={"reading": results},
                     command=command_line("benchmarks.loader_throughput", argv),
                     seconds=time.perf_counter() - begin, notes=notes, folder=records)  # fmt: skip


if __name__ == "__main__":
    main(records=RECORDS)
