"""RSNA 2019 at scale: an archive of RSNA's shape (512 x 512 int16 CT DICOM in several transfer syntaxes, copies of
simulated slices with new UIDs) and its multi-label manifest; then `vit-ct fit` from start to its first step on a
first run (check + preprocessing into the disk cache) and on a later run, slices/s of later epochs from the cache
beside plain pydicom reading and the uncached loader, the loader workers' memory, and the extrapolation to 750,000.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pydicom
import torch
from lightning.pytorch import Callback
from pydicom.uid import (
    DeflatedExplicitVRLittleEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    JPEG2000Lossless,
    RLELossless,
)

from benchmarks.ct_files import head_of

ROOT = Path(__file__).resolve().parents[1]
USAGE = """example:
  .venv/bin/python -m benchmarks.rsna_scale --folder /tmp/rsna_scale      # 20,000 slices (~9 GB): about 10 minutes
  .venv/bin/python -m benchmarks.rsna_scale --folder /tmp/rsna_scale --n 40000 --small 4000
  .venv/bin/python -m benchmarks.rsna_scale --folder /tmp/rsna_scale --rows startup --cache false  # the old path

The archive is kept in --folder for later calls (delete it afterwards: 20,000 slices take ~9 GB, the cache ~2.5 GB).
Start-up rows run the real `vit-ct fit` (configs/rsna_ich.yaml, a 2-block ViT at 256 x 256, 2 loader workers) on
the first --small rows and on all --n rows, so the difference between the two sizes gives the cost per slice.
"""
LABELS = ["epidural", "intraparenchymal", "intraventricular", "subarachnoid", "subdural", "any"]
# share of the archive's files per transfer syntax (an assumption: RSNA's files are mostly uncompressed)
SYNTAX_MIX = {
    ExplicitVRLittleEndian: 0.40,
    ImplicitVRLittleEndian: 0.40,
    RLELossless: 0.10,
    DeflatedExplicitVRLittleEndian: 0.05,
    JPEG2000Lossless: 0.05,
}
SLICES_PER_PATIENT = 32
_UID = "2.25.1" + "0" * 38  # a fixed-length placeholder, replaced per copy in the template's bytes
_PATIENT = "ID_00000000"


class FirstStep(Callback):
    """Benchmark probe: writes the wall-clock time at which the first training step starts to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            Path(self.path).write_text(str(time.time()))


def simulated_slices(n: int, folder: Path) -> list[Path]:
    """``n`` simulated 512 x 512 head slices at 0.45 mm as explicit-VR DICOM (the synthetic set's writer)."""
    from vit_ct.sim.phantom import PhantomConfig, sample_head, simulate_slices
    from vit_ct.sim.synthetic import write_dicom

    config = PhantomConfig(size=512, pixel_spacing_mm=0.45)
    rng = np.random.default_rng(0)
    paths = []
    for head in range(0, n, 6):
        for simulated in simulate_slices(rng, config, min(6, n - head), head=sample_head(rng)):
            path = folder / f"base{len(paths):03d}.dcm"
            uids = {name: pydicom.uid.generate_uid() for name in ("study", "series", "frame")}
            write_dicom(path, simulated, patient=_PATIENT, uids=uids, instance=len(paths) + 1, sop_uid=_UID)
            paths.append(path)
    return paths


def templates(bases: list[Path]) -> dict[str, list[bytes | pydicom.Dataset]]:
    """Per transfer syntax, each base slice encoded once: file bytes to patch, or (deflated) a dataset to save."""
    out = {}
    for syntax in SYNTAX_MIX:
        out[syntax] = []
        for path in bases:
            ds = pydicom.dcmread(path)
            if syntax in (RLELossless, JPEG2000Lossless):
                ds.compress(syntax, generate_instance_uid=False)  # the placeholder UID stays, to be replaced
            else:
                ds.file_meta.TransferSyntaxUID = syntax
            if syntax == DeflatedExplicitVRLittleEndian:  # compressed as a whole: saved per copy
                out[syntax].append(ds)
                continue
            with tempfile.TemporaryFile() as f:
                ds.save_as(f, enforce_file_format=True)
                f.seek(0)
                out[syntax].append(f.read())
    return out


