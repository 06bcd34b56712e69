"""Shared fixtures: a tiny synthetic head-CT set on disk (real DICOM + PNG masks + manifest), built once."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import lightning.pytorch
import pytest
import torch
import yaml

from vit_ct.task.settings import flat_config


def _temporary_folder(variable: str, prefix: str) -> None:
    """Sets ``variable`` to a new temporary folder unless it is set already (the xdist workers inherit the one the
    controller made), and removes the folder when the process that made it ends."""
    if variable not in os.environ:
        os.environ[variable] = folder = tempfile.mkdtemp(prefix=prefix)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)


os.environ.setdefault("WANDB_MODE", "offline")  # tests never reach the network
os.environ.setdefault("WANDB_SILENT", "true")
# W&B stages artifacts (tables) under WANDB_DATA_DIR, by default in the home folder: keep tests out of it.
_temporary_folder("WANDB_DATA_DIR", "vit-ct-wandb-")
# Check records and disk caches of the tests' manifests (by default under ~/.cache/vit-ct): kept out of the home folder.
_temporary_folder("VIT_CT_CACHE_DIR", "vit-ct-cache-")
torch.set_num_threads(min(2, torch.get_num_threads()))
# Under pytest-xdist (`make test` runs two workers) the cores are shared between the workers: each worker's threads, and
# those of the processes its tests start (vit-ct takes OMP_NUM_THREADS as the user's choice), are its share, so that
# two trainings side by side do not spin four OpenMP threads on two cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _SHARE = max(1, len(os.sched_getaffinity(0)) // _WORKERS if hasattr(os, "sched_getaffinity") else 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(_SHARE))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Fixtures of the helper modules, for every folder: cq500_root; orthanc, orthanc_with_user.
pytest_plugins = ["cq500_layout", "orthanc_servers"]
# Lightning, imported before pytest's logging capture is in place (as those plugins import it, on pytest 8), stops its
# logger propagating to the root: what `rank_zero_info` says would then reach stderr only, and `caplog` (which the
# tests read the commands' lines from) would see nothing. Imported here, its lines go to both whatever the order.
logging.getLogger(lightning.pytorch.__name__).propagate = True

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.yaml")
MANIFEST = str(ROOT / "configs" / "manifest.yaml")
# Overrides that shrink the demo config to seconds: a 2-block ViT at 32x32 on 64x64 slices.
TINY_MODEL_ARGS = ["--model.network.embed_dim", "32", "--model.network.depth", "2", "--model.network.num_heads", "2"]
# What the tests' tiny models in Python take from the demo recipe (configs/demo.yaml), which ViTClassifier's defaults
# leave off: stochastic depth and the mask-supervised losses; their width, depth, input and rate are their own.
DEMO_LEVERS = {
    name: flat_config(yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())["model"])[name]
    for name in ("drop_path_rate", "patch_loss_weight", "attention_loss_weight")
}


def run_vit_ct(*args: str, cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    """The installed ``vit-ct`` command in ``cwd`` (W&B offline; ``pythonpath`` first on its path, e.g. for a probe
    callback), run to its end; fails the test with its output if it fails."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    command = [str(Path(sys.executable).with_name("vit-ct")), *args]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now (:func:`benchmarks.orthanc.free_port`)."""
    # imported here: a vit-ct process that loads a test module's probe callback imports this file without the
    # checkout on its path
    from benchmarks.orthanc import free_port as port

    return port()


def tiny_checkpoint_file(path: Path) -> Path:
    """A checkpoint of a tiny untrained ViTClassifier (seed 0, 32 x 32, one channel), saved as fit saves one."""
    import torch

    from vit_ct import ViTClassifier

    torch.manual_seed(0)
    trainer = quiet_trainer()
    trainer.strategy.connect(
        ViTClassifier.from_hparams(**DEMO_LEVERS, embed_dim=32, depth=2, num_heads=2, img_size=32, in_chans=1)
    )
    trainer.save_checkpoint(path)
    return path


def quiet_trainer(**overrides):
    """A Lightning ``Trainer`` for a test in this process: on CPU, with no logger, checkpoint callback, progress bar or
    model summary; ``overrides`` are what the test sets itself (epochs, batches, callbacks, or any of these back on)."""
    import lightning as L  # here, not at the top: most test files never build a Trainer

    settings = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(**{**settings, **overrides})


