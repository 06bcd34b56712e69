"""The model-randomisation sanity check of a map method (Adebayo et al. 2018, "Sanity checks for saliency maps",
arXiv:1810.03292): a map that explains the model must change when the model's weights are replaced by random ones.

The network's parts are re-initialised top down, cascading (:mod:`vit_ct.explain.cascade`), and at each step the maps
of the same slices are compared with the trained model's: Spearman's rank correlation per slice (ties ranked by their
mean, as the paper's rank correlation), and whether the map's maximum moved to another patch. The paper's second
check, data randomisation, retrains the model on shuffled labels; it is not run here (a training run per check).

Verdict. The paper states no number: it judges a method by whether the similarity of its maps to the trained model's
falls towards that of unrelated maps as the layers are randomised (gradients, Grad-CAM) or stays high (Guided
Backprop, Guided Grad-CAM: input detectors). vit-ct states two: the method PASSES when, with every weight randomised,
the mean rank correlation is below ``MAX_SPEARMAN`` = 0.5 (the midpoint between an unrelated map, 0, and the same
map, 1) and the maximum of at least ``MIN_MOVED`` = 0.5 of the slices moves to another patch (a map unrelated to the
trained one keeps its maximum in the same patch by chance only: a head covers some 70 to 120 patches of a 16 x 16
grid; half leaves room for maxima that the slice itself pins, e.g. bone). A map that does not read the weights (the
image itself, a head mask) keeps correlation 1 and every maximum: it FAILS.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import nn
from torchmetrics.functional import spearman_corrcoef

from vit_ct.explain.attention import patch_grid
from vit_ct.explain.cascade import cascade
from vit_ct.explain.map_reading import MapReading

MAX_SPEARMAN = 0.5  # mean rank correlation of the fully randomised model's maps with the trained model's, at most
MIN_MOVED = 0.5  # share of slices whose map maximum moves to another patch, at least

MapFunction = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (network, (B, C, S, S) images) -> (B, h, w) maps


def rollout_map(network: nn.Module, images: torch.Tensor, reading: MapReading | None = None) -> torch.Tensor:
    """The attention rollout of an :class:`~vit_ct.explain.maps.Explainer` (a :class:`vit_ct.ViTClassifier`) with its
    own rollout settings, from one pass or read as ``reading`` says (bind it with ``functools.partial``):
    ``(B, grid_h, grid_w)``. For a bare timm ViT pass :func:`vit_ct.explain.maps.explain_rollout` instead."""
    return (network.explain(images) if reading is None else network.explain(images, reading=reading))[1]


def image_map(network: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The image floor: the slice's first window as its own map, ``(B, S, S)``. It reads no weight, so the check must
    FAIL it (the paper's contrast: an edge detector passes no model-randomisation check)."""
    return images[:, 0]


def rank_correlation(maps: torch.Tensor, reference: torch.Tensor, region: torch.Tensor | None = None) -> torch.Tensor:
    """Spearman's rank correlation of each map with its reference, over the ``region`` pixels of each.

    A map that is constant over its region has no ranking: two constant maps rank alike (1), a constant one against a
    varying one shares no order (0). torchmetrics ranks (ties share their mean rank, as scipy's ``spearmanr``).

    Args:
        maps: ``(B, h, w)``.
        reference: ``(B, h, w)``.
        region: ``(B, h, w)`` bool, the pixels ranked (e.g. the head); None: all.

    Returns:
        ``(B,)`` float64 in [-1, 1].
    """
    if maps.shape != reference.shape:
        raise ValueError(f"maps {tuple(maps.shape)} and reference {tuple(reference.shape)} differ in shape")
    out = torch.empty(maps.shape[0], dtype=torch.float64)
    for i in range(maps.shape[0]):
        inside = slice(None) if region is None else region[i]
        a, b = maps[i][inside].double().flatten().cpu(), reference[i][inside].double().flatten().cpu()
        flat_a, flat_b = bool((a == a[0]).all()), bool((b == b[0]).all())
        if flat_a or flat_b:
            out[i] = float(flat_a and flat_b)
        elif torch.equal(a, b):  # exactly 1, not 1 - eps
            out[i] = 1.0
        else:
            out[i] = spearman_corrcoef(a, b)
    return out


