"""A contact sheet of a simulated set for a person to look at: slices spread over its bleed types and scanner draws,
read back from the written DICOM files and masks, in the brain window with the lesion outlined.

    python -m vit_ct.sim.contact_sheet data/pretraining/manifest.csv samples.png --n 48
"""

from __future__ import annotations

import argparse
import io
import os
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from PIL import Image

from vit_ct.data.io.reader import load_ct_slice, load_mask
from vit_ct.data.transforms.windows import DISPLAY_WINDOW, window_hu
from vit_ct.files import atomic_write


def choose_slices(table: pd.DataFrame, n: int) -> pd.DataFrame:
    """`n` rows: the first slice with each artefact the set records (ring, motion, metal), then the rest spread over
    the bleed types (round robin) and, within a type, evenly over the dose ranks."""
    flags = [column for column in ("ring_bins", "motion_mm", "metal") if column in table]
    first = [table.index[table[column] > 0][0] for column in flags if (table[column] > 0).any()]
    chosen = table.loc[list(dict.fromkeys(first))[:n]]
    table = table.drop(chosen.index)
    n -= len(chosen)
    groups = [
        group.sort_values("photons_per_ray" if "photons_per_ray" in group else "image").reset_index(drop=True)
        for _, group in table.groupby("bleed_type", sort=True)
    ]
    share = [len(g) for g in groups]
    counts = [0] * len(groups)
    while sum(counts) < min(n, len(table)):
        for i in range(len(groups)):
            if counts[i] < share[i] and sum(counts) < n:
                counts[i] += 1
    picks = [g.iloc[np.linspace(0, len(g) - 1, c).round().astype(int)] for g, c in zip(groups, counts, strict=True)]
    return pd.concat([chosen, *picks]).sort_values("image").reset_index(drop=True)


def _caption(row: pd.Series) -> str:
    kind = "none" if row["bleed_type"] == "none" else row["bleed_type"][:13]
    if "kernel" not in row:
        return kind
    artefacts = [name for name, on in (("ring", row["ring_bins"] > 0), ("motion", row["motion_mm"] > 0),
                                       ("metal", row["metal"] > 0)) if on]  # fmt: skip
    return (
        f"{kind}  {row['kernel']}\n{row['slice_thickness_mm']:g} mm, {row['pixel_spacing_mm']:.2f} mm px, "
        f"N0 {row['photons_per_ray']:.1e}" + (f"\n{' '.join(artefacts)}" if artefacts else "")
    )


def contact_sheet(
    manifest: str | os.PathLike,
    out: str | os.PathLike,
    *,
    n: int = 48,
    columns: int = 8,
    tile_inches: float = 1.6,
    dpi: int = 100,
    window: tuple[float, float] = DISPLAY_WINDOW,
) -> Path:
    """Render `n` slices of the set of `manifest` into the PNG `out` (written atomically, 64-colour palette).

    Args:
        manifest: the set's manifest.csv.
        out: PNG to write.
        n: slices shown.
        columns: tiles per row.
        tile_inches: side of a tile; with `dpi` sets the PNG's size.
        dpi: pixels per inch.
        window: (centre, width) HU window; the brain window by default.
    """
    manifest = Path(manifest)
    table = pd.read_csv(manifest)
    if table.empty or "bleed_type" not in table:
        raise ValueError(f"{manifest}: expected a simulated set's manifest with a bleed_type column and rows")
    chosen = choose_slices(table, n)
    rows = -(-len(chosen) // columns)
    figure = Figure(figsize=(columns * tile_inches, rows * (tile_inches + 0.45)), dpi=dpi)
    for i, row in chosen.iterrows():
        ax = figure.add_subplot(rows, columns, i + 1)
        ax.imshow(window_hu(load_ct_slice(manifest.parent / row["image"]), *window), cmap="gray", vmin=0, vmax=1)
        mask = load_mask(manifest.parent / row["mask"]) > 0
        if mask.any():
            ax.contour(mask, levels=[0.5], colors="red", linewidths=0.5)
        ax.set_title(_caption(row), fontsize=4.5, pad=2)
        ax.axis("off")
    figure.subplots_adjust(left=0.005, right=0.995, bottom=0.005, top=0.97, wspace=0.03, hspace=0.35)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    image = Image.open(buffer).convert("RGB").quantize(64)  # noise compresses badly in full colour
    out = Path(out)
    with atomic_write(out) as tmp:
        image.save(tmp, format="PNG", optimize=True)
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m vit_ct.sim.contact_sheet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("manifest", type=Path, help="manifest.csv of a simulated set")
    parser.add_argument("out", type=Path, help="PNG to write")
    parser.add_argument("--n", type=int, default=48, help="slices shown (default 48)")
    parser.add_argument("--columns", type=int, default=8, help="tiles per row (default 8)")
    parser.add_argument("--dpi", type=int, default=100, help="pixels per inch, 1.6 inch tiles (default 100)")
    args = parser.parse_args(argv)
    out = contact_sheet(args.manifest, args.out, n=args.n, columns=args.columns, dpi=args.dpi)
    print(f"contact sheet: {out} ({out.stat().st_size / 1024:.0f} KB)")
    return out


if __name__ == "__main__":
    main()
