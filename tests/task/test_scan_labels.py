"""Training from scan labels (multiple-instance learning over slices): the manifest's scan labels, the bag pooling
against hand-computed values, the grouped training order, and a fit through the real command in which no slice of
a scan with a lesion is ever used as a slice label."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TINY_MODEL_ARGS
from npy_manifest import BEST_BY_VAL_AUROC, manifest_args, write_npy_manifest

from vit_ct.data.datasets import write_dataset_manifest
from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.data.loading.distributed import EpochShuffleSampler
from vit_ct.data.loading.slice_dataset import CTSliceDataset
from vit_ct.data.manifests.manifest import read_manifest
from vit_ct.data.manifests.splits import assign_splits
from vit_ct.task.losses import classification_loss
from vit_ct.task.scan_bags import ScanBags, ScanMemory, lesion_evidence, pool_bags


def _scan_manifest(folder: Path, rows: list[tuple[int, str, int | str]], *, extra: str = "") -> Path:
    """A manifest of .npy slices: (scan label, scan, split) per row."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["image,scan_label,scan,patient_id,split" + extra]
    for i, (label, scan, split) in enumerate(rows):
        np.save(folder / f"s{i}.npy", np.full((8, 8), 30.0, np.float32))
        lines.append(f"s{i}.npy,{label},{scan},p_{scan},{split}")
    path = folder / "m.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_scan_label_makes_slices_of_a_lesion_free_scan_negative_and_the_others_unknown(tmp_path):
    path = _scan_manifest(tmp_path, [(0, "a", "train"), (0, "a", "train"), (1, "b", "train"), (1, "b", "train")])
    table = read_manifest(path)
    assert table.attrs["scan_labels"] == ["scan_label"]
    assert table["label"].tolist()[:2] == [0, 0] and table["label"].isna().tolist()[2:] == [True, True]
    dataset = CTSliceDataset(table, windows=[(40, 80)], img_size=8)
    assert dataset.labels.tolist() == [0, 0, -1, -1]  # no slice of scan b carries a slice label
    assert dataset.scan_labels.tolist() == [0, 0, 1, 1]
    item = dataset[2]
    assert item["scan_label"] == 1 and item["label"] == -1 and item["scan"] == dataset.scans[2] != dataset.scans[0]


def test_the_rows_of_a_scan_must_agree_and_scans_must_be_named(tmp_path):
    path = _scan_manifest(tmp_path / "a", [(0, "a", "train"), (1, "a", "train"), (1, "b", "train")])
    with pytest.raises(ValueError, match=r"m\.csv: 'scan_label' is one label per scan.*lines 2, 3"):
        read_manifest(path)
    bare = tmp_path / "b" / "m.csv"
    bare.parent.mkdir()
    np.save(bare.parent / "x.npy", np.zeros((4, 4), np.float32))
    bare.write_text("image,scan_label\nx.npy,1\n")
    with pytest.raises(ValueError, match="need each row's scan: a 'scan' column"):
        read_manifest(bare)


@pytest.mark.parametrize("cache", [False, "memory", "disk"])
def test_every_cache_gives_a_batch_its_scan_labels_and_keeps_scans_together(tmp_path, cache):
    manifest = _scan_labelled(tmp_path, train=12, val=6)
    data = CTSliceDataModule(str(manifest), cache=cache, cache_dir=str(tmp_path / "cache"), img_size=32,
                             windows=["brain"], batch_size=6, num_workers=0, augment=False)  # fmt: skip
    data.setup("fit")
    table = data.split_table("train")
    for batch in data.train_dataloader():
        rows = table.iloc[batch["index"].numpy()]
        assert batch["scan_label"].tolist() == rows["scan_label"].tolist()
        assert batch["label"].tolist() == [0 if s == 0 else -1 for s in rows["scan_label"]]
        assert len(set(rows["scan"])) == 2  # two whole 3-slice scans per batch of 6
        assert len(set(batch["scan"].tolist())) == 2


def test_multilabel_scan_columns_stand_in_for_missing_label_columns(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((4, 4), np.float32))
    (tmp_path / "m.csv").write_text("image,scan,scan_sdh,scan_edh\nx.npy,a,1,0\nx.npy,a,1,0\nx.npy,b,0,0\n")
    table = read_manifest(tmp_path / "m.csv", label_columns=["sdh", "edh"])
    assert table.attrs["scan_labels"] == ["scan_sdh", "scan_edh"]
    assert table["sdh"].isna().tolist() == [True, True, False] and table["edh"].tolist() == [0, 0, 0]
    dataset = CTSliceDataset(table, windows=[(40, 80)], img_size=4, label_columns=["sdh", "edh"])
    assert dataset.labels.tolist() == [[-1, 0], [-1, 0], [0, 0]]


