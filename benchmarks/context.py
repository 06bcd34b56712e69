"""Does reading a slice with its neighbours, or in its whole scan, help? The README's fine-tuning recipe side by side
with and without ``data.context_mm`` (the neighbours' kernels starting at zero, or inflated: the slice's kernels spread
over the three slices) and with a sequence head over the scan (``model.network.sequence``, a GRU or a transformer:
scored on its reading of each slice in its scan, ``prob_in_scan``), or from the weights pretrained to read a slice in
its scan (``scan_weights``: ``vit-ct/headct-tiny-256-scan``, ``configs/pretrain_scan.yaml``), on whole simulated scans
where a bleed spans the slices it reaches.

One run writes a scan set that no training has seen (``python -m vit_ct.sim.pretraining --scan_spacing_mm``: the
scanner-randomised cohort, its own seed, contiguous slices, each bleed a 3-D object), blanks the masks of its train and
validation rows (the recipe learns from labels only; ``--labels scan``: from one label per scan, no slice label) and,
for each row of the table, runs the real commands a user runs: ``vit-ct fit --config configs/finetune.yaml`` (the
shipped weights, fine-tuned) with or without context, then ``vit-ct predict`` on the test patients. Scored there:
slice AUROC with a 95% interval from resampling patients, scan AUROC (a scan's highest slice probability), and the
maps against the test masks (pointing, Dice of the half-maximum region: the rollout of the slice itself); how much
the trained network reads the neighbours (the norm of its first convolution's kernels on them over those on the
slice); and what each costs (fit and predict wall time on the same machine).

    python -m benchmarks.context --patients 100 --slices 12
    python -m benchmarks.context --patients 200 --split 0.35 0.075 0.575    # 70 scans to train on, 115 to test
    python -m benchmarks.context --labels scan    # from one label per scan: the record context_scans
    python -m benchmarks.context --rows alone inflated sequence both    # some rows only
    python -m benchmarks.context --rows alone transformer scan_weights --record context_weights
    python -m benchmarks.context --family far --rows alone transformer scan_weights    # the record context_far

``--family near`` / ``far``: the scans drawn with the scanner and lesion mix of a held-out family of
``benchmarks.small_data`` (``HELDOUT``: sharp ramp / Shepp-Logan kernels, low dose, strong beam hardening;
``HELDOUT_FAR``: 1.25 mm pixels and an edge-enhancing kernel sharper than any pretraining draws), every patient on
that scanner; the anatomy, slice thickness, motion and calibration the cohort's. Its own seed and folder.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from benchmarks.recording import ROOT, command_line, git_state, table, timed_vit_ct, write_record
from benchmarks.small_data import HELDOUT_FAMILIES, patient_bootstrap_auroc, scan_auroc
from vit_ct.sim.cohort import CohortConfig
from vit_ct.sim.phantom import PhantomConfig
from vit_ct.sim.pretraining import write_pretraining_set
from vit_ct.sim.projector import Kernel
from vit_ct.sim.protocol import ScannerConfig

FINETUNE = str(ROOT / "configs" / "finetune.yaml")
SEED = 20_261_207  # a seed family no training of the project draws from
FAMILY_SEEDS = {"cohort": SEED, "near": SEED + 1, "far": SEED + 2}
# A named filter as the continuous kernel closest to it: the ramp unapodised (its response at Nyquist 0.97),
# Shepp-Logan's sinc as the Gaussian with the same response at Nyquist (0.64)
NAMED_KERNELS = {"ramp": Kernel(5.0), "shepp-logan": Kernel(1.25)}
CONTEXT = ["--data.init_args.context_mm", "5"]
INFLATED = [*CONTEXT, "--model.network.neighbour_start", "inflated"]
SEQUENCE = ["--model.network.sequence", "gru"]
SCAN_WEIGHTS = "vit-ct/headct-tiny-256-scan"
# name -> (the table's row, the fit's extra arguments); the name is the run's folder and the figures' suffix
ROWS = {
    "alone": ("alone", []),
    "context": ("context 5 mm", CONTEXT),
    "inflated": ("context 5 mm, inflated start", INFLATED),
    "sequence": ("alone + sequence (in scan)", SEQUENCE),
    "transformer": ("alone + transformer sequence (in scan)", ["--model.network.sequence", "transformer"]),
    "both": ("context 5 mm, inflated + sequence (in scan)", [*INFLATED, *SEQUENCE]),
    # weights pretrained to read a slice in its scan (configs/pretrain_scan.yaml): their context comes with them
    "scan_weights": (
        "headct-tiny-256-scan: context 5 mm + transformer (in scan)",
        ["--model.pretrained", SCAN_WEIGHTS, "--model.network.sequence", "transformer"],
    ),
}


def family_cohort(phantom: PhantomConfig) -> CohortConfig:
    """Whole scans drawn as a held-out family of single slices is: its pixel size, kernels (the range their
    sharpness and edge boost span), dose, beam hardening and lesion contrast and size, on every patient; the rest the
    cohort's (anatomy, bleed kinds, slice thickness, motion, rings, calibration)."""
    kernels = [NAMED_KERNELS[k] if isinstance(k, str) else k for k in phantom.kernels]
    half, boost = [k.half_response for k in kernels], [k.edge_boost for k in kernels]
    scanner = ScannerConfig(
        pixel_spacing_mm_range=(phantom.pixel_spacing_mm, phantom.pixel_spacing_mm),
        half_response_range=(min(half), max(half)),
        edge_boost_range=(min(boost), max(boost)),
        window_kernel_fraction=0.0,
        photons_per_ray_range=phantom.photons_per_ray_range,
        beam_hardening_range=(phantom.beam_hardening, phantom.beam_hardening),
    )
    return CohortConfig(size=phantom.size, bleed_hu_range=phantom.bleed_hu_range,
                        low_contrast_fraction=phantom.low_contrast_fraction, small_fraction=phantom.small_fraction,
                        lookalike_probability=phantom.lookalike_probability, scanner=scanner)  # fmt: skip


