"""Training throughput of vit-ct on CPU, side by side in one run, as a markdown table. (``vit-ct fit`` of the demo
against a plain loop, cause by cause: ``benchmarks/training_pace.py``.)

Compares (images/s, data in memory): the vit-ct Lightning Trainer vs a plain PyTorch loop on the same timm ViT and
batches; bf16-mixed
vs fp32, and which one ``precision: auto`` takes on this machine; ``torch.compile`` vs eager for the
training step and for inference (compile time reported apart); activation checkpointing on vs off (speed, and the
memory autograd holds for the backward pass); 1 vs 2 DDP processes (gloo) on the same cores; two trainings side by side
on the same cores with OpenMP's default spin-waiting vs passive waiting. The default model is the
demo's (ViT-Ti width, 6 blocks, 128 x 128, batch 32). Takes ~6-10 minutes on 2 cores:

    python -m benchmarks.training_throughput [--steps 12] [--warmup 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback
from torch.utils.data import DataLoader

from benchmarks.recording import RECORDS, command_line, table, write_record
from vit_ct import ViTClassifier
from vit_ct.run.hardware import auto_precision, describe_machine, usable_cpus

# The demo's network; the in-memory rows train it on random images without masks, so without the mask-supervised losses
MODEL = {"arch": "vit_tiny_patch16_224", "depth": 6, "img_size": 128, "in_chans": 1, "drop_path_rate": 0.1}


def make_batches(n: int, batch_size: int, img_size: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"image": torch.rand(batch_size, 1, img_size, img_size, generator=g), "label": torch.arange(batch_size) % 2}
        for _ in range(n)
    ]


class StepTimer(Callback):
    """Wall time of the optimizer steps after ``warmup`` (from the first timed step's start to the last one's end)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.end = warmup, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.end = time.perf_counter()


def lightning_throughput(model: ViTClassifier, batches: list[dict], warmup: int, **trainer_kwargs) -> float:
    """Images/s of ``Trainer.fit`` (this process's batches) after ``warmup`` steps."""
    timer = StepTimer(warmup)
    trainer = L.Trainer(
        max_steps=len(batches), accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[timer],
        **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=DataLoader(batches, batch_size=None))  # the ready batches, as they are
    images = sum(len(b["label"]) for b in batches[warmup:])
    return images / (timer.end - timer.start)


