"""Time and peak memory of attention rollout (Abnar & Zuidema 2020, arXiv:2005.00928) for a batch of CT slices:
every head of every block and a full T x T product against heads fused in the hook and the class-token row only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import timm
import torch

from benchmarks.recording import RECORDS, command_line, markdown_table, table, write_record
from vit_ct.explain.attention import num_prefix_tokens, patch_grid, record_attention
from vit_ct.explain.maps import explain_gradient_rollout, explain_rollout
from vit_ct.explain.rollout import attention_rollout
from vit_ct.run.hardware import describe_machine

VARIANTS = ("forward", "naive", "lean", "gradient")
DESCRIPTIONS = {
    "forward": "model forward only (fused attention): the floor",
    "naive": "every head of every block recorded, full T x T rollout",
    "lean": "heads fused in the hook, class-token row propagated",
    "gradient": "gradient rollout (Chefer et al. 2021): keep_graph + autograd.grad",
}


USAGE = """examples:
  .venv/bin/python -m benchmarks.rollout_memory          # ViT-B/16 at 512 x 512, batch 2: a few minutes on 1 CPU thread
  .venv/bin/python -m benchmarks.rollout_memory --model vit_tiny_patch16_224 --img-size 224 --batch 8

memory: each variant runs in a fresh subprocess (no allocator cache or earlier variant carries over) that builds
the model and batch, resets the kernel's resident-set high-water mark (echo 5 > /proc/self/clear_refs), explains
the batch once and reads VmHWM from /proc/self/status. "Peak MB above baseline" is that peak minus the resident
set just before: what the explanation needed, model forward included, on top of weights, batch and libraries.
It is the kernel's exact peak, not a sample (tracemalloc does not see torch's allocations). Where the reset is
refused, ru_maxrss (the peak over the whole subprocess) is used instead and the table says so.
"""


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        return False
    return _status_kb("VmHWM") <= _status_kb("VmRSS") + 1024


def _explain(variant: str, model: torch.nn.Module, images: torch.Tensor, head_fusion: str) -> torch.Tensor:
    if variant == "forward":
        with torch.no_grad():
            return model(images)
    if variant == "naive":
        with torch.no_grad(), record_attention(model) as attentions:
            model(images)
        return attention_rollout(
            attentions,
            head_fusion=head_fusion,
            num_prefix_tokens=num_prefix_tokens(model),
            grid_size=patch_grid(model, images.shape),
        )
    if variant == "lean":
        return explain_rollout(model, images, head_fusion=head_fusion)
    return explain_gradient_rollout(model, images)


def run_child(args: argparse.Namespace) -> None:
    """Runs one variant in this (fresh) process and prints its measurements as one JSON line."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)  # same random weights and batch in every subprocess
    model = timm.create_model(
        args.model, pretrained=False, img_size=args.img_size, in_chans=args.in_chans, num_classes=args.num_classes
    ).eval()
    images = torch.randn(args.batch, args.in_chans, args.img_size, args.img_size)
    exact = _reset_peak()
    rss_before = _status_kb("VmRSS")
    start = time.perf_counter()
    maps = _explain(args.child, model, images, args.head_fusion)
    seconds = time.perf_counter() - start
    # ru_maxrss: kB on Linux, the peak over the whole process life
    peak = _status_kb("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if args.maps_out:
        torch.save(maps, args.maps_out)
    print(json.dumps(dict(seconds=seconds, peak_mb=peak / 1024, extra_mb=(peak - rss_before) / 1024, exact=exact)))


def run_variant(args: argparse.Namespace, variant: str, maps_out: Path) -> dict:
    command = [sys.executable, __file__, "--child", variant, "--maps-out", str(maps_out)]
    for name in ("model", "img_size", "in_chans", "num_classes", "batch", "threads", "head_fusion"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode != 0:
        raise RuntimeError(f"variant {variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None, records: Path | None = None) -> None:
    """Measure and print the table; with ``records`` (a folder) also write the record ``rollout_memory.json``."""
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="vit_base_patch16_224", help="timm architecture (random weights)")
    parser.add_argument("--img-size", type=int, default=512)
    parser.add_argument("--in-chans", type=int, default=1)
    parser.add_argument("--num-classes", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per variant")
    parser.add_argument("--head-fusion", default="mean", choices=("mean", "max", "min"))
    parser.add_argument("--variants", nargs="+", default=["forward", "naive", "lean"], choices=VARIANTS)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--maps-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_child(args)
        return

    tokens = (args.img_size // 16) ** 2 + 1 if "patch16" in args.model else None
    print(
        f"{args.model}, img_size={args.img_size}, in_chans={args.in_chans}, batch={args.batch}, "
        f"threads={args.threads}, head_fusion={args.head_fusion}" + (f", T={tokens}" if tokens else "")
    )
    start = time.perf_counter()
    results, maps = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants:
            results[variant] = run_variant(args, variant, Path(tmp) / f"{variant}.pt")
            maps[variant] = torch.load(Path(tmp) / f"{variant}.pt")
            print(f"  {variant}: {results[variant]['seconds']:.1f} s", file=sys.stderr)

    reference = results.get("naive") or results[args.variants[0]]
    print(f"\nmeasured on {describe_machine()}\n")
    rows = [[variant, args.batch, r["seconds"], r["extra_mb"], r["peak_mb"], r["extra_mb"] / reference["extra_mb"],
             DESCRIPTIONS[variant]] for variant, r in results.items()]  # fmt: skip
    columns = ["variant", "batch", "seconds", "peak MB above baseline", "peak RSS MB", "memory ratio to naive", "what"]
    results_table = table(columns, rows, [None, "d", ".1f", ".0f", ".0f", ".2f", None])
    print(markdown_table(results_table))
    exact = all(r["exact"] for r in results.values())
    if not exact:
        print("\nclear_refs was refused: peaks are ru_maxrss over each whole subprocess, baseline included")
    figures = {f"{variant}_{key}": r[key] for variant, r in results.items() for key in ("seconds", "extra_mb")}
    if "naive" in maps and "lean" in maps:
        figures["max_difference_naive_lean"] = (maps["naive"] - maps["lean"]).abs().max().item()
        print(f"\nmax |naive - lean| over the maps: {figures['max_difference_naive_lean']:.2e}")
    if records is not None:
        notes = {"model": args.model, "img_size": args.img_size, "tokens": tokens, "batch": args.batch,
                 "threads": args.threads, "peak_from_clear_refs": exact}  # fmt: skip
        write_record("rollout_memory", figures, command=command_line("benchmarks.rollout_memory", argv),
                     tables={"rollout_memory": results_table}, seconds=time.perf_counter() - start, notes=notes,
                     folder=records)  # fmt: skip


if __name__ == "__main__":
    main(records=RECORDS)