def test_the_split_keeps_scans_with_a_lesion_in_every_split(tmp_path):
    rows = [(s % 2, f"s{s}", "") for s in range(12) for _ in range(3)]
    table = assign_splits(read_manifest(_scan_manifest(tmp_path, rows)), fractions=(0.5, 0.25, 0.25), seed=0)
    for split in ("train", "val", "test"):
        assert set(table.loc[table["split"] == split, "scan_label"]) == {0, 1}, split


def test_a_set_drawn_as_scans_has_patients_without_any_bleed_and_older_sets_keep_their_description():
    from dataclasses import replace

    from vit_ct.sim.phantom import PhantomConfig
    from vit_ct.sim.synthetic import generator_description, simulate_patient

    config = replace(PhantomConfig(size=64, pixel_spacing_mm=3.6), patient_bleed_fraction=0.5, bleed_fraction=0.5)
    patients = [[s.label for s in simulate_patient(1, i, 6, config)] for i in range(16)]
    clean = [labels for labels in patients if not any(labels)]
    assert 3 <= len(clean) <= 13 and len(clean) < len(patients)  # about half bleed at all; the rest on no slice
    assert any(0 < sum(labels) < 6 for labels in patients)  # a bleeding patient's scan holds clean slices too
    assert "patient_bleed_fraction" not in generator_description(1, 1, 0, PhantomConfig(), (1, 0, 0))["config"]
    with pytest.raises(ValueError, match="patient_bleed_fraction"):
        PhantomConfig(patient_bleed_fraction=1.5)


def test_bags_pool_by_the_log_sum_exp_mean_as_computed_by_hand():
    evidence = torch.tensor([[2.0], [-1.0], [0.5], [3.0], [-4.0]])
    bags = torch.tensor([7, 7, 3, 7, 3])
    valid = torch.tensor([[True], [True], [True], [False], [True]])
    ids, pooled, counts = pool_bags(evidence, bags, valid, sharpness=2.0)
    assert ids.tolist() == [3, 7] and counts[:, 0].tolist() == [2, 2]
    by_hand_3 = math.log((math.exp(2 * 0.5) + math.exp(2 * -4.0)) / 2) / 2
    by_hand_7 = math.log((math.exp(2 * 2.0) + math.exp(2 * -1.0)) / 2) / 2  # the invalid 3.0 left out
    assert pooled[:, 0].tolist() == pytest.approx([by_hand_3, by_hand_7], rel=1e-6)
    # a bag with no valid member pools to -inf and gives no NaN gradient to the others
    evidence.requires_grad_(True)
    _, pooled, _ = pool_bags(evidence, bags, torch.tensor([[True], [True], [False], [True], [False]]), 2.0)
    assert pooled[0, 0] == float("-inf")
    pooled[1, 0].backward()
    assert torch.isfinite(evidence.grad).all() and evidence.grad[[2, 4]].eq(0).all()
    weights = torch.softmax(torch.tensor([4.0, -2.0, 6.0]), 0)  # d pooled / d z_i: each member's softmax share
    assert evidence.grad[[0, 1, 3], 0].tolist() == pytest.approx(weights.tolist(), rel=1e-6)


def test_the_scan_loss_scores_each_scan_once_against_its_label_with_remembered_slices():
    bags = ScanBags("binary", patch_size=16, num_prefix_tokens=1, sharpness=1.0)
    logits = torch.tensor([[0.0, 1.0], [0.0, -2.0], [0.0, 0.5]])  # lesion log-odds 1, -2, 0.5
    batch = {"scan": torch.tensor([0, 0, 1]), "scan_label": torch.tensor([1, 1, 0]), "index": torch.tensor([0, 1, 2])}
    [(name, weight, loss)] = bags(batch, logits, None, remember=True)
    scan0 = math.log((math.exp(1) + math.exp(-2)) / 2)
    expected = (
        -math.log(torch.sigmoid(torch.tensor(scan0)).item()) - math.log(1 - torch.sigmoid(torch.tensor(0.5)).item())
    ) / 2
    assert name == "scan_loss" and weight == 1.0 and loss.item() == pytest.approx(expected, rel=1e-6)
    # the next batch holds one more slice of scan 0: its bag pools the two remembered slices (detached) with it
    batch = {"scan": torch.tensor([0]), "scan_label": torch.tensor([1]), "index": torch.tensor([3])}
    live = torch.tensor([[0.0, 3.0]], requires_grad=True)
    [(_, _, loss)] = bags(batch, live, None, remember=True)
    pooled = math.log((math.exp(1) + math.exp(-2) + math.exp(3)) / 3)
    assert loss.item() == pytest.approx(-math.log(torch.sigmoid(torch.tensor(pooled)).item()), rel=1e-6)
    loss.backward()
    assert live.grad is not None and bags.memory.evidence.shape == (4, 1)


