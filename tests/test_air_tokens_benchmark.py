"""benchmarks/air_tokens.py: its "every token" side is the model's function, run the way vit-ct ran it before."""

import torch
from conftest import load_benchmark

from vit_ct.explain.attention import record_attention
from vit_ct.model import ViTClassifier


def test_every_token_side_runs_every_token_through_the_blocks_at_the_same_logits():
    benchmark = load_benchmark("air_tokens")
    skipping = ViTClassifier(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, in_chans=2).eval()
    every = ViTClassifier(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, in_chans=2).eval()
    every.load_state_dict(skipping.state_dict())
    every.forward_features = benchmark.run_every_token(every)
    images = torch.zeros(2, 2, 32, 32)
    images[:, :, 8:, 8:24] = 0.5  # 6 of 16 patches hold tissue
    with torch.no_grad(), record_attention(every, head_fusion="mean") as attentions:
        logits = every(images)
    torch.testing.assert_close(logits, skipping(images).detach())
    air = torch.ones(4, 4, dtype=torch.bool)
    air[1:, 1:3] = False
    rows = attentions[0][0, 0, 1:][air.flatten()]  # the air tokens' own rows: real attention, not identity rows
    assert (rows[:, 1:][:, ~air.flatten()] > 0).all()