def build_archive(folder: Path, n: int) -> Path:
    """``n`` slices under ``folder/stage_2_train`` (Kaggle's layout) and ``folder/rsna.csv``; kept for reuse."""
    manifest = folder / "rsna.csv"
    if manifest.exists() and len(manifest.read_text().splitlines()) == n + 1:
        return manifest
    images = folder / "stage_2_train"
    images.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        encoded = templates(simulated_slices(24, Path(tmp)))
    rng = np.random.default_rng(1)
    syntaxes = rng.choice(list(SYNTAX_MIX), size=n, p=list(SYNTAX_MIX.values()))
    lines = [",".join(["image", *LABELS, "patient_id"])]
    start = time.perf_counter()
    for i, syntax in enumerate(syntaxes):
        uid = f"2.25.{10**38 + uuid.uuid4().int % (9 * 10**38)}"  # as long as the placeholder, no leading 0
        patient = f"ID_{i // SLICES_PER_PATIENT:08x}"
        template = encoded[syntax][i % len(encoded[syntax])]
        name = f"ID_{i:09x}.dcm"
        if isinstance(template, pydicom.Dataset):
            template.SOPInstanceUID = template.file_meta.MediaStorageSOPInstanceUID = uid
            template.PatientID = patient
            template.save_as(images / name, enforce_file_format=True)
        else:
            copy = template.replace(_UID.encode(), uid.encode()).replace(_PATIENT.encode(), patient.encode())
            (images / name).write_bytes(copy)
        subtypes = (rng.random(5) < 0.05).astype(int)
        lines.append(",".join([f"stage_2_train/{name}", *map(str, subtypes), str(int(subtypes.any())), patient]))
        if (i + 1) % 5000 == 0:
            print(f"  {i + 1:,} files written ({time.perf_counter() - start:.0f} s)", flush=True)
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def plain_pydicom(manifest: Path, n: int) -> float:
    """Slices/s of ``pydicom.dcmread(p).pixel_array`` over the first ``n`` files, one process."""
    paths = [manifest.parent / line.split(",")[0] for line in manifest.read_text().splitlines()[1 : n + 1]]
    start = time.perf_counter()
    for path in paths:
        pydicom.dcmread(path).pixel_array  # noqa: B018 -- decoding is the point
    return len(paths) / (time.perf_counter() - start)


# `vit-ct fit` as its entry point runs it, stamping when its imports are done (they vary by seconds on a busy machine)
_FIT = """import sys, time
from pathlib import Path
from vit_ct.cli import main
Path(sys.argv[1]).write_text(str(time.time()))
main(sys.argv[2:])
"""


