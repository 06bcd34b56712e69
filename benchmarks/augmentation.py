"""Training augmentation, side by side on the same batches and device: vit-ct's batched geometric augmentation
against kornia.augmentation (batched, per-sample parameters, masks) and MONAI's dictionary transforms run per slice;
the scanner augmentation in HU (MONAI's Gaussian filter, batched) against MONAI's random intensity transforms per
slice and against the windowed noise and contrast it adds to. Time per batch, median of --repeats after a warm-up.

Every contender draws from the same ranges (flip 0.5; rotation +-15 degrees, zoom +-10 %, shift +-6 % together at
0.8; masks nearest-neighbour, zeros outside) and returns plain tensors (``monai.data.set_track_meta(False)``).
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.recording import RECORDS, markdown_table, table, write_record
from vit_ct.data.transforms.augment import BatchAugmentation
from vit_ct.data.transforms.scanner_augment import KERNEL_SIGMAS, ScannerAugmentation
from vit_ct.run.hardware import describe_machine

USAGE = """example (the README's table; ~1 min on 2 CPU cores; writes benchmarks/records/augmentation.json):
  .venv/bin/python -m benchmarks.augmentation --batch 64 --size 256
"""
# Each contender's figure in the record: milliseconds per batch.
FIGURE_KEYS = {
    "vit-ct BatchAugmentation (batched)": "vitct_ms",
    "kornia AugmentationSequential (batched)": "kornia_ms",
    "MONAI RandFlipd + RandAffined (per slice)": "monai_ms",
    "vit-ct ScannerAugmentation, HU (batched, MONAI GaussianFilter)": "scanner_ms",
    "MONAI random intensity transforms, HU (per slice)": "monai_intensity_ms",
    "vit-ct windowed noise + contrast (batched, for reference)": "windowed_ms",
}


def batch_of(n: int, size: int, device: str) -> dict[str, torch.Tensor]:
    """A batch shaped as the model's: 2 windows, lesion and head masks, and the HU it came from."""
    gen = torch.Generator().manual_seed(0)
    hu = torch.full((n, 1, size, size), -1000.0)
    r = size // 2 - size // 10
    yy, xx = torch.meshgrid(torch.arange(size) - size / 2, torch.arange(size) - size / 2, indexing="ij")
    head = (yy**2 + xx**2 < r**2).float()[None, None].expand(n, 1, size, size)
    hu = torch.where(head > 0, 35 + 8 * torch.randn(n, 1, size, size, generator=gen), hu)
    mask = ((yy - r / 3) ** 2 + xx**2 < (size / 16) ** 2).float()[None, None].expand(n, 1, size, size).clone()
    image = torch.cat([((hu - 0) / 80).clamp(0, 1), ((hu + 20) / 200).clamp(0, 1)], dim=1)
    batch = {"image": image, "mask": mask, "head": head.clone(), "hu": hu}
    return {k: v.to(device) for k, v in batch.items()}


def geometric_contenders(device: str, size: int) -> dict:
    vitct = BatchAugmentation(noise_prob=0.0, contrast_prob=0.0)
    host = torch.Generator().manual_seed(0)  # the parameters' draws are on the CPU; g draws the pixels' noise
    contenders = {"vit-ct BatchAugmentation (batched)": lambda b, g: vitct(b, host, g)}
    try:
        import kornia.augmentation as K

        sequence = K.AugmentationSequential(
            K.RandomHorizontalFlip(p=0.5),
            K.RandomAffine(degrees=15.0, translate=(0.06, 0.06), scale=(0.9, 1.1), p=0.8, padding_mode="zeros"),
            data_keys=["input", "mask", "mask"],
        ).to(device)
        contenders["kornia AugmentationSequential (batched)"] = lambda b, g: sequence(b["image"], b["mask"], b["head"])
    except ImportError:
        print("kornia is not installed: its row is left out (pip install kornia)")
    from monai.data import set_track_meta
    from monai.transforms import Compose, RandAffined, RandFlipd

    set_track_meta(False)
    keys = ["image", "mask", "head"]
    per_slice = Compose([
        RandFlipd(keys, prob=0.5, spatial_axis=1),
        RandAffined(keys, prob=0.8, rotate_range=math.pi / 12, scale_range=0.1, translate_range=0.06 * size,
                    mode=["bilinear", "nearest", "nearest"], padding_mode="zeros"),
    ])  # fmt: skip

    def monai_per_slice(b, g):
        items = [per_slice({k: b[k][i] for k in keys}) for i in range(len(b["image"]))]
        return {k: torch.stack([torch.as_tensor(x[k]) for x in items]) for k in keys}

    contenders["MONAI RandFlipd + RandAffined (per slice)"] = monai_per_slice
    return contenders


def scanner_contenders() -> dict:
    scanner = ScannerAugmentation(kernel_prob=1.0, noise_prob=1.0, calibration_prob=1.0)
    windowed = BatchAugmentation(flip_prob=0.0, affine_prob=0.0, noise_prob=1.0, contrast_prob=1.0)
    host = torch.Generator().manual_seed(0)  # the parameters' draws are on the CPU; g draws the pixels' noise
    from monai.data import set_track_meta
    from monai.transforms import (
        Compose,
        RandGaussianNoise,
        RandGaussianSharpen,
        RandGaussianSmooth,
        RandScaleIntensity,
        RandShiftIntensity,
    )

    set_track_meta(False)
    low, high = min(KERNEL_SIGMAS), max(KERNEL_SIGMAS)
    per_slice = Compose([
        RandGaussianSmooth(sigma_x=(low, high), sigma_y=(low, high), prob=0.5),
        RandGaussianSharpen(sigma1_x=(low, high), sigma1_y=(low, high), prob=0.5),
        RandGaussianNoise(prob=1.0, std=12.0),
        RandShiftIntensity(offsets=6.0, prob=1.0),
        RandScaleIntensity(factors=0.03, prob=1.0),
    ])  # fmt: skip
    return {
        "vit-ct ScannerAugmentation, HU (batched, MONAI GaussianFilter)": lambda b, g: scanner(b["hu"], g),
        "MONAI random intensity transforms, HU (per slice)": lambda b, g: torch.stack(
            [torch.as_tensor(per_slice(x)) for x in b["hu"]]
        ),
        "vit-ct windowed noise + contrast (batched, for reference)": lambda b, g: windowed(b, host, g),
    }


def timed(fn, batch: dict, device: str, repeats: int) -> float:
    """Median seconds per call (after one warm-up call)."""
    generator = torch.Generator(device=device).manual_seed(0)
    fn(batch, generator)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(batch, generator)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None, records: Path | None = None) -> str:
    """Measure and print the table; with ``records`` (a folder: the script's own run passes ``benchmarks/records``)
    also write the record ``augmentation.json`` there."""
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    command = shlex.join(["python", "benchmarks/augmentation.py", *(sys.argv[1:] if argv is None else argv)])
    start = time.perf_counter()
    batch = batch_of(args.batch, args.size, args.device)
    rows, figures = [], {}
    for group in (geometric_contenders(args.device, args.size), scanner_contenders()):
        for name, fn in group.items():
            seconds = timed(fn, batch, args.device, args.repeats)
            rows.append([name, 1000 * seconds, 1000 * seconds / args.batch])
            figures[FIGURE_KEYS[name]] = 1000 * seconds
            print(f"{name}: {1000 * seconds:.1f} ms", flush=True)
    columns = [f"augmentation ({args.batch} slices of {args.size} x {args.size}, {args.device})", "ms per batch",
               "ms per slice"]  # fmt: skip
    results = table(columns, rows, [None, ".1f", ".2f"])
    report = "\n".join([markdown_table(results), "", f"`{command}` ({torch.get_num_threads()} threads, median of"
                        f" {args.repeats})"])  # fmt: skip
    print(f"measured on {describe_machine()}\n")
    print(report)
    notes = {"batch": args.batch, "size": args.size, "device": args.device, "repeats": args.repeats,
             "threads": torch.get_num_threads()}  # fmt: skip
    if records is not None:
        write_record("augmentation", figures, command=command, tables={"augmentation": results},
                     seconds=time.perf_counter() - start, notes=notes, folder=records)  # fmt: skip
    return report


if __name__ == "__main__":
    main(records=RECORDS)
