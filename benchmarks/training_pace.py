"""Training pace: ``vit-ct fit`` against a plain PyTorch loop over the same model, losses and augmented batches, side
by side in one run, with every millisecond of each step accounted for by cause.

The fit is ``vit-ct fit --config configs/demo.yaml`` as a user runs it, in its own process: the synthetic set read
from its disk cache, collated, windowed and augmented on the fly, the demo model with its losses, the W&B logger
(offline), the progress callbacks, a checkpoint at each epoch's end; only validation is off. The plain loop runs in a
process of its own with torch's defaults: a copy of the fit's initial model, ``model.losses``, AdamW over the same
parameter groups, one epoch of the demo's augmented batches already in memory (on the device), repeated. Both run
``--epochs`` epochs; the steady state is every epoch after the first. The settings alternate (plain, fit, plain,
fit, ...) so that a machine's drift reaches both.

Where the fit's step goes, from callback and optimizer hooks in the fit (``PaceLog``) and timers in the plain loop:
the model's forward and losses (``model.losses``), backward, the optimizer step, the batch (reading the cache and
collating; windows and augmentation), logging (``training_step`` beyond the losses), Lightning's loop and hooks (the
rest of the step), and the epoch ends (checkpoint, epoch hooks, a new loader iterator), each per step. On a GPU the
timers read the host's clock without synchronising (that would change what is measured): there the table states
images per second over whole epochs and the share of the step the host spends on the batch.

    python -m benchmarks.training_pace                       # fp32 (and bf16 where the CPU has it natively), 2 repeats
    python -m benchmarks.training_pace --before HEAD~3       # also the fit of an earlier commit, alternating
    python -m benchmarks.training_pace --device cuda         # on a GPU machine (benchmarks/gpu_check.sh runs it)

Run as a script it writes ``benchmarks/records/training_pace.json`` (``--no-record``: prints only).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "configs" / "demo.yaml"
CAUSES = (  # (key, what the table calls it)
    ("forward", "forward and losses (`model.losses`)"),
    ("backward", "backward"),
    ("optimizer", "optimizer step (AdamW)"),
    ("read", "batch: reading the cache, collating"),
    ("augment", "batch: to the device, windows, augmentation"),
    ("logging", "logging (`training_step` beyond the losses)"),
    ("loop", "Lightning's loop and hooks (the rest of the step)"),
    ("epoch_end", "epoch ends: checkpoint, epoch hooks, new loader iterator (per step)"),
)


class PaceLog(Callback):
    """Loaded into the timed fit (``--trainer.callbacks+=training_pace.PaceLog``): per training step, perf_counter
    marks of the batch's start and end, and the seconds spent in ``model.losses``, ``training_step``, the backward
    pass, the optimizer step and the datamodule's ``on_after_batch_transfer``; written to ``path`` as JSON when
    training ends. The wrappers time only: every call goes through unchanged."""

    def __init__(self, path: str) -> None:
        self.path, self.steps = Path(path), []
        self._spent: dict[str, float] = {}

    def _timed(self, key: str, method):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._spent[key] = self._spent.get(key, 0.0) + time.perf_counter() - start

        return timed

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.losses = self._timed("losses", pl_module.losses)
        pl_module.training_step = self._timed("training_step", pl_module.training_step)
        if trainer.datamodule is not None:
            hook = trainer.datamodule.on_after_batch_transfer
            trainer.datamodule.on_after_batch_transfer = self._timed("augment", hook)

    def on_train_start(self, trainer, pl_module) -> None:
        for optimizer in trainer.optimizers:
            optimizer.register_step_pre_hook(lambda *_: self._mark("optimizer_start"))
            optimizer.register_step_post_hook(lambda *_: self._mark("optimizer_end"))

    def _mark(self, key: str) -> None:
        self._spent[key] = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # the batch was read and augmented before this hook: its augmentation is in what was spent since the last end
        start = time.perf_counter()
        self.steps.append({"epoch": trainer.current_epoch, "start": start, "augment": self._spent.pop("augment", 0.0)})

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._mark("backward_start")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._mark("backward_end")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        spent, step = self._spent, self.steps[-1]
        step["end"] = time.perf_counter()
        step["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step["losses"], step["training_step"] = spent.pop("losses", 0.0), spent.pop("training_step", 0.0)
        step["backward"] = spent.get("backward_end", 0.0) - spent.get("backward_start", 0.0)
        # Lightning runs training_step and backward in a closure inside optimizer.step: the step's own work is after it
        step["optimizer"] = spent["optimizer_end"] - max(spent["optimizer_start"], spent["backward_end"])

    def on_train_end(self, trainer, pl_module) -> None:
        self.steps[-1]["peak_rss_mib"] = peak_resident_kib() / 1024
        self.path.write_text(json.dumps(self.steps))


def peak_resident_kib() -> int:
    """This process's largest resident set in KiB: ``VmHWM``, the peak of its own memory since it started. Not
    ``ru_maxrss``: on Linux a child starts from its parent's high-water mark (fork copies it, exec keeps the larger),
    so every process this benchmark launched read at least the benchmark's own 2.3 GiB. ``ru_maxrss`` only where
    there is no ``/proc`` (kB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def fit_causes(steps: list[dict], batch_size: int) -> dict[str, float]:
    """Milliseconds per step by cause over the steady state (epochs after the first), from a ``PaceLog``; they sum to
    ``total``, the wall time from the first epoch's last step to the last step, per step."""
    first = next(i for i, s in enumerate(steps) if s["epoch"] >= 1)
    steady = steps[first:]
    gaps = [s["start"] - p["end"] for p, s in zip(steps[first - 1 :], steady, strict=False)]
    opening = [i for i, s in enumerate(steady) if i == 0 or s["epoch"] != steady[i - 1]["epoch"]]  # an epoch's first
    within = [g - s["augment"] for i, (g, s) in enumerate(zip(gaps, steady, strict=True)) if i not in opening]
    read = statistics.mean(within)  # the batch's reading and collating, inside an epoch
    n = len(steady)
    ms = {
        "forward": sum(s["losses"] for s in steady),
        "backward": sum(s["backward"] for s in steady),
        "optimizer": sum(s["optimizer"] for s in steady),
        "augment": sum(s["augment"] for s in steady),
        "read": read * n,
        "logging": sum(s["training_step"] - s["losses"] for s in steady),
    }
    inside = sum(s["end"] - s["start"] for s in steady)
    ms["loop"] = inside - ms["forward"] - ms["backward"] - ms["optimizer"] - ms["logging"]
    total = steady[-1]["end"] - steps[first - 1]["end"]
    ms["epoch_end"] = total - inside - ms["augment"] - ms["read"]
    ms = {key: 1000 * value / n for key, value in ms.items()}
    ms["total"] = 1000 * total / n
    ms["images_per_s"] = 1000 * batch_size / ms["total"]
    ms["page_faults"] = (steady[-1]["faults"] - steps[first - 1]["faults"]) / n
    ms["peak_rss_mib"] = steps[-1]["peak_rss_mib"]
    return ms


def plain_child(path: str, precision: str, epochs: int, device: str, allocator: bool) -> None:
    """The plain loop, in a process of its own with torch's defaults (``allocator``: and with glibc's allocator set
    as vit-ct sets it, :mod:`vit_ct.run.allocator`): prints its milliseconds per step by cause (JSON). On CUDA the
    causes are the host's time, not synchronised (only the epochs' ends are)."""
    from vit_ct.run.allocator import keep_freed_memory
    from vit_ct.task import ViTClassifier

    if allocator and not keep_freed_memory():
        raise SystemExit("the plain loop: glibc's allocator could not be set here")

    saved = torch.load(path, weights_only=False)  # this benchmark's own file
    model = ViTClassifier.from_hparams(**saved["hparams"])
    model.load_state_dict(saved["state_dict"])
    model.to(device).train()
    batches = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()} for b in saved["batches"]]
    optimizer = torch.optim.AdamW(model.param_groups(), lr=model.hparams.lr)
    dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(precision.split("-")[0])
    autocast = torch.autocast(device, dtype=dtype) if dtype else contextlib.nullcontext()
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    cuda = device == "cuda"
    spent = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    for epoch in range(epochs):
        if epoch == 1:
            spent = dict.fromkeys(spent, 0.0)
            if cuda:
                torch.cuda.synchronize()
            begin, faults = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for batch in batches:
            t0 = time.perf_counter()
            with autocast:
                loss = model.losses(batch)[0]
            t1 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            t2 = time.perf_counter()
            scaler.step(optimizer)
            scaler.update()
            t3 = time.perf_counter()
            spent["forward"] += t1 - t0
            spent["backward"] += t2 - t1
            spent["optimizer"] += t3 - t2
    if cuda:
        torch.cuda.synchronize()
    n = (epochs - 1) * len(batches)
    total = time.perf_counter() - begin
    ms = {key: 1000 * value / n for key, value in spent.items()}
    ms["loop"] = 1000 * total / n - sum(ms.values())
    ms["total"] = 1000 * total / n
    ms["images_per_s"] = len(batches[0]["label"]) * n / total
    ms["page_faults"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / n
    ms["peak_rss_mib"] = peak_resident_kib() / 1024
    print(json.dumps(ms))


def prepare(folder: Path, root: Path, precision: str, device: str) -> tuple[Path, int]:
    """The plain loop's inputs: the demo's initial model (as the fit builds it: same seed, same config) and one
    epoch of its training batches, windowed and augmented as the fit does, saved to ``folder/plain.pt``. Also builds
    the synthetic set under ``root`` when it is not there. Returns the file and the batch size."""
    from vit_ct.cli import main as vit_ct
    from vit_ct.data.transforms.model_input import apply_windows

    overrides = ["--data.init_args.root", str(root), "--trainer.precision", precision]
    overrides += ["--trainer.logger", "false", "--trainer.accelerator", "gpu" if device == "cuda" else "cpu"]
    with working_directory(folder):
        cli = vit_ct(["--config", str(DEMO_CONFIG), *overrides], run=False)
    data, model = cli.datamodule, cli.model
    data.check("fit")  # builds the synthetic set where it is not
    data.setup("fit")
    generator = torch.Generator().manual_seed(0)
    batches = []
    for batch in data.train_dataloader():
        if "hu" in batch:
            batch = apply_windows(batch, data.windows)
        batches.append(data.augmentation(batch, generator))
    saved = folder / "plain.pt"
    hparams = {k: v for k, v in model.hparams.items() if not k.startswith("_")}  # not the CLI's _instantiator
    torch.save({"batches": batches, "state_dict": model.state_dict(), "hparams": hparams}, saved)
    return saved, data.batch_size


def run_plain(saved: Path, precision: str, args: argparse.Namespace, allocator: bool) -> dict[str, float]:
    argv = ["--plain-child", str(saved), "--precision", precision, "--epochs", str(args.epochs)]
    argv += ["--device", args.device, *(["--allocator"] if allocator else [])]
    out = subprocess.run([sys.executable, __file__, *argv], env=torch_defaults(), capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the plain loop failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_fit(folder: Path, root: Path, precision: str, args: argparse.Namespace, code: Path) -> dict[str, float]:
    """``vit-ct fit`` of the demo from the package in ``code`` (this checkout, or a worktree of ``--before``), in a
    fresh process and a fresh folder (its run folder and W&B files go there), with ``PaceLog`` loaded."""
    log = folder / "pace.json"
    log.unlink(missing_ok=True)
    env = torch_defaults() | {"WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
    env["PYTHONPATH"] = os.pathsep.join([str(code), str(Path(__file__).parent)])
    command = [sys.executable, "-m", "vit_ct", "fit", "--config", str(code / "configs" / "demo.yaml"),
               "--data.init_args.root", str(root), "--trainer.precision", precision, "--trainer.max_epochs",
               str(args.epochs), "--trainer.limit_val_batches", "0", "--test_after_fit", "false",
               "--trainer.accelerator", "gpu" if args.device == "cuda" else "cpu",
               "--trainer.callbacks+=training_pace.PaceLog", "--trainer.callbacks.path", str(log),
               *shlex.split(args.fit_args)]  # fmt: skip
    with tempfile.TemporaryDirectory(dir=folder) as run_folder:
        out = subprocess.run(command, env=env, cwd=run_folder, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"vit-ct fit ({code}) failed:\n{out.stderr[-3000:]}")
    return fit_causes(json.loads(log.read_text()), args.batch_size)


def torch_defaults() -> dict[str, str]:
    """This environment without OpenMP's variables: torch's defaults, as in a user's shell."""
    return {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}


@contextlib.contextmanager
def working_directory(folder: Path):
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


@contextlib.contextmanager
def worktree(rev: str | None):
    """A detached git worktree of ``rev`` (its package and configs), removed afterwards; None: nothing."""
    if rev is None:
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="pace-before-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), rev], check=True,
                   capture_output=True)  # fmt: skip
    try:
        yield folder
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(folder)], capture_output=True)


