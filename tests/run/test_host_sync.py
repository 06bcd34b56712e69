"""Training steps that never make the host wait for the device: outside the model's own step (its losses, backward
pass and optimizer step, the same in any loop), `vit-ct fit`'s loop (reading, moving and augmenting the batch,
logging, the progress bar, callbacks) runs no tensor operation that reads a value or sizes an output by the values.
Counted on the CPU with a dispatch hook (tests/probes.py ``HostSyncs``): on a GPU each such operation is a wait."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, TINY_MODEL_ARGS, run_vit_ct, tiny_data_args


@pytest.mark.medium
def test_fit_steps_read_no_value_from_the_device_between_logging_steps(synthetic_set, tmp_path):
    counts = tmp_path / "syncs.json"
    data = [*tiny_data_args(synthetic_set), "--data.init_args.batch_size", "2"]  # several steps an epoch
    run_vit_ct(
        "fit", "--config", str(ROOT / "configs" / "demo.yaml"), *data, *TINY_MODEL_ARGS,
        "--trainer.max_epochs", "2", "--trainer.limit_val_batches", "0", "--test_after_fit", "false",
        "--trainer.log_every_n_steps", "1000",  # no step is a logging step: those read the logged values, by design
        "--trainer.default_root_dir", str(tmp_path / "runs"),
        "--trainer.callbacks+=probes.HostSyncs", "--trainer.callbacks.path", str(counts),
        cwd=tmp_path, pythonpath=ROOT / "tests",
    )  # fmt: skip
    record = json.loads(counts.read_text())
    epochs = record["epoch"]
    # a step whose count spans an epoch's end holds that end's reads (checkpoint name, epoch line): once an epoch
    within = [i for i in range(1, len(epochs)) if epochs[i] == epochs[i - 1]]
    assert len(within) >= 4, epochs
    assert all(record["model"][i] > 0 for i in within)  # the hook sees the model's own (data-dependent losses)
    assert sum(record["loop"][i] for i in range(len(epochs)) if i not in within) > 0  # and the loop's, at epoch ends
    per_step = {i: record["loop"][i] for i in within if record["loop"][i]}
    assert not per_step, f"host waits in vit-ct's loop at steps {per_step}: {record['where']}"