def scan_set(folder: Path, patients: int, slices: int, spacing_mm: float, workers: int,
             split: tuple[float, float, float] = (0.7, 0.15, 0.15), family: str = "cohort") -> Path:  # fmt: skip
    """The scan set's manifest (``split``: the shares of patients in train, validation and test; ``family``: the
    cohort's scanner ranges, or a held-out family's scanner, :func:`family_cohort`) with the masks of its train and
    validation rows blanked (labels only, as the recipe's user has them); the test rows keep theirs, for scoring the
    maps."""
    config = CohortConfig(size=256) if family == "cohort" else family_cohort(HELDOUT_FAMILIES[family][0])
    manifest = write_pretraining_set(folder / "scans", n_patients=patients, slices_per_patient=slices,
                                     seed=FAMILY_SEEDS[family], config=config, scan_spacing_mm=spacing_mm,
                                     split_fractions=split, num_workers=workers)  # fmt: skip
    rows = pd.read_csv(manifest, dtype=str, keep_default_na=False)
    rows.loc[rows["split"] != "test", "mask"] = ""
    labels_only = manifest.parent / "labels_only.csv"
    rows.to_csv(labels_only, index=False)
    return labels_only


def scan_labels_only(manifest: Path) -> Path:
    """The scan set as a report labels it: one label per scan (``scan_label``, 1 where any of its slices shows a
    bleed), no slice label and no mask on any row; what the recipe then trains from by multiple-instance learning."""
    rows = pd.read_csv(manifest, dtype=str, keep_default_na=False)
    key = "scan" if "scan" in rows.columns else "patient_id"
    lesion = rows["label"].astype(int) > 0
    rows["scan_label"] = lesion.groupby(rows[key]).transform("max").astype(int)
    out = manifest.with_name("scan_labels_only.csv")
    rows.drop(columns=["label", "mask"]).to_csv(out, index=False)
    return out


def run_row(name: str, extra: list[str], manifest: Path, folder: Path, epochs: int, fit_manifest: Path | None = None,
            suffix: str = "") -> dict:  # fmt: skip
    """Fit and predict one row (:data:`ROWS`); its scores on the test patients (``fit_manifest``: the labels it
    trains from, if not ``manifest``'s; ``suffix``: of its run folders)."""
    run = folder / f"{name}{suffix}"
    fit_s = timed_vit_ct("fit", "--config", FINETUNE, "--data.manifest", str(fit_manifest or manifest), *extra,
                         "--trainer.max_epochs", str(epochs), "--trainer.logger", "false",
                         "--trainer.enable_progress_bar", "false", "--test_after_fit", "false",
                         "--trainer.default_root_dir", str(run))  # fmt: skip
    summary = json.loads((run / "summary.json").read_text())
    checkpoint = summary["best_checkpoint"] or summary["last_checkpoint"]  # the final weights (monitor null)
    out = folder / f"{run.name}_predict"
    predict_s = timed_vit_ct("predict", "--config", FINETUNE, "--data.manifest", str(manifest), "--ckpt_path",
                             checkpoint, "--data.init_args.predict_split", "test", "--output_dir", str(out),
                             "--trainer.logger", "false", "--trainer.enable_progress_bar", "false")  # fmt: skip
    slices = pd.read_csv(out / "predictions.csv")
    share = neighbour_share(Path(checkpoint))
    # a model with a sequence head is scored on its reading of each slice in its scan; its maps are the slices' own
    prob = "prob_in_scan" if "prob_in_scan" in slices.columns else "prob"
    auroc, low, high = patient_bootstrap_auroc(slices["label"], slices[prob], slices["scan"])
    positive = slices[(slices["label"] == 1) & slices["rollout_pointing"].notna()]
    return {
        "name": name,
        "row": ROWS[name][0],
        "auroc": auroc,
        "low": low,
        "high": high,
        "scan_auroc": scan_auroc(slices["label"].to_numpy(), slices[prob].to_numpy(), slices["scan"].to_numpy()),
        "pointing": float(positive["rollout_pointing"].mean()),
        "dice": float(positive["rollout_dice"].mean()),
        "neighbour_share": share,
        "fit_s": fit_s,
        "predict_ms_per_slice": 1000 * predict_s / len(slices),
        "test_slices": len(slices),
        "test_scans": int(slices["scan"].nunique()),
        "scored_maps": len(positive),
    }


