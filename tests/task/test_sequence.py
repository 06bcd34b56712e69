"""The sequence heads (vit_ct.model.sequence): each slice read in its scan, against a GRU or a transformer run by hand
on each scan in position order; its training memory, its loss, and the scan AUROC of slices read in scan."""

from __future__ import annotations

import math

import pytest
import torch
from sklearn.metrics import roc_auc_score

from vit_ct import ViTClassifier
from vit_ct.model.sequence import ScanSequence, ScanTransformer, in_scan_logits, scan_order, sinusoid
from vit_ct.task.scan_reading import EmbeddingMemory, scan_auroc_in_scan, training_in_scan

NAN = float("nan")


def trained(dim: int = 8, outputs: int = 2, seed: int = 0, kind: str = "gru") -> torch.nn.Module:
    """A sequence head whose correction is not zero (a fresh one's is), in eval mode (no dropout)."""
    torch.manual_seed(seed)
    sequence = ScanSequence(dim, outputs, hidden=6) if kind == "gru" else ScanTransformer(dim, outputs, width=12)
    torch.nn.init.normal_(sequence.out.weight)
    torch.nn.init.normal_(sequence.out.bias)
    return sequence.eval()


def by_hand(sequence: torch.nn.Module, embeddings: torch.Tensor) -> torch.Tensor:
    """The correction of one scan's slices, in order, unpadded: the GRU over the whole sequence, or the transformer's
    blocks over the projected slices plus the encodings of their places."""
    if isinstance(sequence, ScanSequence):
        out, _ = sequence.gru(sequence.norm(embeddings)[None])
        return sequence.out(out[0])
    x = sequence.proj(sequence.norm(embeddings)) + sinusoid(len(embeddings), sequence.proj.out_features)
    for block in sequence.encoder.layers:
        x = block(x[None])[0]
    return sequence.out(sequence.out_norm(x))


def test_the_places_are_encoded_as_vaswani_et_al_write_them():
    encoding = sinusoid(5, 6)
    for place in range(5):
        for i in range(3):
            angle = place / 10_000 ** (2 * i / 6)
            assert encoding[place, 2 * i] == pytest.approx(math.sin(angle), abs=1e-6)
            assert encoding[place, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-6)


def test_scan_order_keeps_each_scans_rows_together_in_position_order():
    order, scan, slot = scan_order(torch.tensor([1, 0, 1, -1, 0, -1]), torch.tensor([5.0, 3.0, 1.0, 0.0, NAN, 2.0]))
    # scan 0: row 1 (3 mm), then row 4 (no position: last); scan 1: row 2 (1 mm), row 0 (5 mm); rows 3, 5 alone
    assert order.tolist() == [1, 4, 2, 0, 3, 5]
    assert scan.tolist() == [0, 0, 1, 1, 2, 3]
    assert slot.tolist() == [0, 1, 0, 1, 0, 0]


@pytest.mark.parametrize("head", [ScanSequence, ScanTransformer])
def test_a_fresh_head_reads_every_slice_as_the_slice_network_does(head):
    logits = torch.randn(7, 3)
    out = in_scan_logits(head(8, 3), torch.randn(7, 8), logits, torch.tensor([0, 0, 1, 1, 1, -1, 0]),
                         torch.arange(7.0))  # fmt: skip
    assert torch.equal(out, logits)


@pytest.mark.parametrize("kind", ["gru", "transformer"])
def test_each_slice_in_scan_equals_the_head_run_by_hand_over_its_scan_alone(kind):
    sequence = trained(kind=kind)
    torch.manual_seed(1)
    volumes = torch.tensor([2, 0, 2, 0, -1, 2, 0, 2, 2])  # scans of 5 and 3 slices (padding), one slice alone
    positions = torch.tensor([40.0, 10.0, -5.0, 0.0, 3.0, 12.5, 5.0, 30.0, 0.0])
    embeddings, logits = torch.randn(9, 8), torch.randn(9, 2)
    with torch.no_grad():
        out = in_scan_logits(sequence, embeddings, logits, volumes, positions)
        for volume in (0, 2, -1):
            rows = (volumes == volume).nonzero().squeeze(1)
            rows = rows[positions[rows].argsort()]
            assert torch.allclose(out[rows], logits[rows] + by_hand(sequence, embeddings[rows]), atol=1e-5)
        # the rows' order in the batch changes nothing
        shuffle = torch.randperm(9)
        again = in_scan_logits(sequence, embeddings[shuffle], logits[shuffle], volumes[shuffle], positions[shuffle])
    assert torch.allclose(again, out[shuffle], atol=1e-6)


