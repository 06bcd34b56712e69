"""Where a review's model and slices come from: the project folder, the checkpoint (the latest run's by default), its
run's config, and a data module that prepares the slices as the model was trained."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
import yaml

from vit_ct.data.loading.datamodule import CTSliceDataModule
from vit_ct.data.manifests.splits import SPLIT_FRACTIONS
from vit_ct.data.transforms.windows import parse_windows
from vit_ct.explain.map_reading import DEFAULT_READING, MapReading
from vit_ct.run.runs import LATEST_SUMMARY
from vit_ct.task import ViTClassifier


def project_root(start: str | os.PathLike | None = None) -> Path:
    """The nearest of ``start`` (default: the working folder) and its parents holding ``pyproject.toml`` or
    ``runs/latest``, else ``start``: Jupyter starts a notebook's kernel in ``notebooks/``, papermill where it runs."""
    start = Path(start or os.getcwd()).resolve()
    for folder in (start, *start.parents):
        if (folder / "pyproject.toml").is_file() or (folder / "runs" / "latest").exists():
            return folder
    return start


def project_path(path: str | os.PathLike) -> Path:
    """``path`` as given when absolute or found from the working folder, else relative to :func:`project_root`."""
    path = Path(path).expanduser()
    if path.is_absolute() or path.exists():
        return path.resolve()
    return project_root() / path


def resolve_checkpoint(ckpt_path: str | os.PathLike | None) -> Path:
    """The checkpoint to review; None: ``best_checkpoint`` (else ``last_checkpoint``) of ``runs/latest/summary.json``.

    Raises:
        ValueError: the checkpoint or the summary does not exist, saying what to do.
    """
    if ckpt_path is None:
        summary = project_path(LATEST_SUMMARY)
        if not summary.is_file():
            raise ValueError(f"ckpt_path is None and {summary} does not exist: run `make demo` or set ckpt_path")
        runs = json.loads(summary.read_text())
        ckpt_path = runs.get("best_checkpoint") or runs.get("last_checkpoint")
        if not ckpt_path:
            raise ValueError(f"{summary} names no checkpoint: set ckpt_path")
    path = project_path(ckpt_path)
    if not path.is_file():
        raise ValueError(f"checkpoint {path} not found (ckpt_path={str(ckpt_path)!r})")
    return path


def run_config(ckpt_path: str | os.PathLike) -> dict:
    """The ``config.yaml`` of the run a checkpoint belongs to (``RUN/checkpoints/x.ckpt`` -> ``RUN/config.yaml``),
    or ``{}`` when there is none (a checkpoint copied elsewhere)."""
    ckpt_path = Path(ckpt_path)
    for folder in (ckpt_path.parent.parent, ckpt_path.parent):
        if (folder / "config.yaml").is_file():
            return yaml.safe_load((folder / "config.yaml").read_text()) or {}
    return {}


def review_datamodule(
    model: ViTClassifier,
    manifest: str | os.PathLike,
    *,
    split: str | None = "test",
    batch_size: int = 16,
    config: dict | None = None,
    input_windows=None,
) -> CTSliceDataModule:
    """The slices of ``split`` of ``manifest``, prepared as the model was trained: input size, windows and read
    options from the model's input contract (its checkpoint's, completed from the run's ``config`` for one that
    predates recorded inputs), the patient split from the run's ``config``; no augmentation.

    Args:
        model: The model under review.
        manifest: Manifest CSV (see the README).
        split: ``train``, ``val``, ``test``, or None for every row.
        batch_size: Slices per forward pass.
        config: The run's CLI config (:func:`run_config`); ``{}``: defaults.
        input_windows: The model's input windows, for a checkpoint that predates recorded inputs (None: the run
            config's, else ``brain`` for a one-channel model); a checkpoint that records its windows keeps them.
    """
    data = ((config or {}).get("data") or {}).get("init_args") or {}
    contract = model.input_contract
    if input_windows is not None and contract.windows is not None:
        given = tuple(parse_windows(input_windows))
        if given != contract.windows:
            warnings.warn(
                f"input_windows={input_windows!r} left aside: the model was trained with {contract.describe()}, which"
                " its slices get",
                stacklevel=2,
            )
    contract = contract.completed(windows=input_windows or data.get("windows"), read_options=data)
    return CTSliceDataModule.from_contract(
        contract,
        manifest=str(project_path(manifest)),
        batch_size=batch_size,
        num_workers=0,
        augment=False,
        cache=False,
        split_fractions=tuple(data.get("split_fractions", SPLIT_FRACTIONS)),
        split_seed=data.get("split_seed", 0),
        predict_split=split,
    )


REVIEW_READING = DEFAULT_READING["review"]  # as vit-ct predict reads the maps


def review_reading(map_shifts: int | None = None, map_pixels: bool = False) -> MapReading:
    """How the review reads the maps: over ``map_shifts`` shifted grids per axis (``--map_shifts`` of predict and test;
    None: their default, 1: one pass) and, with ``map_pixels`` (``--map_pixels``), down to the pixel."""
    default = REVIEW_READING
    return MapReading(shifts=default.shifts if map_shifts is None else map_shifts, pixels=bool(map_pixels))


def load_review(
    ckpt_path: str | None,
    manifest: str | os.PathLike,
    *,
    split: str | None = "test",
    batch_size: int = 16,
    input_windows=None,
) -> tuple[ViTClassifier, CTSliceDataModule]:
    """The model of ``ckpt_path`` (None: the latest run's best) in eval mode, and its :func:`review_datamodule`; how
    its maps are read is the review's :func:`review_reading`, handed to each step that reads them."""
    path = resolve_checkpoint(ckpt_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = ViTClassifier.load_from_checkpoint(path, map_location=device).eval()
    config = run_config(path)
    datamodule = review_datamodule(
        model, manifest, split=split, batch_size=batch_size, config=config, input_windows=input_windows
    )
    return model, datamodule