def neighbour_share(checkpoint: Path) -> float | None:
    """How much the trained network reads the neighbours: the norm of its first convolution's kernels on the
    neighbours' channels over the norm of those on the slice's own (0 as the single-slice weights start); None
    without context."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
    hparams, state = saved["hyper_parameters"], saved["state_dict"]
    if hparams.get("context_mm") is None:
        return None
    weight = state.get("vit.patch_embed.proj.0.weight", state.get("vit.patch_embed.proj.weight"))
    per_slice = hparams["in_chans"] // 3  # the slice, the one below, the one above
    return float(weight[:, per_slice:].norm() / weight[:, :per_slice].norm())


def main(argv: list[str] | None = None, records: Path | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.context", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--patients", type=int, default=100, help="patients of the scan set (default 100)")
    parser.add_argument("--slices", type=int, default=12, help="slices per scan (default 12)")
    parser.add_argument("--spacing_mm", type=float, default=5.0, help="distance between slices (default 5)")
    parser.add_argument("--split", type=float, nargs=3, default=(0.7, 0.15, 0.15), metavar=("TRAIN", "VAL", "TEST"),
                        help="shares of the patients in train, validation and test (default 0.7 0.15 0.15); a larger"
                        " test share narrows the intervals at the same training cost")  # fmt: skip
    parser.add_argument("--labels", choices=("slice", "scan"), default="slice",
                        help="what the fits learn from: a label per slice (default), or one per scan (scan_label, a"
                        " report's verdict), the record then context_scans")  # fmt: skip
    parser.add_argument("--family", choices=list(FAMILY_SEEDS), default="cohort",
                        help="the scans' scanner: the cohort's ranges (default), or a held-out family's (near, far;"
                        " benchmarks.small_data), the record then context_near / context_far")  # fmt: skip
    parser.add_argument("--epochs", type=int, default=20, help="fine-tuning epochs (default 20, the recipe's)")
    parser.add_argument("--folder", type=Path, help="where the runs go (default /tmp/vit-ct-context[-FAMILY])")
    parser.add_argument("--num_workers", type=int, default=2, help="processes writing the scan set")
    parser.add_argument("--record", help="the record's name (default context, or context_scans with --labels scan)")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS),
                        help="the rows to run, the first the baseline of the time ratios (default: all)")  # fmt: skip
    args = parser.parse_args(argv)
    family = "" if args.family == "cohort" else f"_{args.family}"
    folder = args.folder or Path("/tmp/vit-ct-context" + family.replace("_", "-"))
    git, start = git_state(), time.perf_counter()
    manifest = scan_set(folder, args.patients, args.slices, args.spacing_mm, args.num_workers, tuple(args.split),
                        args.family)  # fmt: skip
    scans = args.labels == "scan"
    fit_manifest, suffix = (scan_labels_only(manifest), "_scans") if scans else (None, "")
    results = [run_row(name, ROWS[name][1], manifest, folder, args.epochs, fit_manifest, suffix)
               for name in args.rows]  # fmt: skip
    base = results[0]
    rows = [
        [r["row"], r["auroc"], f"{r['low']:.3f}-{r['high']:.3f}", r["scan_auroc"], r["pointing"], r["dice"],
         r["neighbour_share"], r["fit_s"] / base["fit_s"], r["predict_ms_per_slice"] / base["predict_ms_per_slice"]]
        for r in results
    ]  # fmt: skip
    columns = ["input", "slice AUROC", "95% CI (patients)", "scan AUROC", "pointing", "Dice at half max",
               "neighbour kernels / own", f"fit time vs {base['row']}", f"predict time vs {base['row']}"]  # fmt: skip
    formats = [None, ".3f", None, ".3f", ".2f", ".2f", ".3f", "{:.2f}x", "{:.2f}x"]
    figures = {f"{key}_{r['name']}": r[key] for r in results for key in ("auroc", "scan_auroc", "dice")}
    notes = {
        "set": f"{args.patients} simulated scans x {args.slices} slices {args.spacing_mm:g} mm apart"
        f" (seed {FAMILY_SEEDS[args.family]}"
        + ("" if args.family == "cohort" else f", every patient on the scanner of the held-out family {args.family}")
        + "),"
        f" split by patient {'/'.join(f'{100 * share:g}' for share in args.split)} (train/validation/test); train"
        " and validation rows without masks"
        + ("; trained from one label per scan (scan_label), no slice label" if scans else ""),
        "results": results,
    }
    name = args.record or f"context{family}{suffix}"
    path = write_record(name, figures, command=command_line("benchmarks.context", argv),
                        tables={"context": table(columns, rows, formats)}, seconds=time.perf_counter() - start,
                        notes=notes, git=git, **({"folder": records} if records else {}))  # fmt: skip
    print(json.dumps(results, indent=1))
    return path


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
