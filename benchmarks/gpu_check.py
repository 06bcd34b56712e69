"""One-GPU check of vit-ct at scale: a short ViT-B/16 fit in 16-mixed and bf16-mixed at 224 and 512 px (images/s,
peak memory, model FLOP utilisation), then attention rollout (``ViTClassifier.explain``) on a batch of 512 x 512 slices.

MFU = model FLOPs of a training step (forward + backward, counted by ``torch.utils.flop_counter.FlopCounterMode``)
x steps/s / the GPU's dense fp16/bf16 peak (table below, or ``--peak-tflops``). Run through ``gpu_check.sh``;
``--device cpu --tiny`` checks this script on a CPU in a minute.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import lightning as L
import torch
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.training_throughput import StepTimer
from vit_ct import ViTClassifier

# Dense fp16/bf16 tensor-core peak in TFLOP/s (vendor data sheets, no sparsity), matched against the device name.
PEAK_TFLOPS = {"H200": 989.0, "H100 SXM": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0,
               "A10G": 125.0, "L4": 121.0, "V100": 125.0, "T4": 65.0}  # fmt: skip


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def make_batches(n: int, batch_size: int, img_size: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Ready batches on the device (so the GPU, not the data pipeline, is measured); masks feed the patch loss."""
    g = torch.Generator().manual_seed(0)
    image = torch.rand(batch_size, 1, img_size, img_size, generator=g)
    mask = (torch.rand(batch_size, 1, img_size, img_size, generator=g) > 0.95).float()
    batch = {
        "image": image, "mask": mask, "label": torch.arange(batch_size) % 2,
        "has_mask": torch.ones(batch_size, dtype=torch.bool), "valid": torch.ones(batch_size, dtype=torch.bool),
    }  # fmt: skip
    batch = {k: v.to(device) for k, v in batch.items()}
    return [batch] * n


def training_flops(model: ViTClassifier, batch: dict, precision: str) -> int:
    """FLOPs of one forward + backward pass of the training loss (matmuls and convolutions)."""
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
    device_type = batch["image"].device.type
    counter = FlopCounterMode(display=False)
    with counter, torch.autocast(device_type, dtype=dtype, enabled=precision != "32-true"):
        loss = model.losses(batch)[0]
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def fit_check(args, device: torch.device, precision: str, img_size: int, batch_size: int) -> dict:
    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(arch=args.arch, img_size=img_size, **args.model_overrides).to(device)
    batches = make_batches(args.warmup + args.steps, batch_size, img_size, device)
    flops = training_flops(model, batches[0], precision)
    reset_peak(device)
    timer = StepTimer(args.warmup)
    trainer = L.Trainer(
        max_steps=len(batches), accelerator=device.type, devices=1, precision=precision, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[timer],
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=DataLoader(batches, batch_size=None))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = timer.end - timer.start
    steps_per_s = args.steps / seconds
    peak = peak_tflops(device, args.peak_tflops)
    return {
        "check": "fit", "precision": precision, "img_size": img_size, "batch": batch_size,
        "images_per_s": steps_per_s * batch_size, "peak_mem_gib": peak_gib(device),
        "tflops_per_step": flops / 1e12, "achieved_tflops": flops * steps_per_s / 1e12,
        "mfu": flops * steps_per_s / (peak * 1e12) if peak else None,
    }  # fmt: skip


def rollout_check(args, device: torch.device, img_size: int, batch_size: int) -> dict:
    torch.manual_seed(0)
    model = ViTClassifier.from_hparams(arch=args.arch, img_size=img_size, **args.model_overrides).to(device).eval()
    image = torch.rand(batch_size, 1, img_size, img_size, device=device)
    reset_peak(device)
    start = time.perf_counter()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        logits, rollout = model.explain(image)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    grid = img_size // model.hparams.patch_size
    assert rollout.shape == (batch_size, grid, grid) and torch.isfinite(rollout).all() and (rollout >= 0).all()
    assert logits.shape == (batch_size, model.hparams.num_classes)
    return {
        "check": "rollout", "precision": "bf16 autocast", "img_size": img_size, "batch": batch_size,
        "images_per_s": batch_size / (time.perf_counter() - start), "peak_mem_gib": peak_gib(device),
    }  # fmt: skip


def table(results: list[dict]) -> str:
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    lines = [
        "| check | precision | size | batch | images/s | peak GiB | TFLOP/step | TFLOP/s | MFU |",
        "|" + "---|" * 9,
    ]
    for r in results:
        lines.append(
            f"| {r['check']} | {r['precision']} | {r['img_size']} | {r['batch']} | {r['images_per_s']:.1f} | "
            f"{fmt(r['peak_mem_gib'], '.2f')} | {fmt(r.get('tflops_per_step'), '.3f')} | "
            f"{fmt(r.get('achieved_tflops'), '.1f')} | {fmt(r.get('mfu'), '.1%')} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny, to test this script)")
    parser.add_argument("--tiny", action="store_true", help="2-block, 32-wide ViT at 32 and 64 px, a few steps")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per fit")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-224", type=int, default=128)
    parser.add_argument("--batch-512", type=int, default=32)
    parser.add_argument("--rollout-batch", type=int, default=64)
    parser.add_argument("--peak-tflops", type=float, default=None, help="GPU dense fp16/bf16 peak (else looked up)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); this check needs one GPU. "
              "Use --device cpu --tiny to test the script itself.", file=sys.stderr)  # fmt: skip
        return 2
    torch.set_float32_matmul_precision("high")
    args.arch = "vit_base_patch16_224"
    # one channel, as the batches; the patch and attention losses read their masks
    args.model_overrides = {"in_chans": 1, "drop_path_rate": 0.1}
    args.model_overrides.update(patch_loss_weight=1.0, attention_loss_weight=1.0)
    sizes = [(224, args.batch_224), (512, args.batch_512)]
    precisions = ["16-mixed", "bf16-mixed"] if device.type == "cuda" else ["bf16-mixed"]  # no fp16 AMP on CPU
    rollout = (512, args.rollout_batch)
    if args.tiny:
        args.model_overrides.update(depth=2, embed_dim=32, num_heads=2)
        sizes, rollout = [(32, 4), (64, 2)], (64, 2)
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, peak {peak_tflops(device, args.peak_tflops)} TFLOP/s")

    results = [fit_check(args, device, p, size, batch) for size, batch in sizes for p in precisions]
    results.append(rollout_check(args, device, *rollout))
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if not args.tiny:  # a --tiny run tests the script; it measures nothing worth a record
        from benchmarks.recording import RECORDS, command_line, write_record

        write_record("gpu_check", {}, command=command_line("benchmarks.gpu_check"), folder=RECORDS,
                     notes={"results": results, "table_markdown": table(results)})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
