"""What skipping air patches saves: the demo model's training step and explained forward pass with air patches masked
as attention keys but still run through every block (timm's ``forward_features(x, attn_mask=...)``, how vit-ct ran
them before) vs skipped (only the tokens that are a key somewhere in the batch run, each slice's air among them still
masked), side by side on the same batches of the demo set, per input size. The logits are the same either way (the
largest difference is printed); the step time is not. Takes ~3-5 minutes on 2 cores:

    python -m benchmarks.air_tokens [--sizes 128 160 192] [--steps 8] [--warmup 2]

Run as a script it writes its record, ``benchmarks/records/air_tokens.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

from benchmarks.recording import RECORDS, command_line, markdown_table, table, write_record
from vit_ct import SyntheticCTDataModule
from vit_ct.model.network import attention_keys
from vit_ct.run.hardware import auto_precision, describe_machine
from vit_ct.task import ViTClassifier
from vit_ct.task.settings import flat_config

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
DEMO_DATA = Path("data/synthetic")  # where `make demo` builds the set (built here if it is not)


def batches_of(size: int, steps: int) -> list[dict]:
    demo = yaml.safe_load(DEMO_CONFIG.read_text())["data"]["init_args"]  # the demo set, as `make demo` builds it
    data = SyntheticCTDataModule(**{**demo, "root": str(DEMO_DATA), "img_size": size, "num_workers": 0})
    data.prepare_data()
    data.setup("fit")
    generator = torch.Generator().manual_seed(0)
    batches = itertools.islice(itertools.cycle(data.train_dataloader()), steps)
    return [data.augmentation(batch, generator) for batch in batches]  # augmented, as training sees them


def step_times(model: ViTClassifier, batches: list[dict], warmup: int, autocast) -> tuple[float, float]:
    """Median seconds of a training step (the model's losses, backward, AdamW) and of an explained forward pass."""
    optimizer = torch.optim.AdamW(model.param_groups(), lr=1e-4)
    train, explain = [], []
    for batch in batches:
        model.train()
        start = time.perf_counter()
        with autocast():
            loss = model.losses(batch)[0]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        train.append(time.perf_counter() - start)
        model.eval()
        start = time.perf_counter()
        with autocast():
            model.explained(batch["image"])
        explain.append(time.perf_counter() - start)
    return statistics.median(train[warmup:]), statistics.median(explain[warmup:])


def main(argv: list[str] | None = None, records: Path | None = None) -> str:
    """Measure and print the table; with ``records`` (a folder) also write the record ``air_tokens.json`` there."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 160, 192])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    precision = auto_precision("cpu")[0]
    bf16 = precision.startswith("bf16")
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    print(f"machine: {describe_machine()}; precision {precision}; demo model, batch 32", file=sys.stderr)
    rows, figures = [], {}
    for size in args.sizes:
        batches = batches_of(size, args.warmup + args.steps)
        torch.manual_seed(0)
        demo = flat_config(yaml.safe_load(DEMO_CONFIG.read_text())["model"])  # the demo model, as `make demo` trains it
        skipped = ViTClassifier.from_hparams(**demo, img_size=size, in_chans=2)
        every = ViTClassifier.from_hparams(**demo, img_size=size, in_chans=2)
        every.load_state_dict(skipped.state_dict())
        # forward_features as it was: air masked as keys, every token through every block
        reference = every.vit.forward_features_every_token
        every.vit.forward_features = lambda image, *args, reference=reference, **kwargs: reference(image)  # noqa: ARG005
        with torch.no_grad():
            skipped.eval(), every.eval()
            difference = max((skipped(b["image"]) - every(b["image"])).abs().max().item() for b in batches[:2])
        patch, prefix = skipped.hparams.patch_size, skipped.vit.num_prefix_tokens
        keys = [attention_keys(b["image"], patch, prefix)[:, 0, 0] for b in batches]
        run = statistics.mean(k.sum(1).max().item() / k.shape[1] for k in keys)  # tokens the blocks run, per batch
        head = statistics.mean(k.float().mean().item() for k in keys)  # tokens that are keys, per slice
        # alternate the two, so that a slow moment of the machine does not fall on one of them only
        times = {"every": [], "skipped": []}
        for _ in range(2):
            for name, model in (("every", every), ("skipped", skipped)):
                times[name].append(step_times(model, batches, args.warmup, autocast))
        (every_train, every_explain), (skip_train, skip_explain) = (
            tuple(min(t[i] for t in times[name]) for i in range(2)) for name in ("every", "skipped")
        )
        rows.append([size, (size // 16) ** 2 + 1, f"{run:.0%} ({head:.0%})", 1000 * every_train, 1000 * skip_train,
                     every_train / skip_train, 1000 * every_explain, 1000 * skip_explain,
                     every_explain / skip_explain, difference])  # fmt: skip
        figures |= {f"train_speedup_{size}": every_train / skip_train, f"explain_speedup_{size}": every_explain /
                    skip_explain, f"max_logit_difference_{size}": difference}  # fmt: skip
        print(rows[-1], file=sys.stderr, flush=True)
    columns = ["input", "tokens", "run by the blocks when air skips (key tokens per slice)",
               "train step ms: every token", "air skipped", "speed-up", "explained forward ms: every token",
               "air skipped", "speed-up", "max logit difference"]  # fmt: skip
    results = table(columns, rows, ["d", "d", None, ".0f", ".0f", "{:.2f}x", ".0f", ".0f", "{:.2f}x", ".1e"])
    print(markdown_table(results))
    if records is not None:
        notes = {"precision": precision, "batch": 32, "steps": args.steps, "warmup": args.warmup}
        write_record("air_tokens", figures, command=command_line("benchmarks.air_tokens", argv),
                     tables={"air_tokens": results}, seconds=time.perf_counter() - start, notes=notes,
                     folder=records)  # fmt: skip
    return markdown_table(results)


if __name__ == "__main__":
    main(records=RECORDS)
