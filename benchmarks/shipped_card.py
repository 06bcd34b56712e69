"""The figures of a shipped model's card, measured again: its card test set regenerated from the seed the card names
(scanner-randomised simulation, patients never in the pretraining), the weights loaded offline by name, every slice
scored in fp32: AUROC, and the rollout against the lesion masks (pointing, in-head pixel AUROC, Dice and HD95 of the
half-maximum region) beside the perfect patch map. Run as a script it writes its record
(``benchmarks/records/shipped_card.json``: the figures, and the SHA-256 of the weights file it scored), which
``python -m vit_ct.model.shipped record NAME benchmarks/records/shipped_card.json`` puts into the card.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch
from rich.progress import track
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader

from benchmarks.recording import RECORDS, command_line, write_record
from vit_ct.data.loading.slice_dataset import CTSliceDataset, collate
from vit_ct.data.manifests.manifest import read_manifest
from vit_ct.explain.maps import localisation_maps
from vit_ct.metrics.localisation import LocalisationMetrics, model_grid_spacing_mm
from vit_ct.model import shipped
from vit_ct.run.hardware import describe_machine
from vit_ct.sim.pretraining import write_pretraining_set
from vit_ct.task import ViTClassifier

USAGE = """example (the card's figures; ~2 min on 2 CPU cores once the set is written):
  .venv/bin/python -m benchmarks.shipped_card vit-ct/headct-tiny-256 --root data/card-test
  .venv/bin/python -m vit_ct.model.shipped record headct-tiny-256 benchmarks/records/shipped_card.json

The card's `card_test` names the set (patients, slices per patient, seed of vit_ct.sim.pretraining); every slice
of it is scored, all splits, in fp32.
"""
FIGURES = ("auroc", "pointing", "pixel_auroc", "dice", "hd95_mm", "perfect_patch_dice", "slices", "lesion_slices")


def card_test_set(tag: str, root: Path, *, num_workers: int = 1, progress: bool = True) -> Path:
    """The card's test set under ``root`` (written once; the simulator continues an interrupted one): whole scans
    (every patient in the test split) where the card names their ``scan_spacing_mm``."""
    spec = shipped.card(tag)["card_test"]
    spacing = spec.get("scan_spacing_mm")
    scans = {"scan_spacing_mm": spacing, "split_fractions": (0.0, 0.0, 1.0)} if spacing else {}
    return write_pretraining_set(
        root, n_patients=spec["patients"], slices_per_patient=spec["slices_per_patient"], seed=spec["seed"],
        num_workers=num_workers, progress=progress, **scans,
    )  # fmt: skip


def measure_in_scan(tag: str, manifest: Path, *, batch_size: int = 48, progress: bool = True) -> dict[str, float]:
    """The card's figures of shipped weights that read a slice in its scan, on every slice of ``manifest``'s test
    split, in fp32, through Lightning's test loop as ``vit-ct test`` runs it: each slice with the neighbours its card
    names, read alone (``auroc``) and in its scan by the weights' sequence head (``auroc_in_scan``; a scan's
    probability its slices' highest, ``scan_auroc_in_scan``), its rollout (one pass, as :func:`measure` reads it)
    against its own lesion mask."""
    import lightning as L

    from vit_ct.data.loading.datamodule import CTSliceDataModule

    model = ViTClassifier.from_hparams(pretrained=tag, sequence=shipped.architecture(tag).get("sequence")).eval()
    data = CTSliceDataModule.from_contract(model.input_contract, manifest=str(manifest), batch_size=batch_size,
                                           num_workers=0)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="32-true", logger=False, enable_checkpointing=False,
                        enable_progress_bar=progress, enable_model_summary=False)  # fmt: skip
    trainer.test(model, datamodule=data, verbose=False)
    logged = {name: float(value) for name, value in trainer.callback_metrics.items()}
    table = data.datasets["test"].table
    return {
        **{name: logged[f"test/{name}"] for name in ("auroc", "auroc_in_scan", "scan_auroc_in_scan")},
        **{name: logged[f"test/rollout_{name}"] for name in ("pointing", "pixel_auroc", "dice", "hd95_mm")},
        "slices": int(len(table)),
        "lesion_slices": int((table["label"].astype(int) > 0).sum()),
    }


def measure(
    tag: str, manifest: Path, *, split: str | None = None, batch_size: int = 32, progress: bool = True
) -> dict[str, float]:
    """The card's figures of the shipped weights ``tag`` on every slice of ``manifest`` (or of its ``split``), fp32."""
    card_input = shipped.input_contract(tag)  # the network at the input size the weights were trained for
    model = ViTClassifier.from_hparams(
        pretrained=tag, img_size=card_input.img_size, in_chans=card_input.in_chans
    ).eval()
    contract = model.input_contract
    table = read_manifest(manifest)
    if split is not None:
        table = table[table["split"] == split].reset_index(drop=True)
    dataset = CTSliceDataset(table, windows=contract.windows, img_size=contract.img_size)
    spacing = model_grid_spacing_mm(contract.img_size)
    tolerance = model.hparams.localisation_tolerance_mm
    rollout_metric, perfect_metric = (LocalisationMetrics(tolerance_mm=tolerance, pixel_spacing_mm=spacing)
                                      for _ in range(2))  # fmt: skip
    probs, labels = [], []
    loader = DataLoader(dataset, batch_size=batch_size, collate_fn=collate)
    for batch in track(loader, description="scoring the card test set", disable=not progress, transient=True):
        with torch.no_grad():
            logits, rollout = model.explain(batch["image"])
        probs.append(model.probabilities(logits).float())
        labels.append(batch["label"])
        maps = localisation_maps(None, batch, rollout=rollout)
        spacings = batch.get("pixel_spacing_mm")
        for metric, source in ((rollout_metric, "rollout"), (perfect_metric, "perfect_patch")):
            metric.update(maps[source], batch["mask"][:, 0], batch["head"][:, 0], known=batch["has_mask"],
                          pixel_spacing_mm=spacings)  # fmt: skip
    probs, labels = torch.cat(probs).numpy(), torch.cat(labels).numpy()
    scores = {key: float(value) for key, value in rollout_metric.compute().items()}
    return {
        "auroc": float(roc_auc_score(labels, probs)),
        **{key: scores[key] for key in ("pointing", "pixel_auroc", "dice", "hd95_mm")},
        "perfect_patch_dice": float(perfect_metric.compute()["dice"]),
        "slices": int(len(labels)),
        "lesion_slices": int(scores["slices"]),
    }


def main(argv: list[str] | None = None, records: Path | None = None) -> dict[str, float]:
    """Measure and print the card's figures; with ``records`` (a folder) also write the record there."""
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("tag", nargs="?", default="vit-ct/headct-tiny-256", help="shipped weights (vit-ct/<name>)")
    parser.add_argument("--root", type=Path, default=Path("data/card-test"), help="where the card test set is built")
    parser.add_argument("--num-workers", type=int, default=1, help="processes of the simulator")
    parser.add_argument("--threads", type=int, help="torch threads of the scoring (default: torch's)")
    parser.add_argument("--record-name", help="the record's name (default shipped_card, or shipped_pretraining_test)")
    parser.add_argument("--pretraining-set", type=Path, help="score the test split of this pretraining set's manifest "
                        "(python -m vit_ct.sim.pretraining's, e.g. data/pretraining/manifest.csv) instead: the card's "
                        "pretraining_test figures")  # fmt: skip
    args = parser.parse_args(argv)
    section = "pretraining_test" if args.pretraining_set else "card_test"
    args.record_name = args.record_name or ("shipped_pretraining_test" if args.pretraining_set else "shipped_card")
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    torch.manual_seed(0)
    if args.pretraining_set:
        manifest, split = args.pretraining_set, "test"
    else:
        manifest, split = card_test_set(args.tag, args.root, num_workers=args.num_workers), None
    written = time.perf_counter()
    in_scan = shipped.card(args.tag)["architecture"].get("sequence") and not args.pretraining_set
    figures = measure_in_scan(args.tag, manifest) if in_scan else measure(args.tag, manifest, split=split)
    print(f"measured on {describe_machine()}, fp32, {torch.get_num_threads()} threads")
    print(pd.Series(figures).to_string())
    if records is not None:
        spec = {k: v for k, v in shipped.card(args.tag)["card_test"].items() if k not in ("figures", "measured")}
        notes = {"weights": args.tag, "weights_sha256": shipped.weights_sha256(shipped.weights_file(args.tag)),
                 "card_section": section, "precision": "32-true", "threads": torch.get_num_threads(),
                 "seconds_writing_the_set": round(written - start, 1)}  # fmt: skip
        notes |= {"manifest": str(manifest), "split": split} if args.pretraining_set else {"card_test": spec}
        write_record(args.record_name, figures, command=command_line("benchmarks.shipped_card", argv),
                     seconds=time.perf_counter() - written, notes=notes, folder=records)  # fmt: skip
    return figures


if __name__ == "__main__":
    main(records=RECORDS)