def test_the_memory_recalls_the_other_slices_of_the_batchs_volumes_only():
    memory = EmbeddingMemory()
    memory.update(torch.tensor([0, 1, 2, 5]), torch.tensor([0, 0, 1, -1]), torch.tensor([0.0, 5.0, 0.0, NAN]),
                  torch.arange(8.0).reshape(4, 2))  # fmt: skip
    embeddings, volumes, positions = memory.recall(torch.tensor([1, 7]), torch.tensor([0, -1]))
    assert volumes.tolist() == [0] and positions.tolist() == [0.0]  # row 0: row 1 is in the batch, row 5 has no scan
    assert embeddings.tolist() == [[0.0, 1.0]]


def test_training_reads_a_batch_with_the_remembered_slices_of_its_scans():
    sequence = trained(seed=3)
    torch.manual_seed(4)
    embeddings, logits = torch.randn(5, 8).bfloat16().float(), torch.randn(5, 2)  # bf16: as the memory keeps them
    volumes, positions = torch.tensor([0, 0, 0, 0, 0]), torch.tensor([0.0, 5.0, 10.0, 15.0, 20.0])
    memory = EmbeddingMemory()
    first = {"index": torch.tensor([0, 2, 4]), "volume": volumes[[0, 2, 4]], "position_mm": positions[[0, 2, 4]]}
    second = {"index": torch.tensor([1, 3]), "volume": volumes[[1, 3]], "position_mm": positions[[1, 3]]}
    with torch.no_grad():
        training_in_scan(sequence, memory, first, embeddings[[0, 2, 4]], logits[[0, 2, 4]])
        out = training_in_scan(sequence, memory, second, embeddings[[1, 3]], logits[[1, 3]])
        whole = in_scan_logits(sequence, embeddings, logits, volumes, positions)
    assert torch.allclose(out, whole[[1, 3]], atol=1e-5)


@pytest.mark.parametrize("kind", ["gru", "transformer"])
def test_the_model_scores_slices_in_scan_and_trains_the_head(kind):
    model = ViTClassifier.from_hparams(sequence=kind, img_size=32, in_chans=3, depth=1, embed_dim=16, num_heads=2)
    model.train()
    batch = {"image": torch.rand(4, 3, 32, 32), "label": torch.tensor([0, 1, -1, 1]), "index": torch.arange(4),
             "volume": torch.tensor([0, 0, 1, 1]), "position_mm": torch.tensor([0.0, 5.0, 0.0, 5.0]),
             "mask": torch.zeros(4, 1, 32, 32), "has_mask": torch.zeros(4, dtype=torch.bool)}  # fmt: skip
    loss, _, parts = model.losses(batch)
    assert torch.allclose(parts["in_scan_loss"], parts["cls_loss"])  # a fresh head: the slices alone
    loss.backward()
    assert model.sequence.out.weight.grad.abs().sum() > 0
    assert any(model.sequence.out.weight is p for group in model.param_groups() for p in group["params"])


def test_the_scan_auroc_in_scan_takes_each_scans_highest_slice():
    rows = {"volume": torch.tensor([0, 0, 1, 1, 2, 2, -1]), "index": torch.arange(7),
            "label": torch.tensor([0, 1, 0, 0, 0, -1, 1])}  # fmt: skip
    probs = torch.tensor([0.2, 0.7, 0.9, 0.1, 0.3, 0.8, 0.95])
    # scan 2 has a slice of unknown label: its label is unknown; the slice with no volume is no scan
    assert scan_auroc_in_scan(probs, rows, "binary", ["0", "1"]) == pytest.approx(roc_auc_score([1, 0], [0.7, 0.9]))
    given = dict(rows, scan_label=torch.tensor([1, 1, 0, 0, 1, 1, 0]))  # scan labels decide where given
    expected = roc_auc_score([1, 0, 1], [0.7, 0.9, 0.8])
    assert scan_auroc_in_scan(probs, given, "binary", ["0", "1"]) == pytest.approx(expected)


def test_start_weights_without_a_sequence_start_it_fresh_and_say_so():
    with pytest.warns(UserWarning, match="the sequence head \\(not in the weights\\)"):
        model = ViTClassifier.from_hparams(pretrained="vit-ct/headct-tiny-256", sequence="gru").eval()
    plain = ViTClassifier.from_hparams(pretrained="vit-ct/headct-tiny-256").eval()
    image = torch.rand(2, model.hparams.in_chans, model.hparams.img_size, model.hparams.img_size)
    with torch.no_grad():
        assert torch.equal(model(image), plain(image))  # the slice network is the weights'
    assert model.sequence.out.weight.abs().sum() == 0