def test_multiclass_and_multilabel_evidence_is_the_log_odds_of_a_lesion():
    logits = torch.tensor([[1.0, 0.0, 2.0]])
    p = torch.softmax(logits, 1)[0]
    assert lesion_evidence(logits, "multiclass").item() == pytest.approx(math.log((1 - p[0]) / p[0]), rel=1e-6)
    assert lesion_evidence(logits, "multilabel").tolist() == logits.tolist()


def test_memory_recalls_only_other_slices_of_the_batch_scans():
    memory = ScanMemory()
    memory.update(torch.tensor([0, 1, 4]), torch.tensor([5, 6, 5]), torch.tensor([[1.0], [2.0], [3.0]]))
    evidence, scans = memory.recall(torch.tensor([0]), torch.tensor([5]))
    assert evidence.tolist() == [[3.0]] and scans.tolist() == [5]


def test_unknown_labels_leave_the_slice_loss_and_an_all_known_batch_is_unchanged():
    logits = torch.tensor([[0.2, -0.1], [1.0, 0.3], [-0.5, 0.4]])
    label = torch.tensor([0, -1, 1])
    assert classification_loss(logits, label, "binary").item() == pytest.approx(
        torch.nn.functional.cross_entropy(logits[[0, 2]], label[[0, 2]]).item()
    )
    assert classification_loss(logits, torch.tensor([-1, -1, -1]), "binary") is None
    full = torch.tensor([0, 1, 1])
    assert torch.equal(classification_loss(logits, full, "binary"), torch.nn.functional.cross_entropy(logits, full))


@pytest.mark.parametrize("task", ["binary", "multilabel"])
def test_slice_metrics_leave_unknown_labels_out_and_take_a_batch_of_only_unknown_ones(task):
    from sklearn.metrics import roc_auc_score

    from vit_ct.metrics.classification import classification_metrics

    rng = np.random.default_rng(0)
    probs = torch.from_numpy(rng.random((40, 2) if task == "multilabel" else 40)).float()
    labels = torch.from_numpy(rng.integers(-1, 2, probs.shape))
    metrics = classification_metrics(task, 2, "val/")
    metrics.update(probs[:20], labels[:20])
    metrics.update(probs[20:24], torch.full_like(labels[20:24], -1))  # a batch of a positive scan's slices only
    metrics.update(probs[24:], labels[24:])
    labels[20:24] = -1
    values = metrics.compute()
    if task == "binary":
        known = labels >= 0
        assert values["val/auroc"].item() == pytest.approx(roc_auc_score(labels[known], probs[known]), rel=1e-6)
        assert values["val/accuracy"].item() == pytest.approx(
            ((probs[known] > 0.5).long() == labels[known]).float().mean().item()
        )
    else:
        for column in range(2):
            known = labels[:, column] >= 0
            expected = roc_auc_score(labels[known, column], probs[known, column])
            assert values[f"val/auroc_{column}"].item() == pytest.approx(expected, rel=1e-6)


def test_the_training_order_keeps_each_scan_together_and_deals_every_slice_once():
    groups = np.repeat(np.arange(7), [3, 1, 4, 2, 5, 2, 3])  # 20 slices of 7 scans
    dataset = list(range(len(groups)))
    orders = []
    for rank in range(2):
        sampler = EpochShuffleSampler(dataset, num_replicas=2, rank=rank, seed=3, groups=groups)
        sampler.set_epoch(1)
        orders.append(list(sampler))
    together = orders[0] + orders[1]
    assert sorted(together) == dataset  # every slice once (20 divides evenly over 2 ranks)
    runs = [g for i, g in enumerate(groups[together]) if i == 0 or g != groups[together][i - 1]]
    assert len(runs) <= 8 and len(set(runs)) == 7  # contiguous scans (one may be cut at the ranks' border)
    again = EpochShuffleSampler(dataset, num_replicas=2, rank=0, seed=3, groups=groups)
    again.set_epoch(1)
    assert list(again) == orders[0]  # a function of (seed, epoch): resumable


def _scan_labelled(tmp_path: Path, **sizes) -> Path:
    """write_npy_manifest's slices as scans of three slices of one label each, labelled by scan only."""
    manifest = write_npy_manifest(tmp_path / "data", **sizes)
    table = pd.read_csv(manifest)
    table["scan"] = [f"scan{i // 6}_{i % 2}" for i in range(len(table))]  # 3 slices of one label, in one split
    table["patient_id"] = table["scan"]
    table["scan_label"] = table.groupby("scan")["label"].transform("max")
    table.drop(columns=["label"]).assign(pixel_spacing_mm=0.8).to_csv(manifest, index=False)
    return manifest


