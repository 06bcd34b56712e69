"""Peak memory of training from scan labels beside slice labels, on one large manifest: the same slices listed twice,
once with a label per slice (``label``) and once with one label per scan only (``scan_label``, multiple-instance
learning, :mod:`vit_ct.task.scan_bags`), each trained by the installed ``vit-ct fit`` in a fresh process, the two
alternated, at each ``data.cache``. Each process's peak resident memory is its own ``VmHWM`` as it ends, and a probe
inside the run reports the largest batch, the most slices of one scan in a batch, the scans cut across batches and
the scan-bag memory's size, so that the record shows whether a scan is ever held whole beyond one batch.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from lightning.pytorch import Callback

ROOT = Path(__file__).resolve().parents[1]
VIT_CT = str(Path(sys.executable).with_name("vit-ct"))
USAGE = """example:
  flock /tmp/team/training.lock .venv/bin/python -m benchmarks.scan_memory     # 100,000 slices in 3,000 scans

The slices (32 x 32 float32 HU .npy, distinct, in one folder per scan) and both manifests are built once under
--root and reused; the runs' folders there are replaced on each call. The record goes to
benchmarks/records/scan_memory.json.
"""
KINDS = ("slice", "scan")  # manifest_<kind>.csv: slice labels (`label`), scan labels only (`scan_label`)
LAYOUT = 2  # of the set's files and manifests: a set built by other code is rebuilt
FIELD_MM = 230.0  # a head CT's field of view: the slices' pixel spacing is FIELD_MM / size


def peak_resident_kib() -> int:
    """This process's largest resident set in KiB: ``VmHWM``, the peak of its own memory since it started. Not
    ``ru_maxrss`` (nor ``wait4``'s): on Linux a child starts from its parent's high-water mark, so a run smaller than
    this benchmark's own process would read the benchmark's peak. ``ru_maxrss`` only where there is no ``/proc``."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def write_peak_at_exit(path: Path) -> None:
    """At this process's end (a return or ``sys.exit``), its :func:`peak_resident_kib` into ``path``."""
    atexit.register(lambda: Path(path).write_text(str(peak_resident_kib())))


class MemoryProbe(Callback):
    """Inside a `vit-ct fit` (``--trainer.callbacks+=scan_memory.MemoryProbe``, benchmarks/ on PYTHONPATH): what one
    training batch held and what the scan-bag memory holds, written to ``path`` (JSON) when training ends."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        write_peak_at_exit(self.path.with_suffix(".peak"))  # the whole run's, final validation and summary included
        self.largest_batch = self.most_of_one_scan = self.batches = 0
        self.batches_of_scan: dict[tuple[int, int], set[int]] = {}  # (epoch, scan) -> the steps holding its slices

    def on_train_start(self, trainer, pl_module) -> None:
        self.peak_before_kib = peak_resident_kib()  # setup, data read and cached

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(batch["index"]))
        scans = batch.get("scan")
        if scans is None:  # slice labels: the batch names no scan
            return
        ids, counts = np.unique(scans.cpu().numpy(), return_counts=True)
        self.most_of_one_scan = max(self.most_of_one_scan, int(counts.max()))
        for scan in ids.tolist():
            self.batches_of_scan.setdefault((trainer.current_epoch, scan), set()).add(trainer.global_step)

    def on_train_end(self, trainer, pl_module) -> None:
        memory = pl_module.scan_bags.memory
        held = [t for t in (memory.evidence, memory.scans) if t is not None]
        cut = {scan for (_, scan), steps in self.batches_of_scan.items() if len(steps) > 1}  # in some epoch
        record = {
            "peak_before_training_kib": self.peak_before_kib,
            "peak_after_training_kib": peak_resident_kib(),
            "training_rows": len(trainer.train_dataloader.dataset),
            "batches": self.batches, "largest_batch": self.largest_batch, "most_of_one_scan": self.most_of_one_scan,
            "scans_trained": len({scan for _, scan in self.batches_of_scan}),
            "scans_cut_across_batches": len(cut),
            "scan_memory_rows": 0 if memory.evidence is None else len(memory.evidence),
            "scan_memory_columns": 0 if memory.evidence is None else memory.evidence.shape[1],
            "scan_memory_bytes": sum(t.element_size() * t.nelement() for t in held),
        }  # fmt: skip
        self.path.write_text(json.dumps(record))


def scan_lengths(n: int, scans: int, shortest: int, longest: int, seed: int = 0) -> np.ndarray:
    """``(scans,)`` slices per scan, each in ``[shortest, longest]``, summing to ``n``: spread over the whole range
    (a beta distribution with the mean ``n / scans``, as series of thick and thin slices mix in an archive), then
    evened out one slice at a time on scans that stay in range."""
    if not 1 <= shortest <= longest or not shortest * scans <= n <= longest * scans:
        raise ValueError(f"--n {n} slices cannot be --scans {scans} scans of {shortest} to {longest} slices each")
    rng = np.random.default_rng(seed)
    mean = (n / scans - shortest) / max(longest - shortest, 1)  # in [0, 1]
    spread = rng.beta(max(2 * mean, 0.05), max(2 * (1 - mean), 0.05), scans) if 0 < mean < 1 else np.full(scans, mean)
    lengths = np.round(shortest + spread * (longest - shortest)).astype(np.int64)
    while (gap := n - int(lengths.sum())) != 0:
        room = np.flatnonzero(lengths < longest) if gap > 0 else np.flatnonzero(lengths > shortest)
        chosen = rng.choice(room, min(abs(gap), len(room)), replace=False)
        lengths[chosen] += 1 if gap > 0 else -1
    return lengths


def scan_slices(length: int, size: int, rng: np.random.Generator, bleed: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(length, size, size)`` float32 HU of one head from base to vertex (brain 35 HU, a 1000 HU skull, noise
    8 HU: every slice distinct) and ``(length,)`` its slice labels: with ``bleed``, a 70 HU bleed on a run of
    slices."""
    yy, xx = np.mgrid[:size, :size] - (size - 1) / 2
    radius = np.hypot(yy, xx)
    z = (np.arange(length) + 0.5) / length * 2 - 1  # -1 (base) .. 1 (vertex)
    head = 0.44 * size * np.sqrt(np.clip(1 - (0.9 * z) ** 2, 0.1, 1))[:, None, None]  # (length, 1, 1)
    hu = np.where(radius < head - 1.5, 35.0, np.where(radius < head, 1000.0, -1000.0))
    hu = hu + rng.normal(0, 8, (length, size, size))
    labels = np.zeros(length, np.int64)
    if bleed:
        run = max(1, int(length * rng.uniform(0.1, 0.4)))
        start = int(rng.integers(length // 4, max(length // 4 + 1, length - run - length // 8)))
        labels[start : start + run] = 1
        cy, cx = rng.uniform(-0.15, 0.15, 2) * size
        hu[labels == 1] = np.where(np.hypot(yy - cy, xx - cx) < size / 10, 70.0, hu[labels == 1])
    return hu.astype(np.float32), labels


def build_set(root: Path, lengths: np.ndarray, *, size: int, bleed_fraction: float, seed: int = 0) -> dict[str, Path]:
    """The slices under ``root/slices/<scan>/`` and the two manifests ``root/manifest_<kind>.csv`` (the same rows);
    kept for reuse while ``root/set.json`` says they were built with these settings (written last)."""
    settings = {"layout": LAYOUT, "lengths": lengths.tolist(), "size": size, "bleed_fraction": bleed_fraction}
    settings["seed"] = seed
    manifests = {kind: root / f"manifest_{kind}.csv" for kind in KINDS}
    stamp = root / "set.json"
    if stamp.exists() and json.loads(stamp.read_text()) == settings and all(p.exists() for p in manifests.values()):
        return manifests
    stamp.unlink(missing_ok=True)
    shutil.rmtree(root / "slices", ignore_errors=True)
    rng = np.random.default_rng(seed)
    spacing = FIELD_MM / size
    rows = {kind: [f"image,{kind}_label,scan,patient_id,pixel_spacing_mm".replace("slice_label", "label")]
            for kind in KINDS}  # fmt: skip
    bleeding = rng.permutation(len(lengths)) < round(bleed_fraction * len(lengths))  # that share of scans, exactly
    for s, length in enumerate(lengths.tolist()):
        folder = root / "slices" / f"scan{s:05d}"
        folder.mkdir(parents=True)
        hu, labels = scan_slices(length, size, rng, bleed=bool(bleeding[s]))
        for i in range(length):
            np.save(folder / f"{i:03d}.npy", hu[i])
            where = f"slices/scan{s:05d}/{i:03d}.npy"
            rows["slice"].append(f"{where},{labels[i]},scan{s:05d},p{s:05d},{spacing:.3f}")
            rows["scan"].append(f"{where},{labels.max()},scan{s:05d},p{s:05d},{spacing:.3f}")
    for kind, path in manifests.items():
        path.write_text("\n".join(rows[kind]) + "\n")
    stamp.write_text(json.dumps(settings))
    return manifests


def peak_of(
    command: list[str], *, cwd: Path, env: dict, log: Path, timeout: float, peak: Path
) -> tuple[int, int, float]:
    """Run ``command``; its exit status, its peak resident memory (KiB: what the process wrote into ``peak`` as it
    ended, :func:`write_peak_at_exit`; for a failed run that wrote none, ``wait4``'s, an upper bound) and its
    wall-clock seconds.

    Raises:
        RuntimeError: the process succeeded without writing ``peak`` (its own peak is then unknown).
    """
    peak.unlink(missing_ok=True)
    start = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        timer = threading.Timer(timeout, process.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)
        finally:
            timer.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    if process.returncode == 0 and not peak.is_file():
        raise RuntimeError(f"{command[0]} ended without writing its peak memory into {peak}")
    own = int(peak.read_text()) if peak.is_file() else usage.ru_maxrss
    return process.returncode, own, time.perf_counter() - start


def fit_command(manifest: Path, probe: Path, *, cache: str, args: argparse.Namespace) -> list[str]:
    """`vit-ct fit` by the own-data recipe (configs/finetune.yaml, from scratch: no start weights, so no anchor to
    hold the rollout to) on a tiny model."""
    return [
        VIT_CT, "fit", "--config", str(ROOT / "configs" / "finetune.yaml"), "--data.manifest", str(manifest),
        "--model.pretrained", "null", "--model.losses.anchor_loss_weight", "0",
        "--model.network.embed_dim", "32", "--model.network.depth", "2", "--model.network.num_heads", "2",
        "--data.init_args.img_size", str(args.size), "--data.init_args.windows", "[brain]",
        "--data.init_args.batch_size", str(args.batch_size), "--data.init_args.num_workers", "0",
        "--data.init_args.cache", cache, "--trainer.logger", "false", "--trainer.accelerator", "cpu",
        "--trainer.max_epochs", str(args.epochs), "--trainer.check_val_every_n_epoch", "1",
        "--trainer.limit_train_batches", str(args.train_batches), "--trainer.limit_val_batches", str(args.val_batches),
        "--model.optimisation.warmup_epochs", "0", "--test_after_fit", "false",
        "--trainer.callbacks+=scan_memory.MemoryProbe", "--trainer.callbacks.path", str(probe),
    ]  # fmt: skip


# The pre-run check of a manifest alone (every file read, its verdicts kept for the runs): out of the measured runs,
# so that both kinds start from a kept check record, and its own peak beside them.
_CHECK = """import sys
from pathlib import Path
from scan_memory import write_peak_at_exit
from vit_ct.data.loading.datamodule import CTSliceDataModule
write_peak_at_exit(Path(sys.argv[3]))
CTSliceDataModule(sys.argv[1], cache=False, img_size=int(sys.argv[2]), num_workers=0).setup("fit")
"""


def limit(text: str) -> int | float:
    """A Lightning batch limit as typed: ``40`` batches, or ``0.5`` (a fraction) of the epoch."""
    return float(text) if "." in text else int(text)


def mib(kib: float) -> float:
    return kib / 1024


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, epilog=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--root", type=Path, default=ROOT / "data" / "scan_memory", help="where the set and runs live")
    parser.add_argument("--n", type=int, default=100_000, help="slices in all")
    parser.add_argument("--scans", type=int, default=3_000, help="scans (one patient each) they make")
    parser.add_argument("--shortest", type=int, default=10, help="fewest slices of a scan")
    parser.add_argument("--longest", type=int, default=80, help="most slices of a scan")
    parser.add_argument("--size", type=int, default=32, help="rows and columns of a slice, and data.img_size")
    parser.add_argument("--bleed_fraction", type=float, default=0.35, help="share of scans with a bleed")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2, help="trainer.max_epochs")
    # 100 batches an epoch: a few minutes a run on 2 shared cores (a whole epoch of 70,000 slices took over 12);
    # the batches' scans come from anywhere in the split, so the scan-bag memory reaches its full size at once
    parser.add_argument("--train_batches", type=limit, default=100, help="trainer.limit_train_batches")
    parser.add_argument("--val_batches", type=limit, default=20, help="trainer.limit_val_batches")
    parser.add_argument("--cache", nargs="+", default=["false", "true"], choices=["false", "true"],
                        help="data.cache of the runs (true: every slice in memory)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1, help="runs of each kind and cache, alternated")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    parser.add_argument("--records", type=Path, default=ROOT / "benchmarks" / "records")
    args = parser.parse_args(argv)
    begin = time.perf_counter()
    from benchmarks.recording import command_line, git_state, markdown_table, write_record

    git = git_state()
    lengths = scan_lengths(args.n, args.scans, args.shortest, args.longest)
    args.root.mkdir(parents=True, exist_ok=True)
    manifests = build_set(args.root, lengths, size=args.size, bleed_fraction=args.bleed_fraction)
    built = time.perf_counter()
    print(f"set: {args.n:,} slices in {args.scans:,} scans under {args.root} ({built - begin:.0f} s)", flush=True)
    path = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")]))  # the probe
    env = {**os.environ, "VIT_CT_CACHE_DIR": str(args.root / "vit-ct-cache"), "WANDB_MODE": "offline"}
    env["PYTHONPATH"] = path
    figures = {
        "n_slices": args.n,
        "n_scans": args.scans,
        "batch_size": args.batch_size,
        "longest_scan": int(lengths.max()),
        "scans_longer_than_batch": int((lengths > args.batch_size).sum()),
    }
    runs_dir = args.root / "runs"
    shutil.rmtree(runs_dir, ignore_errors=True)
    runs_dir.mkdir()
    figures.update(check_manifests(manifests, runs_dir, env=env, args=args))
    runs = fit_runs(manifests, runs_dir, env=env, args=args)
    summary, peaks = summarise(runs, args.cache)
    figures.update(summary)
    print("\n" + markdown_table(peaks))
    write_record(
        "scan_memory", figures, command=command_line("benchmarks.scan_memory", argv), tables={"peaks": peaks},
        seconds=time.perf_counter() - begin, git=git, folder=args.records,
        notes={"slices": f"{args.size} x {args.size} float32 HU .npy, distinct (8 HU noise), {args.shortest} to"
                         f" {args.longest} a scan, one patient a scan, no split column",
               "fit": f"configs/finetune.yaml from scratch, a 2-block ViT of width 32 at {args.size} px, [brain],"
                      f" batch {args.batch_size}, {args.epochs} epochs of {args.train_batches} training batches (a"
                      f" float: that fraction of the epoch) and {args.val_batches} validation batches, no workers",
               "peak": "VmHWM of each `vit-ct fit` process as it ends: its own largest resident set over the whole run"
                       " (with the final validation and summary after training); at training's start and end: the"
                       " same, read inside the run at Lightning's on_train_start (after setup, the check and any"
                       " cache) and on_train_end",
               "scan_memory": "ScanMemory: (N, K) float32 evidence and (N,) int64 scans for the N training rows,"
                              " K = 2 (the classifier's and the patches' pooled evidence: the recipe's patch head)",
               "runs": runs},
    )  # fmt: skip
    return figures


def check_manifests(manifests: dict[str, Path], runs_dir: Path, *, env: dict, args: argparse.Namespace) -> dict:
    """Each manifest's pre-run check in a process of its own: its seconds and peak (MiB)."""
    figures = {}
    for kind, manifest in manifests.items():
        log = runs_dir / f"check_{kind}.log"
        own = runs_dir / f"check_{kind}.peak"
        status, peak, seconds = peak_of([sys.executable, "-c", _CHECK, str(manifest), str(args.size), str(own)],
                                        cwd=args.root, env=env, log=log, timeout=args.timeout, peak=own)  # fmt: skip
        if status != 0:
            raise RuntimeError(f"the check of {manifest} failed (exit {status}): {log.read_text()[-3000:]}")
        figures.update({f"check_{kind}_peak_mib": mib(peak), f"check_{kind}_s": seconds})
        print(f"  check of the {kind}-label manifest: {seconds:.0f} s, peak {mib(peak):.0f} MiB", flush=True)
    return figures


def fit_runs(manifests: dict[str, Path], runs_dir: Path, *, env: dict, args: argparse.Namespace) -> list[dict]:
    """Every `vit-ct fit`, the kinds alternated: per run its settings, exit status, peak (KiB), seconds, probe."""
    runs = []
    for repeat in range(args.repeats):
        for c, cache in enumerate(args.cache):
            for kind in KINDS if (repeat + c) % 2 == 0 else KINDS[::-1]:  # neither kind always goes first
                folder = runs_dir / f"{kind}_cache-{cache}_{repeat}"
                folder.mkdir()
                probe = folder / "probe.json"
                command = fit_command(manifests[kind], probe, cache=cache, args=args)
                status, peak, seconds = peak_of(command, cwd=folder, env=env, log=folder / "fit.log",
                                                timeout=args.timeout, peak=probe.with_suffix(".peak"))  # fmt: skip
                found = json.loads(probe.read_text()) if status == 0 and probe.exists() else {}
                runs.append({"kind": kind, "cache": cache, "repeat": repeat, "status": status, "peak_kib": peak,
                             "seconds": round(seconds, 1), **found})  # fmt: skip
                print(f"  {folder.name}: exit {status}, peak {mib(peak):.0f} MiB, {seconds:.0f} s", flush=True)
                if status != 0:
                    print((folder / "fit.log").read_text()[-3000:], file=sys.stderr)
    return runs


def summarise(runs: list[dict], caches: list[str]) -> tuple[dict, dict]:
    """The record's figures and its table: per cache, each kind's worst peak, before and during training, the ratio
    scan / slice, and what the probe saw of batches, scans and the scan-bag memory."""
    from benchmarks.recording import table

    figures, rows = {}, []
    for cache in caches:
        of = {kind: [r for r in runs if r["cache"] == cache and r["kind"] == kind] for kind in KINDS}
        peak = {kind: max(r["peak_kib"] for r in rs) for kind, rs in of.items()}  # the worst repeat of each
        before = {kind: max(r.get("peak_before_training_kib", 0) for r in rs) for kind, rs in of.items()}
        trained = {kind: max(r.get("peak_after_training_kib", 0) for r in rs) for kind, rs in of.items()}
        scan, key = of["scan"][0], f"cache_{cache}"
        figures.update({
            f"{key}_finished": all(r["status"] == 0 for rs in of.values() for r in rs),
            f"{key}_slice_peak_mib": mib(peak["slice"]), f"{key}_scan_peak_mib": mib(peak["scan"]),
            f"{key}_ratio": peak["scan"] / peak["slice"], f"{key}_difference_mib": mib(peak["scan"] - peak["slice"]),
            f"{key}_slice_training_adds_mib": mib(trained["slice"] - before["slice"]),
            f"{key}_scan_training_adds_mib": mib(trained["scan"] - before["scan"]),
            f"{key}_largest_batch": max(r.get("largest_batch", 0) for rs in of.values() for r in rs),
            f"{key}_most_of_one_scan": max(r.get("most_of_one_scan", 0) for r in of["scan"]),
            f"{key}_scans_cut": scan.get("scans_cut_across_batches"), f"{key}_scans_trained": scan.get("scans_trained"),
            f"{key}_scan_memory_bytes": scan.get("scan_memory_bytes"),
        })  # fmt: skip
        for kind in KINDS:
            rows.append([f"`cache: {cache}`", f"{kind} labels", mib(before[kind]), mib(trained[kind]),
                         mib(trained[kind] - before[kind]), mib(peak[kind]), peak[kind] / peak["slice"]])  # fmt: skip
    remembered = next((r for r in runs if r["kind"] == "scan" and r.get("scan_memory_rows")), None)
    if remembered:
        figures.update(
            scan_memory_rows=remembered["scan_memory_rows"],
            scan_memory_columns=remembered["scan_memory_columns"],
            scan_memory_bytes_per_slice=remembered["scan_memory_bytes"] / remembered["scan_memory_rows"],
            scan_memory_mib=remembered["scan_memory_bytes"] / 2**20,
        )
    peaks = table(["data.cache", "labels", "peak at training's start (MiB)", "at its end (MiB)", "training adds (MiB)",
                   "peak of the process (MiB)", "peak / slice labels' peak"], rows,
                  [None, None, ".0f", ".0f", ".0f", ".0f", ".3f"])  # fmt: skip
    return figures, peaks


if __name__ == "__main__":
    main()