def precisions(device: str, chosen: list[str] | None) -> tuple[list[str], str]:
    """The precisions to measure and why: fp32, and bf16 where it is native (on a CPU without it, bf16 autocast is
    emulated and many times slower; ``precision: auto`` does not take it)."""
    from vit_ct.run.hardware import auto_precision

    if chosen:
        return chosen, "as asked"
    auto, reason = auto_precision(device)
    return list(dict.fromkeys(["32-true", auto])), f"fp32 and `precision: auto`'s choice here, {auto} ({reason})"


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per setting, the mean of its repeats, cause by cause."""
    return {name: {key: statistics.mean(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items() if rs}


def cause_rows(mean: dict[str, dict[str, float]], precision: str) -> list[list]:
    """Per cause: the fit, the plain loop, their difference, the plain loop with vit-ct's allocator settings, and
    the fit at ``--before`` where it ran (ms per step); then the page faults per step."""
    fit, plain, allocator = (mean[f"{name} {precision}"] for name in ("fit", "plain", "allocator"))
    before = mean.get(f"before {precision}")
    rows = []
    extra = (("page_faults", "page faults per step"), ("peak_rss_mib", "peak resident memory of the process, MiB"))
    for key, label in (*CAUSES, ("total", "**per step, all of it**"), *extra):
        row = [label, fit.get(key), plain.get(key, 0.0), fit.get(key, 0.0) - plain.get(key, 0.0)]
        rows.append(row + [allocator.get(key, 0.0)] + ([before.get(key)] if before else []))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--epochs", type=int, default=3, help="epochs of each fit and plain loop (the first is not timed)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="alternating repeats of each setting")
    parser.add_argument("--precision", nargs="+", help="Lightning precisions (default: fp32, and bf16 where native)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--before", metavar="REV", help="also time the fit of this git revision, alternating")
    parser.add_argument("--root", default=str(ROOT / "data" / "synthetic"), help="the demo's set (built if absent)")
    parser.add_argument("--fit-args", default="", help='more arguments for every fit, e.g. "--trainer.logger false"')
    parser.add_argument("--no-record", action="store_true", help="print only; write no record")
    parser.add_argument("--plain-child", help=argparse.SUPPRESS)
    parser.add_argument("--allocator", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_child:
        return plain_child(args.plain_child, args.precision[0], args.epochs, args.device, args.allocator)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("training_pace.py --device cuda: no CUDA device here")
    from benchmarks.recording import RECORDS, command_line, table, write_record
    from vit_ct.run.hardware import describe_machine

    begin = time.perf_counter()
    chosen, why = precisions(args.device, args.precision)
    root = Path(args.root).resolve()
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp, worktree(args.before) as before:
        folder = Path(tmp)
        for precision in chosen:
            saved, args.batch_size = prepare(folder, root, precision, args.device)
            for repeat in range(args.repeats):
                settings = [("plain", None), ("allocator", None), ("fit", ROOT)]
                settings += [("before", before)] if before else []
                for name, code in settings if repeat % 2 == 0 else reversed(settings):
                    key = f"{name} {precision}"
                    print(f"[{time.perf_counter() - begin:6.0f} s] {key}, repeat {repeat + 1}/{args.repeats}",
                          flush=True)  # fmt: skip
                    if code is None:
                        result = run_plain(saved, precision, args, allocator=name == "allocator")
                    else:
                        result = run_fit(folder, root, precision, args, code)
                    runs.setdefault(key, []).append(result)
    mean = summarise(runs)
    tables, figures = {}, {}
    columns = ["where the step goes (ms per step)", "`vit-ct fit`", "plain loop", "fit - plain",
               "plain loop, vit-ct's allocator settings"]  # fmt: skip
    if args.before:
        columns.append(f"`vit-ct fit` at {args.before}")
    print(f"\nTraining pace on {describe_machine()}, {args.device}; {why}.")
    for precision in chosen:
        rows = cause_rows(mean, precision)
        tables[f"causes_{precision}"] = table(columns, rows, [None, *[".1f"] * (len(columns) - 1)])
        fit, plain = mean[f"fit {precision}"], mean[f"plain {precision}"]
        figures[f"pace_{precision}"] = plain["total"] / fit["total"]
        figures[f"pace_same_allocator_{precision}"] = mean[f"allocator {precision}"]["total"] / fit["total"]
        pairs = zip(runs[f"plain {precision}"], runs[f"fit {precision}"], strict=True)
        figures[f"pace_{precision}_repeats"] = [p["total"] / f["total"] for p, f in pairs]
        figures[f"fit_images_per_s_{precision}"] = fit["images_per_s"]
        figures[f"plain_images_per_s_{precision}"] = plain["images_per_s"]
        figures[f"data_wait_share_{precision}"] = (fit["read"] + fit["augment"]) / fit["total"]
        if args.before:
            figures[f"pace_before_{precision}"] = plain["total"] / mean[f"before {precision}"]["total"]
        print(f"\n{precision}: the fit at {figures[f'pace_{precision}']:.3f} of the plain loop's pace"
              f" ({figures[f'pace_same_allocator_{precision}']:.3f} of it with vit-ct's allocator settings)"
              + (f" (before: {figures[f'pace_before_{precision}']:.3f})" if args.before else "")
              + f"; {fit['images_per_s']:.1f} images/s, {100 * figures[f'data_wait_share_{precision}']:.1f}% of the"
              " step on the batch\n")  # fmt: skip
        print("| " + " | ".join(columns) + " |\n|---" + "|---:" * (len(columns) - 1) + "|")
        for row in rows:
            print("| " + " | ".join(c if isinstance(c, str) else "" if c is None else f"{c:.1f}" for c in row) + " |")
    if not args.no_record:
        notes = {"device": args.device, "precisions": why, "epochs": args.epochs, "repeats": args.repeats,
                 "batch": args.batch_size, "before": args.before, "runs": runs}  # fmt: skip
        command = command_line("benchmarks.training_pace")
        path = write_record("training_pace", figures, tables=tables, command=command,
                            seconds=time.perf_counter() - begin, notes=notes, folder=RECORDS)  # fmt: skip
        print(f"record written: {path}")


if __name__ == "__main__":
    main()