def _fit(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(Path(__file__).parents[1])}
    run = subprocess.run([str(Path(sys.executable).with_name("vit-ct")), "fit", *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


@pytest.mark.slow
def test_fit_from_scan_labels_through_the_command(tmp_path):
    """A tiny model trained from scan labels through `vit-ct fit`: the losses read no slice of a scan with a lesion as
    a slice label, batches hold whole scans, the scan losses run, and validation and test report scan AUROC."""
    manifest = _scan_labelled(tmp_path, train=12, val=6, test=6)
    record = tmp_path / "labels.jsonl"
    run = _fit(tmp_path, *manifest_args(manifest, batch_size=4), *TINY_MODEL_ARGS, "--trainer.max_epochs", "2",
               "--model.losses.mil_loss_weight", "1.0", "--test_after_fit", "true", *BEST_BY_VAL_AUROC,
               "--trainer.callbacks+=probes.RecordLabels", "--trainer.callbacks.path", str(record))  # fmt: skip
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    batches = [line for line in lines if "batch" in line]
    logged = set(lines[-1]["logged"])
    assert {"train/scan_loss", "train/scan_mil_loss", "train/cls_loss", "val/scan_auroc"} <= logged, sorted(logged)
    assert len(batches) == 2 * 3  # 12 training slices in batches of 4, two epochs
    for batch in batches:
        for label, scan_label in zip(batch["label"], batch["scan_label"], strict=True):
            assert label == (-1 if scan_label == 1 else 0)  # a positive scan's slices: never a slice label
        assert len(set(batch["scan"])) <= 2  # 4 slices of 3-slice scans: whole scans, at most one cut
    summary = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())
    assert 0 <= summary["metrics"]["test/scan_auroc"] <= 1, summary["metrics"]
    assert "scan_auroc" in run.stdout
    # val/auroc is undefined without slice labels of lesions: the best checkpoint is chosen on val/scan_auroc
    assert "the best checkpoint is chosen on val/scan_auroc" in run.stdout + run.stderr
    assert summary["kept_checkpoint"] == "best val/scan_auroc (max)", summary["kept_checkpoint"]
    assert Path(summary["best_checkpoint"]).name.startswith("best-epoch")


@pytest.mark.slow
@pytest.mark.ddp
def test_two_process_fit_from_scan_labels_remembers_every_ranks_slices(tmp_path):
    """Under DDP (2 gloo processes) each rank's bags pool the slices the other rank trained on: the memory is
    gathered every step, so both ranks hold every training slice's evidence, and agree on the scan AUROC."""
    manifest = _scan_labelled(tmp_path, train=12, val=6)
    ddp = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    probe = ["--trainer.callbacks+=probes.RecordScanMemory", "--trainer.callbacks.folder", str(tmp_path / "rec")]
    _fit(tmp_path, *manifest_args(manifest, batch_size=3), *TINY_MODEL_ARGS, *ddp, *probe, "--trainer.max_epochs",
         "1", "--trainer.logger", "false")  # fmt: skip
    ranks = [json.loads((tmp_path / "rec" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["rows"] == ranks[1]["rows"] == list(range(12))
    assert ranks[0]["scan_auroc"] == ranks[1]["scan_auroc"] is not None


def test_a_cq500_manifest_as_written_trains_from_its_scan_labels_and_subtypes(cq500_root, tmp_path):  # noqa: F811
    """`vit-ct manifest --dataset cq500` writes scan labels only: read as they are, they train (here: the data the
    losses see), for "a bleed" and, with label_columns, per subtype from the scan_<subtype> columns."""
    out = tmp_path / "cq500.csv"
    write_dataset_manifest("cq500", cq500_root, out, progress=False)
    table = pd.read_csv(out, keep_default_na=False)
    table["split"] = table["scan"].map({"CQ500-CT-0": "train", "CQ500-CT-1": "train", "CQ500-CT-2": "val",
                                        "CQ500-CT-3": "test"})  # fmt: skip
    table.to_csv(out, index=False)
    for label_columns in (None, ["intraparenchymal", "subdural"]):
        options = {"img_size": 16, "windows": ["brain"], "batch_size": 64, "num_workers": 0, "augment": False}
        data = CTSliceDataModule(str(out), label_columns=label_columns, cache_dir=str(tmp_path / "c"), **options)
        data.setup("fit")
        batch = next(iter(data.train_dataloader()))
        rows = data.split_table("train").iloc[batch["index"].numpy()]
        if label_columns is None:  # study 0: a bleed by 2 of 3 readers; study 1: by 1 of 3, so none
            assert batch["scan_label"].tolist() == [int(s == "CQ500-CT-0") for s in rows["scan"]]
            assert batch["label"].tolist() == [-1 if s == "CQ500-CT-0" else 0 for s in rows["scan"]]
        else:  # study 0: intraparenchymal by 1 reader and subdural by 1: neither by the majority
            assert batch["scan_label"].tolist() == [[0, 0]] * len(rows)
            assert batch["label"].tolist() == [[0, 0]] * len(rows)
