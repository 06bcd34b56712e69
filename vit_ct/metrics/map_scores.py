"""The metrics of the maps in one stage (validation or test), as torchmetrics states synced across DDP ranks: the
attention sink on every slice, and the rollout (arXiv:2005.00928) against the lesion beside its two floors, the
image itself and the head mask, and below the perfect patch map (the ceiling the patch grid sets; with a rollout read
on a finer grid, also the ceiling of that grid), on slices with a known, non-empty lesion mask."""

from __future__ import annotations

import warnings

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from vit_ct.explain.maps import Explained, localisation_maps
from vit_ct.metrics.localisation import (
    MAP_SOURCES,
    SURFACE_DISTANCE_SOURCES,
    LocalisationMetrics,
    pixel_units_note,
)
from vit_ct.metrics.sink import SinkMetrics


class MapMetrics(nn.Module):
    """Sink and localisation metrics of one stage.

    Args:
        depth: Blocks of the network (the sink is measured per block).
        tolerance_mm: Pointing-game tolerance, mm on each slice's own pixel spacing; pixels of the source slice for
            slices without one (said once, in a warning naming the stage).
        stage: The metrics' stage (``val``, ``test``), as the warning names it.
    """

    def __init__(self, depth: int, *, tolerance_mm: float, stage: str = "val") -> None:
        super().__init__()
        self.stage = stage
        self._said_pixels = False
        self.sink = SinkMetrics(depth)
        metrics = {
            s: LocalisationMetrics(tolerance_mm=tolerance_mm, surface_distance=s in SURFACE_DISTANCE_SOURCES)
            for s in MAP_SOURCES
        }
        self.localisation = nn.ModuleDict(metrics)

    def update(self, batch: dict, explained: Explained, *, num_prefix_tokens: int, patch_size: int) -> None:
        """The attention sink on every slice of ``batch``; rollout and its floors against the lesion on slices with a
        known, non-empty mask (each metric scores only the slices with a lesion inside the head)."""
        mask, head = batch["mask"][:, 0], batch["head"][:, 0]
        scored = batch["has_mask"] & mask.flatten(1).any(dim=1)
        side = batch["image"].shape[-2:]
        patches = (side[0] // patch_size, side[1] // patch_size)  # the rollout's grid may be finer (map_shifts)
        maps = localisation_maps(None, batch, rollout=explained.rollout, patch_grid=patches)
        self.sink.update(explained.rollout, maps["rollout"], explained.class_attention, head, mask, scored,
                         num_prefix_tokens=num_prefix_tokens, patch_size=patch_size)  # fmt: skip
        spacing = batch.get("pixel_spacing_mm")  # model grid, when the batch has it
        for source, source_maps in maps.items():
            self.localisation[source].update(
                source_maps, mask, head, known=batch["has_mask"], pixel_spacing_mm=spacing,
                source_shape=batch.get("source_shape"),
            )  # fmt: skip

    def compute_and_reset(self) -> dict[str, torch.Tensor]:
        """The epoch's values, keyed ``{source}_{score}`` (e.g. ``rollout_pointing``) and by sink measure
        (``rollout_air``, ``cls_prefix_block0``, ...); none of a kind when no slice was scored (data without masks).
        HD95 is ``hd95_mm`` over the slices with a pixel spacing, ``hd95_px`` (and ``pixel_slices``) over those
        without, each only where there are such slices."""
        values = {}
        for source, metrics in self.localisation.items():
            with warnings.catch_warnings():
                # every rank joins the sync, also one that scored nothing: its "compute before update" is noise
                warnings.filterwarnings("ignore", message="The ``compute`` method", category=UserWarning)
                scores = metrics.compute()  # the same on every rank
            metrics.reset()
            if scores["slices"] > 0:
                values.update({f"{source}_{name}": value.float() for name, value in _in_their_units(scores).items()})
                if scores["pixel_slices"] > 0 and not self._said_pixels:
                    counted = f"{self.stage}: {int(scores['pixel_slices'])} of {int(scores['slices'])} scored slices"
                    rank_zero_warn(pixel_units_note(metrics.tolerance_mm, counted))
                    self._said_pixels = True
        sink = self.sink.compute()
        self.sink.reset()
        if sink["slices"] > 0:
            counts = ("slices", "lesion_slices")
            values.update({name: v.float() for name, v in sink.items() if name not in counts and not v.isnan()})
        return values


def _in_their_units(scores: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A stage's localisation scores without the distances of a unit no slice was measured in: ``hd95_px`` only when
    some slices had no pixel spacing, ``hd95_mm`` only when some had one."""
    pixels, slices = scores["pixel_slices"], scores["slices"]
    dropped = set()
    if pixels == 0:
        dropped |= {"hd95_px", "hd95_px_slices", "pixel_slices"}
    if pixels == slices:
        dropped |= {"hd95_mm", "hd95_slices"}
    return {name: value for name, value in scores.items() if name not in dropped}