def maximum_patch(maps: torch.Tensor, grid: tuple[int, int], region: torch.Tensor | None = None) -> torch.Tensor:
    """The patch (row-major index on ``grid``) that holds each map's maximum inside ``region``; on a tie the first.

    Args:
        maps: ``(B, h, w)``, on the patch grid or finer (pixels).
        grid: ``(grid_h, grid_w)`` patches of the model.
        region: ``(B, h, w)`` bool; None: all.
    """
    B, h, w = maps.shape
    if region is not None:
        maps = maps.float().masked_fill(~region, float("-inf"))
    top = maps.reshape(B, -1).argmax(dim=1)
    rows, cols = top // w * grid[0] // h, top % w * grid[1] // w
    return (rows * grid[1] + cols).cpu()


def on_grid(region: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A ``(B, H, W)`` or ``(B, 1, H, W)`` region brought to ``(B, *shape)`` bool: a cell is in when any of its pixels
    is (so the patches of the head are those holding some head); a slice with an empty region keeps every cell."""
    region = region.reshape(region.shape[0], 1, *region.shape[-2:]).float()
    if tuple(region.shape[-2:]) != tuple(shape):
        region = F.adaptive_max_pool2d(region, shape) if region.shape[-1] >= shape[-1] else F.interpolate(region, shape)
    inside = region[:, 0] > 0
    return inside | ~inside.flatten(1).any(dim=1)[:, None, None]


@dataclass
class RandomisationStep:
    """The maps after one step of the cascade, against the trained model's."""

    name: str  # "trained", "head", "block 5", ..., "position embedding"
    spearman: torch.Tensor  # (B,) float64 rank correlation per slice
    moved: torch.Tensor  # (B,) bool, the maximum left its patch

    def summary(self) -> dict:
        """The step's numbers, JSON-able."""
        rho = self.spearman
        return {
            "step": self.name,
            "spearman_mean": float(rho.mean()),
            "spearman_median": float(rho.median()),
            "spearman_q10_q90": [float(q) for q in rho.quantile(torch.tensor([0.1, 0.9], dtype=rho.dtype))],
            "moved": float(self.moved.double().mean()),
            "spearman": [round(float(r), 4) for r in rho],
        }


@dataclass
class RandomisationCheck:
    """The model-randomisation check of one map method on a set of slices (:func:`model_randomisation`)."""

    steps: list[RandomisationStep]  # the trained model first, the fully randomised one last
    images: torch.Tensor  # (E, S, S) the example slices' first channel, for the figure
    maps: torch.Tensor  # (steps, E, h, w) the example slices' maps at each step
    max_spearman: float = MAX_SPEARMAN
    min_moved: float = MIN_MOVED
    method: str = "rollout"
    notes: list[str] = field(default_factory=list)

    def changed(self, step: RandomisationStep) -> bool:
        """The step's maps differ from the trained model's by both criteria."""
        return float(step.spearman.mean()) < self.max_spearman and float(step.moved.double().mean()) >= self.min_moved

    @property
    def passed(self) -> bool:
        """The maps of the fully randomised model differ from the trained model's."""
        return self.changed(self.steps[-1])

    @property
    def first_changed(self) -> str | None:
        """The first step (top down) from which on every step's maps differ from the trained model's; None: never."""
        first = None
        for step in reversed(self.steps[1:]):
            if not self.changed(step):
                break
            first = step.name
        return first

    def to_dict(self) -> dict:
        """The per-step numbers and the verdict, JSON-able."""
        return {
            "check": "model randomisation, cascading (Adebayo et al. 2018)",
            "method": self.method,
            "verdict": "PASS" if self.passed else "FAIL",
            "slices": int(self.steps[0].spearman.numel()),
            "criteria": {"spearman_mean_below": self.max_spearman, "moved_at_least": self.min_moved},
            "first_changed": self.first_changed,
            "steps": [step.summary() for step in self.steps],
            "data_randomisation": "not run: it retrains the model on shuffled labels",
            "notes": self.notes,
        }

    def figure(self) -> Figure:
        """The paper's figure: one row per example slice, the slice then its map at each step, each map scaled to its
        own maximum (matplotlib's Agg canvas, no display needed)."""
        E, columns = self.images.shape[0], len(self.steps) + 1
        fig = Figure(figsize=(1.2 * columns, 1.35 * E + 0.5), layout="constrained")
        axes = fig.subplots(E, columns, squeeze=False)
        for e in range(E):
            axes[e, 0].imshow(self.images[e].numpy(), cmap="gray", vmin=0, vmax=1)
            for k, step in enumerate(self.steps, start=1):
                heat = self.maps[k - 1, e].float()
                axes[e, k].imshow(heat.numpy(), cmap="turbo", vmin=0, vmax=max(float(heat.max()), 1e-12))
                if e == 0:
                    axes[e, k].set_title(f"{step.name}\nρ {float(step.spearman.mean()):.2f}", fontsize=7)
        axes[0, 0].set_title("slice", fontsize=7)
        for ax in axes.flat:
            ax.set_axis_off()
        verdict = "PASS" if self.passed else "FAIL"
        fig.suptitle(f"{self.method}: cascading randomisation, top down (ρ: mean rank correlation) - {verdict}",
                     fontsize=8)  # fmt: skip
        return fig


def _maps(network: nn.Module, images: torch.Tensor, map_fn: MapFunction, batch_size: int) -> torch.Tensor:
    return torch.cat([map_fn(network, part).detach().float().cpu() for part in images.split(batch_size)])


def model_randomisation(
    network: nn.Module,
    images: torch.Tensor,
    map_fn: MapFunction = rollout_map,
    *,
    region: torch.Tensor | None = None,
    seed: int = 0,
    batch_size: int = 16,
    examples: Sequence[int] = (0,),
    max_spearman: float = MAX_SPEARMAN,
    min_moved: float = MIN_MOVED,
    method: str = "rollout",
) -> RandomisationCheck:
    """Runs the cascading model-randomisation check of ``map_fn`` on ``images``. ``network`` is left as it is: a copy
    is re-initialised (:func:`vit_ct.explain.cascade.cascade`), seeded, so the numbers repeat.

    Args:
        network: a timm ViT or a module holding one (e.g. a trained :class:`vit_ct.ViTClassifier`).
        images: ``(B, C, S, S)`` model input (e.g. a batch's ``image``); moved to the network's device.
        map_fn: ``(network, images) -> (B, h, w)`` maps, on the patch grid or finer; run in the network's eval mode.
        region: ``(B, H, W)`` or ``(B, 1, H, W)`` where the maps are compared (e.g. the batch's ``head``: outside it
            vit-ct's ViT never attends, trained or not); None: everywhere.
        seed: seed of the re-initialisation.
        batch_size: slices per forward pass.
        examples: indices of the slices the figure shows.
        max_spearman: the mean rank correlation the fully randomised model's maps must stay below.
        min_moved: the share of slices whose map maximum must move to another patch.
        method: the map method's name, for the report.
    """
    device = next(network.parameters()).device
    images = images.to(device)
    grid = patch_grid(network, images.shape)
    examples = list(examples)
    if not examples or not all(-images.shape[0] <= e < images.shape[0] for e in examples):
        raise ValueError(f"examples must be indices of the {images.shape[0]} slices, got {examples}")
    steps, kept, trained, inside, top = [], [], None, None, None
    for name, randomised in cascade(network, seed=seed):
        maps = _maps(randomised, images, map_fn, batch_size)  # (B, h, w)
        if trained is None:
            trained = maps
            inside = None if region is None else on_grid(region, maps.shape[-2:]).cpu()
            top = maximum_patch(trained, grid, inside)
        rho = rank_correlation(maps, trained, inside)
        steps.append(RandomisationStep(name, rho, maximum_patch(maps, grid, inside) != top))
        kept.append(maps[examples])
    return RandomisationCheck(
        steps,
        images[examples, 0].float().cpu(),
        torch.stack(kept),
        max_spearman=max_spearman,
        min_moved=min_moved,
        method=method,
    )
