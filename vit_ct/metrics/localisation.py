"""Does the explanation point at the lesion? Pointing game, energy in the mask and pixel AUROC of attention-rollout
maps (arXiv:2005.00928) against lesion masks, and the map read as a segmentation (Dice, IoU, HD95:
:mod:`vit_ct.explain.segmentation`), as torchmetrics ``Metric``s, with two floors to beat and the ceiling the patch
grid sets. The maps themselves (the rollout upsampled, the floors, the ceiling) are made in
:func:`vit_ct.explain.maps.localisation_maps`.

Every score is computed per slice, over the head's pixels only (air is trivially unattended), on slices whose lesion
mask is known and non-empty, and averaged over those slices. Written here because torchmetrics' own AUROC pools the
pixels of all slices and knows neither a head mask nor a pointing game.

Distances (the pointing tolerance, HD95) are in mm on each slice's own pixel spacing. A slice without one (a ``.npy``
file, and no ``pixel_spacing_mm`` in its manifest) is measured in pixels of its source slice instead, never in a guessed
mm: its tolerance is the same number of those pixels and its HD95 is ``hd95_px``.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torchmetrics import Metric

from vit_ct.explain.segmentation import segmentation_scores
from vit_ct.explain.spacing import HEAD_FIELD_OF_VIEW_MM as HEAD_FIELD_OF_VIEW_MM  # imported from here before
from vit_ct.explain.spacing import model_grid_spacing_mm as model_grid_spacing_mm
from vit_ct.explain.spacing import pixel_units_note, slice_spacing

# perfect_grid: the ceiling on the rollout's own grid, where it is finer than the patches (--map_shifts > 1)
MAP_SOURCES = ("rollout", "floor_image", "floor_head", "perfect_patch", "perfect_grid")
SURFACE_DISTANCE_SOURCES = ("rollout", "perfect_patch", "perfect_grid")  # HD95 is the costliest score: map, ceilings
# per slice and map source; hd95_px: HD95 of a slice without a pixel spacing, in pixels of its source slice
SCORES = ("pointing", "energy", "mask_fraction", "pixel_auroc", "dice", "iou", "hd95_mm", "hd95_px")
_SAID: set[str] = set()  # notes already given by scores_per_slice


def _disk(radius: float, device: torch.device) -> torch.Tensor:
    """(1, 1, k, k) 0/1 kernel of the pixels whose centres lie within ``radius`` pixels of the centre."""
    half = int(radius)
    offsets = torch.arange(-half, half + 1, device=device, dtype=torch.float32)
    return ((offsets[:, None] ** 2 + offsets[None, :] ** 2) <= radius**2 + 1e-6).float()[None, None]


def dilate(mask: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """Pixels within ``radius`` (per slice, in pixels, centre to centre) of a mask pixel.

    Args:
        mask: ``(B, H, W)`` bool.
        radius: ``(B,)`` tolerance in pixels.

    Returns:
        ``(B, H, W)`` bool.
    """
    out = mask.clone()
    for r in radius.unique().tolist():  # in practice one spacing per batch: one convolution
        if r < 1:
            continue  # no neighbour is that close
        chosen = radius == r
        kernel = _disk(r, mask.device)
        hits = F.conv2d(mask[chosen, None].float(), kernel, padding=kernel.shape[-1] // 2)  # counts, exact in fp32
        out[chosen] = hits[:, 0] > 0.5
    return out


def pointing(maps: torch.Tensor, lesion: torch.Tensor, head: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """Pointing game per slice: is the map's maximum over the head within ``radius`` pixels of the lesion?

    Ties are honest: every head pixel equal to the maximum counts, and the score is the fraction of them that
    hit, so a constant map scores the share of the head near the lesion (chance), not 1 by luck.

    Args:
        maps: ``(B, H, W)`` float.
        lesion: ``(B, H, W)`` bool, within the head.
        head: ``(B, H, W)`` bool, not empty.
        radius: ``(B,)`` tolerance in pixels.

    Returns:
        ``(B,)`` float64 in [0, 1].
    """
    top = maps.masked_fill(~head, float("-inf")).amax(dim=(1, 2), keepdim=True)  # (B, 1, 1)
    tied = head & (maps == top)
    hit = tied & dilate(lesion, radius)
    return hit.sum(dim=(1, 2), dtype=torch.float64) / tied.sum(dim=(1, 2), dtype=torch.float64)


def energy_in_mask(maps: torch.Tensor, lesion: torch.Tensor, head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Share of the map's mass over the head that lies on the lesion, and its chance level, per slice.

    A map that is zero over the whole head says nothing: it is scored as uniform (energy = mask fraction).

    Args:
        maps: ``(B, H, W)`` non-negative.
        lesion: ``(B, H, W)`` bool, within the head.
        head: ``(B, H, W)`` bool, not empty.

    Returns:
        ``energy`` and ``mask_fraction`` (the lesion's share of the head's area), each ``(B,)`` float64.
    """
    mask_fraction = lesion.sum(dim=(1, 2), dtype=torch.float64) / head.sum(dim=(1, 2), dtype=torch.float64)
    total = (maps * head).sum(dim=(1, 2), dtype=torch.float64)
    on_lesion = (maps * lesion).sum(dim=(1, 2), dtype=torch.float64)
    energy = torch.where(total > 0, on_lesion / total.clamp_min(torch.finfo(torch.float64).tiny), mask_fraction)
    return energy, mask_fraction


