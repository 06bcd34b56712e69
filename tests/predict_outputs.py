"""A made-up ``vit-ct predict`` output and its labelled manifest, for the report's tests and those that read a report
(the review notebook's, the report's W&B logging)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image


def fake_predict_output(folder: Path, *, patients: int = 16, slices: int = 4, seed: int = 0) -> tuple[Path, Path]:
    """A predict output as ``vit-ct predict`` writes it (``predictions.csv``, ``run.json``, ``maps/``, ``overlays/``)
    of made-up P(lesion) and map scores, and its labelled manifest: ``.npy`` slices and masks, 4 validation patients
    and the rest test, a ``lesion_type`` column. Returns (OUT, manifest)."""
    rng = np.random.default_rng(seed)
    data, out = folder / "data", folder / "out"
    for sub in (data, out / "maps", out / "overlays"):
        sub.mkdir(parents=True)
    manifest_rows, rows = [], []
    for p in range(patients):
        for s in range(slices):
            name = f"p{p:02d}_s{s}"
            label = int(rng.random() < 0.4)
            mask = np.zeros((16, 16), np.uint8)
            if label:
                size = 1 + (p + s) % 4
                mask[4 : 4 + size, 4 : 4 + size] = 1
            np.save(data / f"{name}.npy", np.full((16, 16), 35.0, np.float32))
            np.save(data / f"{name}_mask.npy", mask)
            split = "val" if p < 4 else "test"
            kind = "none" if not label else ("edh", "sdh", "iph")[(p + s) % 3]
            manifest_rows.append(f"{name}.npy,{label},P{p:02d},{split},{name}_mask.npy,{kind}")
            np.save(out / "maps" / f"{name}.npy", rng.random((16, 16)).astype(np.float32))
            Image.fromarray(np.full((8, 8, 3), 40 * (p % 6), np.uint8)).save(out / "overlays" / f"{name}.png")
            prob = float(np.clip(0.3 + 0.4 * label + rng.normal(0, 0.2), 0.01, 0.99))
            names = ("pointing", "energy", "mask_fraction", "pixel_auroc", "dice", "hd95_px")
            scores = {f"{source}_{score}": (rng.random() if label else np.nan)
                      for source in ("rollout", "perfect_patch") for score in names}  # fmt: skip
            rows.append({"image": f"{name}.npy", "prob": prob, "label": label, "rollout": f"maps/{name}.npy",
                         "overlay": f"overlays/{name}.png", "scan": f"P{p:02d}", "mask": f"{name}_mask.npy",
                         **scores})  # fmt: skip
    manifest = data / "manifest.csv"
    manifest.write_text("image,label,patient_id,split,mask,lesion_type\n" + "\n".join(manifest_rows) + "\n")
    pd.DataFrame(rows).to_csv(out / "predictions.csv", index=False)
    run = {"checkpoint": None, "manifest": str(manifest), "images_relative_to": str(data), "scans": None,
           "input": None, "task": "binary", "class_names": ["lesion"]}  # fmt: skip
    (out / "run.json").write_text(json.dumps(run))
    return out, manifest
