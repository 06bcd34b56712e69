"""Start-up of a run on your own manifest, by cache mode: `CTSliceDataModule.setup("fit")` (read the manifest, check
its files, split, fill the cache) on a first run (empty cache folder) and on later runs, at two manifest sizes, so
that the difference gives the cost per slice; each in a fresh process, alternating sizes, medians of the repeats.
With ``--baseline REV`` the same rows for the code of another commit, measured side by side in this run. Then what
the disk cache's per-batch checksum costs beside the gather.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.ct_files import ct_dataset, head_of

ROOT = Path(__file__).resolve().parents[1]
USAGE = """example:
  .venv/bin/python -m benchmarks.startup_cache --folder /tmp/startup              # 12,000 slices (6.3 GB): ~30 min
  .venv/bin/python -m benchmarks.startup_cache --folder /tmp/startup --baseline 21b1848   # and that commit's code

The slices (512 x 512 int16 CT DICOM as RSNA's, or --format npy; a lesion mask on every third, 8 per patient, no
split column) are kept in --folder for later calls (delete it afterwards); the caches are rebuilt for each call. The
record goes to benchmarks/records/startup_cache.json.
"""
MODES = {"memory": "true", "disk": "disk"}  # row name: data.cache

# One run's start-up, as a fresh process does it: imports, then the data module's setup for `fit`.
_SETUP = """import json, sys, time
start = time.perf_counter()
from vit_ct.data.loading.datamodule import CTSliceDataModule
imported = time.perf_counter()
manifest, cache, cache_dir, img_size = sys.argv[1:5]
data = CTSliceDataModule(manifest, cache={"true": True, "false": False}.get(cache, cache), cache_dir=cache_dir,
                         img_size=int(img_size), num_workers=0)
data.setup("fit")
done = time.perf_counter()
print(json.dumps({"imports": imported - start, "setup": done - imported, "read": data.check_record.added}))
"""


def dicom_writer(size: int):
    """A function writing ``(size, size)`` HU as an uncompressed CT DICOM (int16, HU + 1024 stored, 0.45 mm
    pixels, as RSNA's files): a header made once, then the pixels after it."""
    import io

    ds = ct_dataset(np.zeros((size, size)), "benchmark", PixelSpacing=[0.45, 0.45])
    buffer = io.BytesIO()
    ds.save_as(buffer, enforce_file_format=True)
    header = buffer.getvalue()[: -size * size * 2]  # PixelData is the last element: its value ends the file

    def write(path: Path, hu: np.ndarray) -> None:
        path.write_bytes(header + np.clip(hu + 1024, -32768, 32767).astype("<i2").tobytes())

    return write


def build_set(folder: Path, n: int, size: int, kind: str) -> Path:
    """``n`` slices under ``folder/slices`` and ``folder/manifest.csv``; kept for reuse."""
    manifest = folder / "manifest.csv"
    if manifest.exists() and len(manifest.read_text().splitlines()) == n + 1:
        return manifest
    write_dicom = dicom_writer(size) if kind == "dicom" else None
    slices = folder / "slices"
    slices.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[:size, :size] - (size - 1) / 2
    head = np.hypot(yy, xx) < 0.42 * size
    lines = ["image,label,patient_id,mask"]
    for i in range(n):
        hu = np.where(head, 35.0, -1000.0) + rng.normal(0, 8, (size, size))
        mask = ""
        if i % 3 == 0:
            lesion = np.hypot(yy - rng.integers(-10, 10), xx - rng.integers(-10, 10)) < size / 10
            hu[lesion] = 70.0
            np.save(slices / f"m{i:06d}.npy", lesion.astype(np.uint8))
            mask = f"slices/m{i:06d}.npy"
        name = f"s{i:06d}.{'dcm' if write_dicom else 'npy'}"
        if write_dicom:
            write_dicom(slices / name, hu)
        else:
            np.save(slices / name, hu.astype(np.float32))
        lines.append(f"slices/{name},{int(i % 3 == 0)},p{i // 8:06d},{mask}")
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def code_of(rev: str, folder: Path) -> Path:
    """The package as it was at ``rev`` (git archive: the checkout and its metadata are left alone)."""
    target = folder / f"code-{rev}"
    if not (target / "vit_ct").is_dir():
        with tempfile.TemporaryFile() as archive:
            subprocess.run(["git", "archive", rev, "vit_ct"], cwd=ROOT, stdout=archive, check=True)
            archive.seek(0)
            with tarfile.open(fileobj=archive) as tar:
                tar.extractall(target, filter="data")
    return target


def setup_seconds(code: Path, manifest: Path, cache: str, cache_dir: Path, img_size: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code)}
    result = subprocess.run([sys.executable, "-c", _SETUP, str(manifest), cache, str(cache_dir), str(img_size)],
                            env=env, capture_output=True, text=True)  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"setup failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def startup_rows(code: Path, small: Path, large: Path, *, cache: str, cache_dir: Path, img_size: int, repeats: int):
    """{"first"|"later": {"small"|"large": [setup seconds, ...]}} from an empty cache folder."""
    shutil.rmtree(cache_dir, ignore_errors=True)
    rows = {"first": {}, "later": {}}
    runs = [("first", "small", small), ("first", "large", large)]
    runs += [("later", name, path) for _ in range(repeats) for name, path in (("small", small), ("large", large))]
    rows["load_average"] = []  # 1-minute load average before each run: others' work on shared cores
    for run, name, path in runs:
        rows["load_average"].append(round(os.getloadavg()[0], 2))
        seconds = setup_seconds(code, path, cache, cache_dir, img_size)
        rows[run].setdefault(name, []).append(seconds["setup"])
        print(f"  {run} run, {name}: {seconds['setup']:.2f} s setup ({seconds['read']} files read)", flush=True)
    return rows