def fit_until_first_step(manifest: Path, cache: str, cache_dir: Path, workdir: Path) -> tuple[float, float]:
    """Seconds from starting `vit-ct fit` to the start of its first training step, and from its imports' end."""
    stamp, imported = workdir / "first_step.txt", workdir / "imported.txt"
    stamp.unlink(missing_ok=True)
    command = [
        sys.executable, "-c", _FIT, str(imported), "fit", "--config", str(ROOT / "configs" / "rsna_ich.yaml"),
        "--data.manifest", str(manifest), "--data.init_args.cache", cache, "--data.init_args.num_workers", "2",
        "--model.network.embed_dim", "32", "--model.network.depth", "2", "--model.network.num_heads", "2",
        "--trainer.max_steps", "1",
        "--trainer.limit_val_batches", "0", "--trainer.logger", "false", "--trainer.accelerator", "cpu",
        "--trainer.precision", "32-true", "--test_after_fit", "false",
        "--trainer.callbacks+=rsna_scale.FirstStep", "--trainer.callbacks.path", str(stamp),
    ]  # fmt: skip
    # The cache folder by environment, so that the same command runs on code without the cache_dir option.
    env = {**os.environ, "VIT_CT_CACHE_DIR": str(cache_dir), "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    start = time.time()
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    if result.returncode != 0 or not stamp.exists():
        raise RuntimeError(f"vit-ct fit failed:\n{result.stderr[-4000:]}")
    first_step = float(stamp.read_text())
    return first_step - start, first_step - float(imported.read_text())


def worker_memory_mib() -> list[tuple[float, float]]:
    """(private dirty, file-backed) resident MiB of each child process (the loader's workers), from /proc: what the
    worker alone holds (its own writes; pages shared copy-on-write with the parent are not), and the pages of files
    it maps (the memory-mapped cache: page cache, shared with every process that reads it, and reclaimable)."""
    out = []
    for pid in Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split():
        fields = {}
        for name in ("smaps_rollup", "status"):
            for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
                key, _, value = line.partition(":")
                fields[key] = value
        out.append(tuple(int(fields[k].split()[0]) / 1024 for k in ("Private_Dirty", "RssFile")))
    return out


def loader_rates(manifest: Path, *, cache, cache_dir: Path, workers: int, limit: int) -> tuple[dict, list]:
    """Slices/s over up to ``limit`` training slices after the first batch (which waits for the workers): the loader
    alone (what feeds a GPU, which windows the batches itself) and with the windows applied on the CPU (as a CPU run
    does), after a pass that starts the workers and fills the page cache; and the workers' memory after it."""
    from vit_ct.data.loading.datamodule import CTSliceDataModule

    data = CTSliceDataModule(
        str(manifest), label_columns=LABELS, windows=["brain", "subdural", "bone"], img_size=256, batch_size=64,
        num_workers=workers, augment=False, cache=cache, cache_dir=str(cache_dir),
    )  # fmt: skip
    data.setup("fit")
    loader = data.train_dataloader()
    rates = {}
    for name in ("warm-up", "loader", "windows on the CPU"):
        times, count, start = [], 0, time.perf_counter()
        for batch in loader:
            if name == "windows on the CPU":
                data.on_after_batch_transfer(batch, 0)
            count += len(batch["index"])
            times.append(time.perf_counter() - start)
            start = time.perf_counter()
            if count >= limit:
                break
        rates[name] = data.batch_size * (len(times) - 1) / float(np.sum(times[1:]))
    memory = worker_memory_mib() if workers else []
    del loader
    return rates, memory


def litdata_rates(manifest: Path, cache_dir: Path, workdir: Path, *, workers: int, limit: int) -> dict | None:
    """Slices/s of litdata's StreamingDataLoader over ``limit`` slices of the same cached HU, optimised into its
    shards, read in order and shuffled; None without litdata (not a dependency of vit-ct)."""
    try:
        import litdata
    except ImportError:
        return None
    from vit_ct.data.cache.slice_cache import SliceCache, cache_folder

    output = workdir / "litdata"
    shutil.rmtree(output, ignore_errors=True)
    store = SliceCache.for_grid(cache_folder(cache_dir, manifest), img_size=256,
                                read_options={"modalities": ["CT"], "stored_values_are_hu": False})  # fmt: skip
    slots = np.flatnonzero(store.done)[:limit]
    litdata.optimize(fn=_litdata_item, inputs=[(str(store.folder), int(s)) for s in slots],
                     output_dir=str(output), chunk_bytes="64MB", num_workers=2)  # fmt: skip
    rates = {}
    for shuffle in (False, True):
        loader = litdata.StreamingDataLoader(
            litdata.StreamingDataset(str(output), shuffle=shuffle), batch_size=64, num_workers=workers
        )
        for _ in range(2):  # the second pass counts
            times, start = [], time.perf_counter()
            for _batch in loader:
                times.append(time.perf_counter() - start)
                start = time.perf_counter()
            rates["shuffled" if shuffle else "in order"] = 64 * (len(times) - 1) / float(np.sum(times[1:]))
    return rates


def _litdata_item(source: tuple[str, int]) -> dict:
    folder, slot = source
    hu = np.memmap(Path(folder) / "hu.f16", dtype=np.float16, mode="r").reshape(-1, 256, 256)
    return {"hu": np.array(hu[slot]), "index": slot}


def main(records: Path | None = None) -> None:
    """Measure and print the tables; with ``records`` (a folder) also write the record ``rsna_scale.json`` there: the
    measured times and rates (its tables' 750,000-slice column is arithmetic on them, not a measurement)."""
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--folder", type=Path, required=True, help="where the archive, manifests and cache live")
    parser.add_argument("--n", type=int, default=20_000, help="slices in the archive")
    parser.add_argument("--small", type=int, default=2_000, help="slices of the smaller manifest")
    parser.add_argument("--rows", choices=["all", "startup", "later", "reading"], default="all",
                        help="later: only the later runs, on the cache an earlier call built")  # fmt: skip
    parser.add_argument("--cache", default="disk", help="data.cache of the start-up rows (false: the old path)")
    parser.add_argument("--repeats", type=int, default=3, help="later runs of each size (their median counts)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    manifest = build_archive(args.folder, args.n)
    size = sum(p.stat().st_size for p in (args.folder / "stage_2_train").iterdir()) / 1e9
    print(f"archive: {args.n:,} slices, {size:.1f} GB (built or found in {time.perf_counter() - start:.0f} s)")
    small = head_of(manifest, args.small, "rsna")
    cache_dir = args.folder / f"cache-{args.cache}"
    results_file = args.folder / f"results-{args.cache}.json"
    results: dict = {"n": args.n, "small": args.small, "cache": args.cache}
    runs = [("first", "small", small), ("first", "large", manifest)]
    runs += [
        ("later", name, path) for _ in range(args.repeats) for name, path in (("small", small), ("large", manifest))
    ]
    if args.rows in ("reading", "later"):  # rows of an earlier call, whose cache this one reads
        kept = ("first", "later") if args.rows == "reading" else ("first",)
        results.update({k: v for k, v in json.loads(results_file.read_text()).items() if k.startswith(kept)})
        runs = [run for run in runs if run[0] == "later"] if args.rows == "later" else []
    else:
        shutil.rmtree(cache_dir, ignore_errors=True)  # the first-run rows start from nothing
    for run, name, path in runs:  # later runs three times, alternating sizes: their median counts
        seconds = fit_until_first_step(path, args.cache, cache_dir, args.folder)
        results.setdefault(f"{run}_{name}", []).append(seconds)
        print(f"{run} run, {name} manifest: {seconds[0]:.1f} s to the first step, {seconds[1]:.1f} s after imports")
    if args.rows in ("all", "reading"):
        results["pydicom"] = plain_pydicom(manifest, 2_000)
        print(f"plain pydicom: {results['pydicom']:.0f} slices/s", flush=True)
        for workers in (0, 2):
            rates, memory = loader_rates(manifest, cache="disk", cache_dir=cache_dir, workers=workers, limit=6_400)
            results[f"disk_{workers}"], results[f"memory_{workers}"] = rates, memory
            print(f"disk cache, {workers} workers: {rates} slices/s; workers' MiB (anon, file) {memory}", flush=True)
        results["memory_small"] = loader_rates(small, cache="disk", cache_dir=cache_dir, workers=2, limit=1_280)[1]
        results["uncached_2"] = loader_rates(small, cache=False, cache_dir=cache_dir, workers=2, limit=640)[0]
        results["litdata_2"] = litdata_rates(manifest, cache_dir, args.folder, workers=2, limit=3_000)
        print(json.dumps(results, indent=1), flush=True)
    results_file.write_text(json.dumps(results, indent=1))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_tables(results)
    print(printed.getvalue())
    if records is not None:
        from benchmarks.recording import command_line, write_record

        write_record("rsna_scale", {}, command=command_line("benchmarks.rsna_scale"), notes={"results": results,
                     "tables_markdown": printed.getvalue().strip()}, seconds=time.perf_counter() - start,
                     folder=records)  # fmt: skip


def print_tables(r: dict) -> None:
    n, small, rest = r["n"], r["small"], 750_000 - r["small"]
    print(f"\n{n:,} slices (512 x 512 int16 DICOM), {os.cpu_count()} CPU cores\n")
    print(f"| `vit-ct fit` to its first step (cache {r['cache']}) | {small:,} slices | {n:,} slices |"
          " per slice (difference) | 750,000 slices |\n|---|---:|---:|---:|---:|")  # fmt: skip
    for run in ("first", "later"):
        for part, what in ((0, "from the command"), (1, "after its imports")):
            a = float(np.median([t[part] for t in r[f"{run}_small"]]))
            b = float(np.median([t[part] for t in r[f"{run}_large"]]))
            per = (b - a) / (n - small)
            print(f"| {run} run, {what} | {a:.1f} s | {b:.1f} s | {per * 1e3:.3f} ms |"
                  f" {a + per * rest:,.0f} s = {a:.1f} s + {per * 1e3:.3f} ms x {rest:,} |")  # fmt: skip
    if "pydicom" not in r:
        return
    plain = r["pydicom"]
    print("\n| reading | slices/s | x plain pydicom |\n|---|---:|---:|")
    rows = [("plain `pydicom.dcmread(p).pixel_array`, 1 process (total time)", plain),
            ("loader, no cache (the RSNA recipe before), 2 workers", r["uncached_2"]["loader"])]  # fmt: skip
    for w in (0, 2):
        rows.append((f"loader, disk cache, {w} workers (batches as they reach a GPU)", r[f"disk_{w}"]["loader"]))
        rows.append(
            (f"loader, disk cache, {w} workers, windows applied on the CPU", r[f"disk_{w}"]["windows on the CPU"])
        )
    for order, value in (r.get("litdata_2") or {}).items():
        rows.append((f"litdata `StreamingDataLoader` over the same HU ({order}), 2 workers", value))
    for name, value in rows:
        print(f"| {name} | {value:,.0f} | {value / plain:.1f} |")
    print("\n| loader workers' resident memory (MiB: private dirty / file-backed, shared) | "
          f"{small:,} slices | {n:,} slices |\n|---|---:|---:|")  # fmt: skip
    for i, (a, b) in enumerate(zip(r["memory_small"], r["memory_2"], strict=False)):
        print(f"| worker {i} | {a[0]:.0f} / {a[1]:.0f} | {b[0]:.0f} / {b[1]:.0f} |")


if __name__ == "__main__":
    from benchmarks.recording import RECORDS

    main(records=RECORDS)
