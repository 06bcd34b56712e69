"""A tiny manifest of ``.npy`` HU slices and ``.npy`` masks with chosen split sizes (e.g. an odd validation split,
so that DDP pads it), for the distributed, precision and checkpoint tests.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.yaml")
MANIFEST = str(ROOT / "configs" / "manifest.yaml")


def write_npy_manifest(folder: Path, *, train: int, val: int, test: int = 2, size: int = 40, seed: int = 0) -> Path:
    """Write round "heads" (brain ~35 HU in air), every other one with a 70 HU bleed and its mask; returns the CSV."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size] - (size - 1) / 2
    head = np.hypot(yy, xx) < 0.42 * size
    rows = ["image,label,patient_id,split,mask"]
    splits = ["train"] * train + ["val"] * val + ["test"] * test
    for i, split in enumerate(splits):
        label = i % 2
        hu = np.where(head, 35.0, -1000.0) + rng.normal(0, 5, (size, size))
        mask = np.zeros((size, size), dtype=np.uint8)
        if label:
            cy, cx = rng.integers(size // 3, 2 * size // 3, 2)
            mask[np.hypot(*np.mgrid[:size, :size] - np.array([cy, cx])[:, None, None]) < size / 8] = 1
            hu[mask > 0] = 70.0
        np.save(folder / f"s{i:03d}.npy", hu.astype(np.float32))
        np.save(folder / f"m{i:03d}.npy", mask)
        rows.append(f"s{i:03d}.npy,{label},p{i:03d},{split},m{i:03d}.npy")
    manifest = folder / "manifest.csv"
    manifest.write_text("\n".join(rows) + "\n")
    return manifest


# The command's own checkpoint rule (the demo config keeps the final weights instead), for tests of that rule
BEST_BY_VAL_AUROC = [
    "--checkpoint.monitor",
    "val/auroc",
    "--checkpoint.filename",
    "best-epoch{epoch:02d}-auroc{val/auroc:.4f}",
]


def manifest_args(manifest: Path, *, batch_size: int = 2) -> list[str]:
    """CLI arguments: the demo model shrunk to a 2-block ViT at 32 x 32 on this manifest, no workers, no test."""
    return [
        "--config", DEMO, "--config", MANIFEST, "--data.manifest", str(manifest),
        "--data.init_args.img_size", "32", "--data.init_args.batch_size", str(batch_size),
        "--data.init_args.num_workers", "0", "--data.init_args.cache", "true", "--data.init_args.windows", "[brain]",
        "--trainer.precision", "32-true",  # the tests compare numbers with fp32 references
        "--model.network.embed_dim", "32", "--model.network.depth", "2", "--model.network.num_heads", "2",
        "--test_after_fit", "false",
    ]  # fmt: skip