def per_slice(rows: dict, n_small: int, n_large: int) -> dict:
    """Medians, and the cost per slice from the difference of the two sizes (start-up costs that do not grow with
    the manifest cancel)."""
    out = {}
    for run in ("first", "later"):
        small, large = (float(np.median(rows[run][k])) for k in ("small", "large"))
        fastest = min(rows[run]["large"])  # the repeat least slowed by others' work on shared cores
        out[run] = {"small_s": small, "large_s": large, "ms_per_slice": (large - small) / (n_large - n_small) * 1e3,
                    "ms_per_slice_whole": large / n_large * 1e3, "ms_per_slice_fastest": fastest / n_large * 1e3,
                    "runs_s": rows[run]}  # fmt: skip
    out["load_average"] = rows["load_average"]
    return out


def checksum_cost(folder: Path, *, img_size: int = 256, n_slots: int = 1024, batch: int = 64, repeats: int = 30):
    """ms per batch of the disk cache's gather alone and with its checksums verified, random slots of a float16
    cache at ``img_size`` (the gathered pages in the page cache, as in a later epoch)."""
    from vit_ct.data.cache.check_record import FileStat
    from vit_ct.data.cache.slice_cache import SliceCache, SlotInfo, SlotKey

    shutil.rmtree(folder, ignore_errors=True)
    cache = SliceCache(folder, img_size=img_size)
    keys = [SlotKey(f"s{i}", None, FileStat(1, 1), None, None) for i in range(n_slots)]
    slots, mask_slots = cache.allocate(keys)
    rng = np.random.default_rng(0)
    written = []
    for slot, mask_slot in zip(slots, mask_slots, strict=True):
        checksum = cache.write(int(slot), int(mask_slot), rng.normal(0, 300, (img_size, img_size)).astype(np.float32),
                               None)  # fmt: skip
        written.append((int(slot), SlotInfo((img_size, img_size), None, checksum)))
    cache.commit(written)
    hu_map, _ = cache._open()
    times = {"gather": [], "gather + checksums": []}
    for _ in range(repeats):
        chosen = rng.choice(n_slots, batch, replace=False)
        start = time.perf_counter()
        hu_map[chosen]  # noqa: B018 -- the gather is the point
        times["gather"].append(time.perf_counter() - start)
        start = time.perf_counter()
        cache.batch(chosen)
        times["gather + checksums"].append(time.perf_counter() - start)
    cache.close()
    shutil.rmtree(folder, ignore_errors=True)
    return {name: float(np.median(values)) * 1e3 for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, epilog=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--folder", type=Path, required=True, help="where the slices, manifests and caches live")
    parser.add_argument("--n", type=int, default=12_000, help="slices of the larger manifest")
    parser.add_argument("--small", type=int, default=2_000, help="slices of the smaller manifest")
    parser.add_argument("--slice_size", type=int, default=512, help="rows and columns of each slice")
    parser.add_argument("--format", choices=["dicom", "npy"], default="dicom", help="how the slices are stored")
    parser.add_argument("--img_size", type=int, default=192, help="data.img_size (192: the own-data configs')")
    parser.add_argument("--repeats", type=int, default=3, help="later runs of each size (their median counts)")
    parser.add_argument("--baseline", help="also measure the code of this git revision, side by side")
    parser.add_argument("--records", type=Path, default=ROOT / "benchmarks" / "records")
    args = parser.parse_args()
    begin = time.perf_counter()
    from benchmarks.recording import command_line, git_state, markdown_table, table, write_record

    git = git_state()
    args.folder.mkdir(parents=True, exist_ok=True)
    large = build_set(args.folder, args.n, args.slice_size, args.format)
    small = head_of(large, args.small)
    codes = {"this code": ROOT}
    if args.baseline:
        codes[f"code of {args.baseline}"] = code_of(args.baseline, args.folder)
    figures, runs, rows = {}, {}, []  # figures: flat names the docs refer to; runs: every run's seconds
    for label, code in codes.items():
        for mode, cache in MODES.items():
            print(f"{label}, cache {mode}:", flush=True)
            found = startup_rows(code, small, large, cache=cache, cache_dir=args.folder / f"cache-{mode}",
                                 img_size=args.img_size, repeats=args.repeats)  # fmt: skip
            result = per_slice(found, args.small, args.n)
            key = f"{'baseline' if code != ROOT else 'now'}_{mode}"
            runs[key] = {run: result[run].pop("runs_s") for run in ("first", "later")}
            runs[key]["load_average"] = result.pop("load_average")
            for run in ("first", "later"):
                r = result[run]
                figures.update({f"{key}_{run}_{name}": value for name, value in r.items()})
                rows.append([label, f"`cache: {cache}`", f"{run} run", r["small_s"], r["large_s"], r["ms_per_slice"],
                             r["ms_per_slice_whole"], r["ms_per_slice_fastest"]])  # fmt: skip
    costs = checksum_cost(args.folder / "checksum-cache")
    figures.update(checksum_gather_ms=costs["gather"], checksum_verified_ms=costs["gather + checksums"])
    startup = table(
        ["code", "data.cache", "run", f"{args.small:,} slices (s)", f"{args.n:,} slices (s)",
         "ms a slice (difference)", f"ms a slice (all {args.n:,})", f"ms a slice (fastest at {args.n:,})"],
        rows, [None, None, None, ".2f", ".2f", ".3f", ".3f", ".3f"],
    )  # fmt: skip
    checksums = table(
        ["a batch of 64 random slots, 256 x 256 float16, from the page cache", "ms"],
        [[name, value] for name, value in costs.items()], [None, ".2f"],
    )  # fmt: skip
    print("\n" + markdown_table(startup) + "\n\n" + markdown_table(checksums))
    write_record(
        "startup_cache", figures, command=command_line("benchmarks.startup_cache"),
        tables={"startup": startup, "checksums": checksums}, seconds=time.perf_counter() - begin, git=git,
        notes={"slices": f"{args.slice_size} x {args.slice_size} {args.format} in HU (DICOM: int16 uncompressed), a"
                         " .npy mask on every third, 8 per patient, no split",
               "img_size": args.img_size, "what": "CTSliceDataModule.setup('fit') in a fresh process, after imports",
               "baseline": args.baseline, "runs_s": runs},
        folder=args.records,
    )  # fmt: skip


if __name__ == "__main__":
    main()