def plain_throughput(model: ViTClassifier, batches: list[dict], warmup: int) -> float:
    """Images/s of a hand-written loop: the same timm network, loss, AdamW groups and batches, no Lightning."""
    vit = model.vit.train()
    optimizer = torch.optim.AdamW(model.param_groups(), lr=model.hparams.lr)
    for i, batch in enumerate(batches):
        if i == warmup:
            start = time.perf_counter()
        loss = F.cross_entropy(vit(batch["image"]).float(), batch["label"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    images = sum(len(b["label"]) for b in batches[warmup:])
    return images / (time.perf_counter() - start)


def compiled_throughput(model: ViTClassifier, batches: list[dict], warmup: int, train: bool) -> tuple[float, float]:
    """Images/s of the plain loop (``train``) or of inference with ``torch.compile`` on the timm network, and the
    seconds the first call (compilation) took."""
    vit = torch.compile(model.vit.train(train))
    start = time.perf_counter()
    run_steps(vit, model, batches[:1], train)
    compile_s = time.perf_counter() - start
    run_steps(vit, model, batches[1:warmup], train)
    start = time.perf_counter()
    run_steps(vit, model, batches[warmup:], train)
    return sum(len(b["label"]) for b in batches[warmup:]) / (time.perf_counter() - start), compile_s


def eager_inference_throughput(model: ViTClassifier, batches: list[dict], warmup: int) -> float:
    vit = model.vit.eval()
    run_steps(vit, model, batches[:warmup], train=False)
    start = time.perf_counter()
    run_steps(vit, model, batches[warmup:], train=False)
    return sum(len(b["label"]) for b in batches[warmup:]) / (time.perf_counter() - start)


def run_steps(vit: torch.nn.Module, model: ViTClassifier, batches: list[dict], train: bool) -> None:
    if not train:
        with torch.inference_mode():
            for batch in batches:
                vit(batch["image"])
        return
    optimizer = getattr(model, "_benchmark_optimizer", None) or torch.optim.AdamW(model.param_groups(), lr=1e-3)
    model._benchmark_optimizer = optimizer
    for batch in batches:
        loss = F.cross_entropy(vit(batch["image"]).float(), batch["label"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def saved_for_backward_mib(model: ViTClassifier, batch: dict) -> float:
    """MiB of tensors autograd keeps from the forward pass for the backward pass (what checkpointing trades away)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.losses(batch)[0]
    loss.backward()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in parameters) / 2**20


def ddp_child(processes: int, args: argparse.Namespace) -> None:
    """One DDP job (Lightning starts the other ranks by re-running this command); rank 0 prints images/s."""
    torch.set_num_threads(max(1, args.threads // processes))
    torch.manual_seed(0)
    batches = make_batches(args.warmup + args.steps, args.batch_size, MODEL["img_size"])
    model = ViTClassifier.from_hparams(**MODEL)
    # Each rank trains on its own copy of the batches (no sampler to split a list of ready batches).
    per_rank = lightning_throughput(
        model, batches, args.warmup, strategy="ddp", devices=processes, use_distributed_sampler=False
    )
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print(json.dumps({"images_per_s": per_rank * processes}))  # every rank runs the same number of steps


def run_ddp(processes: int, args: argparse.Namespace) -> float:
    command = [sys.executable, __file__, "--ddp-child", str(processes), "--steps", str(args.steps)]
    command += ["--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // processes))}
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))["images_per_s"]


def pair_child(args: argparse.Namespace) -> None:
    """One of two trainings run side by side: plain-loop images/s with all ``args.threads`` threads."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batches = make_batches(args.warmup + args.steps, args.batch_size, MODEL["img_size"])
    print(json.dumps({"images_per_s": plain_throughput(ViTClassifier.from_hparams(**MODEL), batches, args.warmup)}))


def run_pair(wait_policy: str | None, args: argparse.Namespace) -> float:
    """Mean images/s of two trainings started together on the same cores. ``wait_policy`` None: OpenMP's default."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if wait_policy:
        env["OMP_WAIT_POLICY"] = wait_policy
    argv = ["--pair-child", "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--batch-size", str(args.batch_size), "--threads", str(args.threads)]  # fmt: skip
    command = [sys.executable, __file__, *argv]
    jobs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    rates = []
    for job in jobs:
        out, _ = job.communicate()
        assert job.returncode == 0, out
        rates.append(json.loads(next(line for line in out.splitlines() if line.startswith("{")))["images_per_s"])
    return sum(rates) / len(rates)


def main(records: Path | None = None) -> None:
    """Measure and print the table; with ``records`` (a folder) also write the record ``training_throughput.json``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="timed optimizer steps per measurement")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=min(2, usable_cpus()), help="CPU threads in all")
    parser.add_argument("--ddp-child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--pair-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ddp_child:
        return ddp_child(args.ddp_child, args)
    if args.pair_child:
        return pair_child(args)

    torch.set_num_threads(args.threads)
    args.begin = time.perf_counter()
    args.records = records
    chosen, reason = auto_precision("cpu")
    rows = []
    batches = make_batches(args.warmup + args.steps, args.batch_size, MODEL["img_size"])

    def fresh(**overrides) -> ViTClassifier:
        torch.manual_seed(0)
        return ViTClassifier.from_hparams(**{**MODEL, **overrides})

    plain_throughput(fresh(), batches[:3], 1)  # one-time start-up costs (allocator, oneDNN kernels) go here
    plain = plain_throughput(fresh(), batches, args.warmup)
    fp32 = lightning_throughput(fresh(), batches, args.warmup)
    rows.append(("vit-ct Trainer vs plain PyTorch loop (fp32)", f"{fp32:.1f}", f"{plain:.1f}", fp32 / plain))
    bf16 = lightning_throughput(fresh(), batches, args.warmup, precision="bf16-mixed")
    rows.append(("bf16-mixed vs fp32 (Trainer)", f"{bf16:.1f}", f"{fp32:.1f}", bf16 / fp32))
    compiled, compile_s = compiled_throughput(fresh(), batches, args.warmup, train=True)
    rows.append((f"torch.compile vs eager: training step, fp32 (compiling took {compile_s:.0f} s)",
                 f"{compiled:.1f}", f"{plain:.1f}", compiled / plain))  # fmt: skip
    eager_inference = eager_inference_throughput(fresh(), batches, args.warmup)
    compiled, compile_s = compiled_throughput(fresh(), batches, args.warmup, train=False)
    rows.append((f"torch.compile vs eager: inference, fp32 (compiling took {compile_s:.0f} s)",
                 f"{compiled:.1f}", f"{eager_inference:.1f}", compiled / eager_inference))  # fmt: skip
    checkpointed = lightning_throughput(fresh(grad_checkpointing=True), batches, args.warmup)
    rows.append(("activation checkpointing on vs off: speed",
                 f"{checkpointed:.1f}", f"{fp32:.1f}", checkpointed / fp32))  # fmt: skip
    mem_on = saved_for_backward_mib(fresh(grad_checkpointing=True), batches[0])
    mem_off = saved_for_backward_mib(fresh(), batches[0])
    rows.append(("activation checkpointing on vs off: MiB kept for backward", f"{mem_on:.0f}", f"{mem_off:.0f}",
                 mem_on / mem_off))  # fmt: skip
    one, two = run_ddp(1, args), run_ddp(2, args)
    rows.append((f"DDP 2 processes x {args.threads // 2} thread vs 1 x {args.threads} (gloo)", f"{two:.1f}",
                 f"{one:.1f}", two / one))  # fmt: skip
    passive, default = run_pair("PASSIVE", args), run_pair(None, args)
    rows.append((f"two trainings side by side, each {args.threads} threads: OpenMP passive vs default waiting "
                 "(images/s of each)", f"{passive:.1f}", f"{default:.1f}", passive / default))  # fmt: skip
    rows.append(("one training alone vs each of two side by side (passive waiting)",
                 f"{plain:.1f}", f"{passive:.1f}", plain / passive))  # fmt: skip

    print_table(args, rows, chosen, reason)


def print_table(args: argparse.Namespace, rows: list, chosen: str, reason: str) -> None:
    print(f"\nvit-ct training throughput on {describe_machine()}; {args.threads} threads, {MODEL['arch']} depth "
          f"{MODEL['depth']}, {MODEL['img_size']}x{MODEL['img_size']}, batch {args.batch_size}, {args.steps} timed "
          f"steps. precision: auto takes {chosen} here ({reason}).\n")  # fmt: skip
    print("| comparison | A (images/s or MiB) | B | A / B |")
    print("|---|---:|---:|---:|")
    for name, a, b, ratio in rows:
        print(f"| {name} | {a} | {b} | {ratio:.2f} |")
    if getattr(args, "records", None) is not None:
        columns = ["comparison", "A (images/s or MiB)", "B", "A / B"]
        results = table(columns, [list(row) for row in rows], [None, None, None, ".2f"])
        notes = {"threads": args.threads, "batch": args.batch_size, "steps": args.steps,
                 "model": MODEL, "auto_precision": chosen}  # fmt: skip
        seconds = time.perf_counter() - args.begin
        write_record("training_throughput", {"ratios": [row[3] for row in rows]}, tables={"throughput": results},
                     command=command_line("benchmarks.training_throughput"), seconds=seconds, notes=notes,
                     folder=args.records)  # fmt: skip


if __name__ in ("__main__", "main"):
    main(records=RECORDS)
