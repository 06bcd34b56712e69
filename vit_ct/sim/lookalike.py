"""Bright look-alikes a bleed detector must not fire on: calcified pineal gland, choroid plexus, falx and basal
ganglia (100-400 HU), and skull-base bone that fills only part of a thick slice. Drawn once per slice in mm, then
painted at any level of the slice."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vit_ct.sim.anatomy import Anatomy, Geometry, Tissue, wrap_angle


@dataclass(frozen=True)
class Lookalike:
    """One look-alike. Lengths in mm in the head's frame, angles in radians.

    Attributes:
        kind: "pineal", "choroid plexus", "falx", "basal ganglia" (round calcifications) or "skull base" (bone).
        centre: round ones: (x, y); "falx": (first, last) anterior position of the calcified segment; "skull base":
            (angle of the ridge around the head, its half width in radians).
        size: round ones: radius; "falx": half width across the midline; "skull base": how far the ridge reaches
            in from the inner table.
        hu: its value; for "skull base" the bone's share of the slab times bone (partial volume).
    """

    kind: str
    centre: tuple[float, float]
    size: float
    hu: float


def draw_lookalikes(
    rng: np.random.Generator, probability: float, fit: float, level: float, *, extended: bool = False
) -> list[Lookalike]:
    """Draw the slice's look-alikes, each present with `probability` where the anatomy has it.

    Args:
        rng: source of the draws (the demo's phantom draws them in this order).
        probability: chance of each kind.
        fit: the head's scale (`HeadFrame.fit`).
        level: slice height, 0 (ventricles) to 1 (vertex).
        extended: also basal ganglia calcification (level < 0.3) and skull-base bone (level < 0.15), drawn after
            the others.
    """
    p, v = probability, fit
    spots = []
    if level < 0.3 and rng.random() < p:
        spots.append(("pineal", (0, rng.uniform(-16, -12) * v), rng.uniform(1, 2.5)))
    if level < 0.3 and rng.random() < p:
        for side in (-1, 1):  # choroid plexus in the atria
            radius = rng.uniform(1, 3)
            spots.append(("choroid plexus", (side * rng.uniform(11, 14) * v, -20 * v), radius))
    if rng.random() < p:
        start = rng.choice([-1, 1]) * rng.uniform(10, 50) * v
        spots.append(("falx", (start, start + rng.uniform(5, 20)), rng.uniform(0.6, 1.5)))
    found = [Lookalike(kind, centre, size, rng.uniform(100, 400)) for kind, centre, size in spots]
    if not extended:
        return found
    if level < 0.3 and rng.random() < p / 2:  # globus pallidus, usually both sides
        sides = (-1, 1) if rng.random() < 0.7 else (rng.choice([-1, 1]),)
        for side in sides:
            centre = (side * rng.uniform(15, 19) * v, rng.uniform(-2, 6) * v)
            found.append(Lookalike("basal ganglia", centre, rng.uniform(1, 3), rng.uniform(100, 350)))
    if level < 0.15 and rng.random() < p:  # orbital roofs in front, petrous ridges behind and to the side
        for _ in range(int(rng.integers(1, 4))):
            side = rng.choice([-1, 1])
            if rng.random() < 0.4:
                angle = np.pi / 2 + side * rng.uniform(0.15, 0.5)  # orbital roof
            else:
                angle = -np.pi / 2 + side * rng.uniform(0.5, 1.1)  # petrous ridge
            share = rng.uniform(0.1, 0.45)  # of the slab filled by bone
            found.append(Lookalike("skull base", (angle, rng.uniform(0.08, 0.3)), rng.uniform(2, 8), share * 1300))
    return found


def paint_lookalikes(lookalikes: list[Lookalike], g: Geometry, anatomy: Anatomy) -> None:
    """Paint the look-alikes into `anatomy.tissue` and `anatomy.hu` in place at the level of geometry `g`."""
    masks = []
    for spot in lookalikes:
        if spot.kind == "falx":
            first, last = spot.centre
            segment = (g.y > first) & (g.y < last)
            masks.append(segment & anatomy.along & (anatomy.across < spot.size) & (g.depth_inner >= 0))
        elif spot.kind == "skull base":  # a ridge reaching in from the inner table, thickest in its middle
            angle, half_width = spot.centre
            u = wrap_angle(g.phi - angle) / half_width
            reach = spot.size * g.fit * np.clip(1 - u**2, 0, None)
            masks.append((np.abs(u) < 1) & (g.depth_inner >= -1) & (g.depth_inner < reach))
        else:
            masks.append(g.ellipse(spot.centre, (spot.size, spot.size)))
    for spot, mask in zip(lookalikes, masks, strict=True):
        anatomy.tissue[mask] = Tissue.PARTIAL_BONE if spot.kind == "skull base" else Tissue.CALCIFICATION
        anatomy.hu[mask] = spot.hu