@pytest.fixture(scope="session")
def synthetic_set(tmp_path_factory):
    """Manifest path of a tiny synthetic set: 6 patients x 4 slices of 64 x 64 pixels."""
    from vit_ct.sim.synthetic import SyntheticCTDataModule

    # The demo's generator settings, so `vit-ct fit --config configs/demo.yaml` + tiny_data_args reuses this set.
    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())["data"]["init_args"]
    generator = {k: demo[k] for k in ("seed", "bleed_fraction", "small_fraction", "low_contrast_fraction") if k in demo}
    data = SyntheticCTDataModule(
        str(tmp_path_factory.mktemp("synthetic")), n_patients=6, slices_per_patient=4, slice_size=64, img_size=32,
        **generator,
    )  # fmt: skip
    data.prepare_data()
    return data.manifest_path()


@pytest.fixture(scope="module")
def tiny_checkpoint(synthetic_set, tmp_path_factory) -> Path:
    """``last.ckpt`` of a one-epoch demo-recipe fit of the tiny ViT (32 x 32: 2 x 2 patches of 16 px) on the tiny
    synthetic set, made once for the tests of a module."""
    from vit_ct.cli import main

    folder = tmp_path_factory.mktemp("fit")
    main(["fit", "--config", DEMO, *tiny_data_args(synthetic_set), *TINY_MODEL_ARGS, "--trainer.max_epochs", "1",
          "--test_after_fit", "false", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
          "--trainer.default_root_dir", str(folder)])  # fmt: skip
    return next(folder.rglob("last.ckpt"))


def tiny_data_args(manifest, *, img_size: int | None = 32) -> list[str]:
    """CLI overrides that point configs/demo.yaml's synthetic data at the tiny set; ``img_size`` None keeps the
    input size the configs resolve to (the README's chains run at it)."""
    root = str(manifest.parent)
    size = ["--data.init_args.img_size", str(img_size)] if img_size else []
    return [
        *size,
        "--data.init_args.root",
        root,
        "--data.init_args.n_patients",
        "6",
        "--data.init_args.slices_per_patient",
        "4",
        "--data.init_args.slice_size",
        "64",
        "--data.init_args.batch_size",
        "8",
    ]


# Fixtures that train, predict or serve (seconds to minutes, shared by the tests of a module): every test that uses
# one is `medium` at least, since the first of them pays for it in `make check` otherwise. The real servers and
# browsers get their own markers too, so that `-m pacs` or `-m browser` selects them.
COSTLY_FIXTURES = {"tiny_checkpoint", "tiny", "predict_run", "first_epoch", "written", "predicted", "hub_cache"}
SERVER_FIXTURES = {"orthanc": "pacs", "orthanc_with_user": "pacs", "orthanc_root": "pacs", "chromium": "browser"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        servers = {marker for name, marker in SERVER_FIXTURES.items() if name in used}
        if item.path.name in ("test_browser.py", "test_ci_browser.py"):
            servers.add("browser")
        for marker in servers:
            item.add_marker(marker)
        if (servers or used & COSTLY_FIXTURES) and not item.get_closest_marker("slow"):
            item.add_marker("medium")


# SIGINT and SIGTERM as this process started: Python's own handlers (captured before any test or fixture ran)
SESSION_HANDLERS = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}


@pytest.fixture(autouse=True)
def _signal_handlers_as_they_were():
    """A test that runs a command in this process (vit-ct's or Lightning's handlers) or sets a handler of its own
    leaves SIGINT and SIGTERM as the session found them, so that no later test depends on the order the tests ran in
    (one that expects Python's KeyboardInterrupt failed after another in the same worker). The session's handlers,
    not the test's: a module-scoped fixture that runs a command in this process (tests/run/test_context.py) sets
    vit-ct's handlers before any test's own fixtures start. Each test starts so too, the two signals unblocked."""

    def as_the_session_found_them():
        for signum, handler in SESSION_HANDLERS.items():
            if signal.getsignal(signum) is not handler and handler is not None:
                signal.signal(signum, handler)
        if threading.current_thread() is threading.main_thread():
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SESSION_HANDLERS)

    as_the_session_found_them()
    yield
    as_the_session_found_them()


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt in this test, as in a terminal, also where the session started with SIGINT
    ignored: a job that a script starts in the background (`make test &`) inherits it ignored, and Python then keeps
    it so (the Ctrl-C tests failed there, never in the foreground). The autouse fixture above restores it after."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _no_inherited_wandb_service():
    """An in-process W&B run (e.g. the callback tests) exports WANDB_SERVICE so that child processes join its service;
    a `vit-ct` started by a later test would then log into this process's service instead of its own, as no user's
    shell does. Each test starts without it."""
    os.environ.pop("WANDB_SERVICE", None)
    yield
