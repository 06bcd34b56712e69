"""The report's map sanity check (``--ckpt_path``): the model-randomisation check (Adebayo et al. 2018,
arXiv:1810.03292; :mod:`vit_ct.explain.sanity`) of the checkpoint's attention rollout on the reported split's first
slices, beside the image floor, a map that reads no weight and so must fail it."""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterable
from pathlib import Path

import torch

from vit_ct.explain.sanity import RandomisationCheck, image_map, rollout_map
from vit_ct.inspection.loading import resolve_checkpoint, review_datamodule, run_config
from vit_ct.inspection.map_check import check_map, sanity_slices
from vit_ct.metrics.schema import PREDICTIONS
from vit_ct.model.weights_input import unreadable_reason
from vit_ct.task import ViTClassifier

SANITY_SLICES = 16  # slices checked: the split's first in manifest order (9 cascade steps of a ViT-Ti each)
METHODS = {"attention rollout": rollout_map, "floor: image": image_map}  # the map checked, and its contrast
FIGURES = {"attention rollout": "sanity_rollout.png", "floor: image": "sanity_image.png"}


def load_checkpoint(ckpt_path: str | os.PathLike) -> tuple[ViTClassifier, Path]:
    """The model of ``ckpt_path`` in eval mode (on the GPU where there is one), rollout in one pass on the patch grid,
    and the checkpoint's resolved path.

    Raises:
        ValueError: the file is missing or is no vit-ct checkpoint, naming ``--ckpt_path``.
    """
    try:
        path = resolve_checkpoint(ckpt_path)
    except ValueError as err:
        raise ValueError(f"--ckpt_path: {err}") from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model = ViTClassifier.load_from_checkpoint(path, map_location=device).eval()  # one pass
    except ValueError as err:  # vit-ct's checkpoint reader names the file and what it found
        raise ValueError(f"--ckpt_path: {err}") from None
    except (pickle.UnpicklingError, RuntimeError, KeyError, EOFError, TypeError, AttributeError) as err:
        # torch's own text advises loading with weights_only=False, which would run the file's code: never passed on
        raise ValueError(f"--ckpt_path {path} is not a vit-ct checkpoint: {unreadable_reason(err)}") from None
    return model, path


def sanity_checks(
    model: ViTClassifier,
    ckpt_path: Path,
    manifest: str | os.PathLike,
    *,
    split: str,
    slices: int = SANITY_SLICES,
    seed: int = 0,
) -> dict[str, RandomisationCheck]:
    """The check of each of :data:`METHODS` on the first ``slices`` of ``split`` (``all``: every row) of ``manifest``,
    read as the model was trained (:func:`vit_ct.inspection.loading.review_datamodule`), compared inside the head."""
    datamodule = review_datamodule(model, manifest, split=None if split == "all" else split,
                                   config=run_config(ckpt_path))  # fmt: skip
    chosen = sanity_slices(model, datamodule, slices)
    return {
        method: check_map(model, chosen, map_fn, method=method, seed=seed, batch_size=slices)
        for method, map_fn in METHODS.items()
    }


def checked_map_note(columns: Iterable[str]) -> str:
    """Which map method was checked, against what the predictions' maps are (``columns``: ``predictions.csv``'s)."""
    columns = list(columns)
    note = "checked: the attention rollout in one pass on the patch grid, as vit-ct predict writes it by default"
    if PREDICTIONS.prob_tta in columns or any(c.startswith("perfect_grid_") for c in columns):
        note += ("; the predictions' maps were read over shifted grids (--map_shifts > 1): the mean of the same"
                 " model's rollouts of shifted inputs, not checked here")  # fmt: skip
    return note


def sanity_section(checks: dict[str, RandomisationCheck], settings: dict) -> dict:
    """``report.json``'s ``sanity``: ``settings`` (checkpoint, split, slices, seed, which map was checked) and per
    method the check's numbers (:meth:`~vit_ct.explain.sanity.RandomisationCheck.to_dict`: verdict, criteria, per step
    the mean, median, 10th and 90th percentile of the rank correlation over ``slices``, the share of maxima moved)."""
    return {**settings, "methods": {method: check.to_dict() for method, check in checks.items()}}


def sanity_figures(checks: dict[str, RandomisationCheck]) -> dict[str, bytes]:
    """The paper's figure of each method (the example slices' maps at each step of the cascade) as PNG, by file."""
    figures = {}
    for method, check in checks.items():
        buffer = io.BytesIO()
        check.figure().savefig(buffer, format="png", dpi=110)
        figures[FIGURES.get(method, f"sanity_{method.replace(' ', '_')}.png")] = buffer.getvalue()
    return figures