def pixel_auroc(maps: torch.Tensor, lesion: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """AUROC of the map's values as a lesion-pixel detector over the head's pixels, per slice.

    The Mann-Whitney statistic from average ranks, so tied values count half (as ``sklearn.metrics.roc_auc_score``).

    Args:
        maps: ``(B, H, W)`` float.
        lesion: ``(B, H, W)`` bool, within the head; every slice has lesion and non-lesion head pixels.
        head: ``(B, H, W)`` bool.

    Returns:
        ``(B,)`` float64 in [0, 1].
    """
    B = maps.shape[0]
    inside = head.flatten(1)  # (B, N)
    # Pixels outside the head sort after every head pixel, so the first n_head positions rank the head alone.
    values, order = maps.flatten(1).masked_fill(~inside, float("inf")).sort(dim=1)
    positive = lesion.flatten(1).gather(1, order)
    N = values.shape[1]
    position = torch.arange(N, device=maps.device).expand(B, N)
    starts = torch.ones_like(positive)
    starts[:, 1:] = values[:, 1:] != values[:, :-1]
    ends = torch.ones_like(positive)
    ends[:, :-1] = starts[:, 1:]
    first = torch.where(starts, position, 0).cummax(dim=1).values  # first position of each tie group
    last = torch.where(ends, position, N - 1).flip(1).cummin(dim=1).values.flip(1)  # and its last
    rank = (first + last).double() / 2 + 1  # 1-based average rank
    n_pos = positive.sum(dim=1, dtype=torch.float64)
    n_neg = inside.sum(dim=1, dtype=torch.float64) - n_pos
    rank_sum = (rank * positive).sum(dim=1)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def score_slices(
    maps: torch.Tensor,
    masks: torch.Tensor,
    head: torch.Tensor | None = None,
    *,
    known: torch.Tensor | None = None,
    tolerance_px: torch.Tensor,
    spacing_mm: torch.Tensor,
    in_mm: torch.Tensor | None = None,
    surface_distance: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-slice localisation scores of the slices whose mask is known and holds lesion and non-lesion head pixels:
    what :class:`LocalisationMetrics` averages and the review lists slice by slice.

    Args:
        maps: ``(B, H, W)`` maps (negative values are clipped to 0).
        masks: ``(B, H, W)`` lesion masks, 0/1.
        head: ``(B, H, W)`` head masks, 0/1; None: the whole slice.
        known: ``(B,)`` bool: the slice's mask is known; None: every mask is.
        tolerance_px: ``(B,)`` pointing-game tolerance in pixels.
        spacing_mm: ``(B,)`` pixel size (the Hausdorff distance's unit): mm, or source pixels where ``in_mm`` is False.
        in_mm: ``(B,)`` bool: ``spacing_mm`` is in mm (:func:`slice_spacing`); None: everywhere.
        surface_distance: Also ``hd95_mm`` and ``hd95_px`` (see
            :func:`~vit_ct.explain.segmentation.segmentation_scores`), each NaN on the slices measured in the other.

    Returns:
        ``scored`` ``(B,)`` bool, and ``pointing``, ``energy``, ``mask_fraction``, ``pixel_auroc``, ``dice``,
        ``iou`` (and ``hd95_mm``, ``hd95_px``), each ``(scored.sum(),)`` for the scored slices in order.
    """
    head = torch.ones_like(masks, dtype=torch.bool) if head is None else head > 0.5
    lesion = (masks > 0.5) & head
    scored = lesion.any(dim=(1, 2)) & (head & ~lesion).any(dim=(1, 2))
    if known is not None:
        scored &= known.to(scored.device, torch.bool)
    if not scored.any():
        return scored, {}
    maps, lesion, head = maps[scored].float().clamp_min(0), lesion[scored], head[scored]
    energy, mask_fraction = energy_in_mask(maps, lesion, head)
    scores = {
        "pointing": pointing(maps, lesion, head, tolerance_px[scored]),
        "energy": energy,
        "mask_fraction": mask_fraction,
        "pixel_auroc": pixel_auroc(maps, lesion, head),
        **segmentation_scores(maps, lesion, head, spacing_mm[scored], surface_distance=surface_distance),
    }
    if surface_distance:  # the distance of a slice without a pixel spacing is in its source pixels: another name
        in_pixels = torch.zeros_like(scored) if in_mm is None else ~in_mm.to(scored.device, torch.bool)
        hd95, in_pixels = scores["hd95_mm"], in_pixels[scored]
        scores["hd95_mm"] = hd95.masked_fill(in_pixels, math.nan)
        scores["hd95_px"] = hd95.masked_fill(~in_pixels, math.nan)
    return scored, scores


class LocalisationMetrics(Metric):
    """How well maps point at lesions: per slice over the head, averaged over the scored slices.

    ``compute`` returns ``pointing`` (:func:`pointing`, ties shared), ``energy`` and ``mask_fraction``
    (:func:`energy_in_mask`), ``energy_ratio`` (mean energy / mean mask fraction: 1 is chance), ``pixel_auroc``
    (:func:`pixel_auroc`, ties count half), ``dice`` and ``iou`` of the map's half-maximum region, with
    ``surface_distance`` ``hd95_mm`` (mean over the slices where the map points somewhere, ``hd95_slices`` of them;
    :mod:`vit_ct.explain.segmentation`) and ``hd95_px`` / ``hd95_px_slices`` (the same over slices without a pixel
    spacing, in pixels of their source slices), ``slices`` (how many were scored) and ``pixel_slices`` (how many of
    them had no pixel spacing: their pointing tolerance was ``tolerance_mm`` source pixels). Every state is a sum
    (``dist_reduce_fx="sum"``), so the result under DDP equals one process over all slices.

    Args:
        tolerance_mm: Pointing game tolerance: the map's maximum scores when its centre lies within this
            distance (mm, pixel centre to pixel centre) of a lesion pixel; pixels of the source slice for a slice
            without a pixel spacing.
        pixel_spacing_mm: mm per pixel of the maps' grid for slices ``update`` gives no spacing for, when the caller
            knows it; None: such slices are measured in pixels of their source slice (never a guessed mm).
        surface_distance: Also the 95th-percentile Hausdorff distance (the costliest score of a slice).
        **kwargs: Passed to ``torchmetrics.Metric``.
    """

    is_differentiable = False
    full_state_update = False
    MEANS = ("pointing", "energy", "mask_fraction", "pixel_auroc", "dice", "iou")  # over the scored slices
    STATES = (*MEANS, "slices", "pixel_slices", "hd95_mm", "hd95_slices", "hd95_px", "hd95_px_slices")

    def __init__(
        self,
        *,
        tolerance_mm: float = 5.0,
        pixel_spacing_mm: float | None = None,
        surface_distance: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if not tolerance_mm >= 0:
            raise ValueError(f"tolerance_mm must be >= 0 mm, got {tolerance_mm}")
        if pixel_spacing_mm is not None and not pixel_spacing_mm > 0:
            raise ValueError(f"pixel_spacing_mm must be > 0 mm (or None: unknown), got {pixel_spacing_mm}")
        self.tolerance_mm = tolerance_mm
        self.pixel_spacing_mm = pixel_spacing_mm
        self.surface_distance = surface_distance
        for name in self.STATES:
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(
        self,
        maps: torch.Tensor,
        masks: torch.Tensor,
        head: torch.Tensor | None = None,
        *,
        known: torch.Tensor | None = None,
        pixel_spacing_mm: float | torch.Tensor | None = None,
        source_shape: torch.Tensor | None = None,
    ) -> None:
        """Scores the slices whose mask is known and holds lesion and non-lesion head pixels; skips the rest.

        Args:
            maps: ``(B, H, W)`` non-negative maps (negative values are clipped to 0).
            masks: ``(B, H, W)`` lesion masks, 0/1, on the same grid.
            head: ``(B, H, W)`` head masks, 0/1: scoring ignores every other pixel; None: the whole slice.
            known: ``(B,)`` bool: the slice's mask is known (``CTBatch["has_mask"]``); None: every mask is.
            pixel_spacing_mm: mm per pixel of the maps' grid, one for all or ``(B,)``; None or NaN: the
                constructor's, else unknown.
            source_shape: ``(B, 2)`` rows, columns of the source slices (``CTBatch["source_shape"]``): the unit of
                slices of unknown spacing; None: pixels of the maps' grid.
        """
        if maps.dim() != 3 or masks.shape != maps.shape or (head is not None and head.shape != maps.shape):
            raise ValueError(
                f"maps, masks and head must share one (B, H, W) shape, got {tuple(maps.shape)}, "
                f"{tuple(masks.shape)} and {None if head is None else tuple(head.shape)}"
            )
        spacing, in_mm = slice_spacing(
            pixel_spacing_mm, source_shape, maps.shape[-1], len(maps), maps.device, default_mm=self.pixel_spacing_mm
        )
        scored, scores = score_slices(
            maps, masks, head, known=known, tolerance_px=self.tolerance_mm / spacing, spacing_mm=spacing,
            in_mm=in_mm, surface_distance=self.surface_distance,
        )  # fmt: skip
        if not scored.any():
            return
        for name in self.MEANS:
            setattr(self, name, getattr(self, name) + scores[name].sum())
        self.slices += scored.sum()
        self.pixel_slices += (~in_mm[scored]).sum()
        if self.surface_distance:
            for unit in ("mm", "px"):
                distances = scores[f"hd95_{unit}"]
                measured = ~distances.isnan()
                setattr(self, f"hd95_{unit}", getattr(self, f"hd95_{unit}") + distances[measured].sum())
                name = "hd95_slices" if unit == "mm" else "hd95_px_slices"
                setattr(self, name, getattr(self, name) + measured.sum())

    def compute(self) -> dict[str, torch.Tensor]:
        """Means over the scored slices (NaN before any), ``energy_ratio`` = mean energy / mean mask fraction;
        ``hd95_mm`` and ``hd95_px`` over the slices where each exists (only with ``surface_distance``)."""

        def mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
            return total / count if count > 0 else total.new_tensor(float("nan"))

        means = {name: mean(getattr(self, name), self.slices) for name in self.MEANS}
        means["energy_ratio"] = means["energy"] / means["mask_fraction"]
        if self.surface_distance:
            means.update(hd95_mm=mean(self.hd95_mm, self.hd95_slices), hd95_slices=self.hd95_slices)
            means.update(hd95_px=mean(self.hd95_px, self.hd95_px_slices), hd95_px_slices=self.hd95_px_slices)
        return {**means, "slices": self.slices, "pixel_slices": self.pixel_slices}


def scores_per_slice(
    maps: dict[str, torch.Tensor],
    batch: dict,
    *,
    tolerance_mm: float,
    sources: tuple[str, ...] = MAP_SOURCES,
    surface_distance: tuple[str, ...] = SURFACE_DISTANCE_SOURCES,
) -> dict[str, torch.Tensor]:
    """Every slice's localisation scores ``{source}_{score}`` (:data:`SCORES`), ``(B,)`` float64 each, scored exactly
    as :class:`LocalisationMetrics` scores them (HD95 only for ``surface_distance``, as ``hd95_mm``, or
    as ``hd95_px`` on slices without a pixel spacing, with a warning saying so once); NaN on the slices it skips (no
    known, non-empty lesion mask): what ``vit-ct predict`` writes and the review lists. A source ``maps`` lacks
    (``perfect_grid`` of a rollout on the patch grid) gets no columns.

    Args:
        maps: ``{source: (B, S, S)}``, as :func:`vit_ct.explain.maps.localisation_maps` returns them.
        batch: the :class:`vit_ct.CTBatch` (``mask``, ``head``, ``has_mask``, optional ``pixel_spacing_mm`` and
            ``source_shape``).
        tolerance_mm: Pointing-game tolerance (in source pixels on slices without a pixel spacing).
        sources: The map sources to score.
        surface_distance: The sources HD95 is computed for (the costliest score); the report adds the image floor.
    """
    mask, head = batch["mask"][:, 0], batch["head"][:, 0]
    n, device = len(mask), mask.device
    spacing, in_mm = slice_spacing(batch.get("pixel_spacing_mm"), batch.get("source_shape"), mask.shape[-1], n, device)
    out = {}
    sources = tuple(source for source in sources if source in maps)
    for source in sources:
        scored, scores = score_slices(
            maps[source], mask, head, known=batch["has_mask"], tolerance_px=tolerance_mm / spacing,
            spacing_mm=spacing, in_mm=in_mm, surface_distance=source in surface_distance,
        )  # fmt: skip
        for name in SCORES:
            column = torch.full((n,), float("nan"), dtype=torch.float64, device=device)
            if name in scores:
                column[scored] = scores[name].double()
            out[f"{source}_{name}"] = column
    note = pixel_units_note(tolerance_mm)
    if note not in _SAID and (~in_mm & ~out[f"{sources[0]}_pointing"].isnan()).any():  # scored in pixels
        _SAID.add(note)  # once per process: Python's own once-per-line is reset by any code that changes a filter
        warnings.warn(note, UserWarning, stacklevel=2)
    return out
