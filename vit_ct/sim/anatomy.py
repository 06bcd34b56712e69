"""The normal head on an axial slice, in HU: scalp, skull, CSF, cortex and sulci, white matter, ventricles, deep grey
matter, the falx and fissures, drawn in numpy on the pixel grid from a `numpy.random.Generator`."""

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

import numpy as np

HEAD_HEIGHT_MM = 100.0  # axial extent covered by slice levels 0 to 1


class Tissue(IntEnum):
    """Tissue codes of `SimulatedSlice.tissue`."""

    AIR = 0
    SCALP = 1
    BONE = 2  # cortical tables
    DIPLOE = 3  # cancellous bone between the tables
    CSF = 4
    GREY = 5
    WHITE = 6
    FALX = 7
    CALCIFICATION = 8  # pineal, choroid plexus, falx: bright look-alikes
    OEDEMA = 9
    BLEED = 10
    PARTIAL_BONE = 11  # skull-base bone filling only part of a thick slice: 100-600 HU beside the inner table
    METAL = 12  # an implant (clip, coil, shunt valve)


@dataclass(frozen=True)
class HeadShape:
    """One synthetic patient's head, shared by all of their slices. Lengths in mm, densities in HU."""

    centre_mm: tuple[float, float]
    rotation: float  # radians
    half_width_mm: float  # left-right, skin to skin at the widest level
    half_length_mm: float  # front-back
    wobble: np.ndarray = field(repr=False)  # (4, 2) amplitude and phase of radial harmonics 2..5
    scalp_mm: float = 4.0
    skull_mm: float = 6.0
    skull_wobble: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((3, 2)))
    diploe_fraction: float = 0.4
    bone_hu: float = 1300.0
    diploe_hu: float = 500.0
    scalp_hu: float = 40.0
    csf_rim_mm: float = 1.5
    csf_hu: float = 8.0
    grey_hu: float = 40.0
    white_hu: float = 25.0
    falx_hu: float = 50.0
    cortex_mm: float = 3.0
    ventricle_scale: float = 1.0
    n_sulci: int = 24
    sulcus_phase: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((3, 2)))


def sample_head(rng: np.random.Generator) -> HeadShape:
    """Draw one patient's head shape, layer thicknesses and tissue densities."""
    return HeadShape(
        centre_mm=(rng.uniform(-4, 4), rng.uniform(-4, 4)),
        rotation=rng.uniform(-0.15, 0.15),
        half_width_mm=rng.uniform(66, 78),
        half_length_mm=rng.uniform(84, 98),
        wobble=np.stack([rng.uniform(0, 0.025, 4), rng.uniform(0, 2 * np.pi, 4)], 1),
        scalp_mm=rng.uniform(3, 6),
        skull_mm=rng.uniform(4.5, 8),
        skull_wobble=np.stack([rng.uniform(0, 0.25, 3), rng.uniform(0, 2 * np.pi, 3)], 1),
        diploe_fraction=rng.uniform(0.3, 0.5),
        bone_hu=rng.uniform(900, 1800),
        diploe_hu=rng.uniform(300, 700),
        scalp_hu=rng.uniform(25, 55),
        csf_rim_mm=rng.uniform(0.8, 2.5),
        csf_hu=rng.uniform(2, 13),
        grey_hu=rng.uniform(36, 44),
        white_hu=rng.uniform(21, 29),
        falx_hu=rng.uniform(40, 60),
        cortex_mm=rng.uniform(2.5, 3.5),
        ventricle_scale=rng.uniform(0.7, 1.4),
        n_sulci=int(rng.integers(18, 30)),
        sulcus_phase=np.stack([rng.uniform(0, 1.2, 3), rng.uniform(0, 2 * np.pi, 3)], 1),
    )


def harmonics(z: np.ndarray, coefficients: np.ndarray, first: int) -> np.ndarray:
    """Sum of a_k cos((first + k) phi + p_k) over rows (a_k, p_k) of `coefficients`, given z = exp(i phi).

    Powers of z replace cos() calls, which are slower on a full grid.
    """
    weights = coefficients[:, 0] * np.exp(1j * coefficients[:, 1])
    power = z**first
    total = np.zeros(z.shape, np.complex64)
    for weight in weights:
        total += np.complex64(weight) * power
        power = power * z
    return total.real


def wrap_angle(angle: np.ndarray) -> np.ndarray:
    """Angle in [-pi, pi]; rounding is faster than a float modulo."""
    return angle - np.float32(2 * np.pi) * np.round(angle * np.float32(0.5 / np.pi))


def ellipse(x, y, centre, axes, angle=0.0) -> np.ndarray:
    """Bool mask of an ellipse; lengths in mm, angle in radians."""
    dx, dy = x - centre[0], y - centre[1]
    u = dx * math.cos(angle) + dy * math.sin(angle)
    v = -dx * math.sin(angle) + dy * math.cos(angle)
    return (u / axes[0]) ** 2 + (v / axes[1]) ** 2 <= 1


class HeadFrame:
    """The level-independent part of one head's geometry on the pixel grid (computed once per patient).

    Coordinates are in the head's frame (x right, y anterior), in mm; `y_scanner` is mm up the image (anterior for a
    supine patient, so gravity pulls towards low `y_scanner`).
    """

    def __init__(self, size: int, pixel_spacing_mm: float, head: HeadShape, fit: float):
        offsets = (np.arange(size) - (size - 1) / 2) * pixel_spacing_mm
        xs, ys = offsets[None, :] - head.centre_mm[0], -offsets[:, None] - head.centre_mm[1]
        cos, sin = math.cos(head.rotation), math.sin(head.rotation)
        self.x = (cos * xs + sin * ys).astype(np.float32)  # (H, W)
        self.y = (-sin * xs + cos * ys).astype(np.float32)
        self.y_scanner = np.broadcast_to(-offsets[:, None], (size, size)).astype(np.float32)
        self.r = np.hypot(self.x, self.y)
        self.phi = np.arctan2(self.y, self.x)
        self.z = (self.x + 1j * self.y).astype(np.complex64) / np.maximum(self.r, 1e-6)  # exp(i phi)
        self.outline = 1 + harmonics(self.z, head.wobble, 2)  # skin radius relative to the ellipse's
        self.skull = head.skull_mm * fit * (1 + 0.6 * harmonics(self.z, head.skull_wobble, 1))
        self.rim = head.csf_rim_mm * (1 + 0.3 * (self.z**3 * np.complex64(np.exp(1j * head.rotation))).real)
        self.sulcal_angle = self.phi + 0.08 * harmonics(self.z, head.sulcus_phase, 2)  # radians, winding sulci
        self.fit = fit
        self._placement = (size, pixel_spacing_mm, head.centre_mm, cos, sin)

    def window(self, centre: tuple[float, float], radius_mm: float) -> tuple[slice, slice]:
        """Rows and columns of the grid within `radius_mm` (and a pixel) of `centre` in the head's frame."""
        size, spacing, (cx, cy), cos, sin = self._placement
        x, y = centre
        column = (cos * x - sin * y + cx) / spacing + (size - 1) / 2
        row = (size - 1) / 2 - (sin * x + cos * y + cy) / spacing
        reach = radius_mm / spacing + 2
        rows = slice(max(0, math.floor(row - reach)), max(0, math.ceil(row + reach) + 1))
        return rows, slice(max(0, math.floor(column - reach)), max(0, math.ceil(column + reach) + 1))

    @classmethod
    def shrunk_to_fit(cls, size: int, pixel_spacing_mm: float, head: HeadShape) -> "HeadFrame":
        """The frame of a head shrunk to fit a field of view under 230 mm (the demo phantom's rule)."""
        return cls(size, pixel_spacing_mm, head, min(1.0, (size * pixel_spacing_mm / 2 - 4) / 110))


class Geometry:
    """Per-slice coordinates (those of `HeadFrame`) and depths below the layers at one level, in mm."""

    def __init__(self, frame: HeadFrame, head: HeadShape, level: float):
        self.x, self.y, self.y_scanner, self.r, self.phi, self.z = (
            frame.x, frame.y, frame.y_scanner, frame.r, frame.phi, frame.z
        )  # fmt: skip
        self.skull, self.fit, self.frame = frame.skull, frame.fit, frame
        scale = frame.fit * math.sqrt(1 - (0.7 * level) ** 2)  # narrower cross-sections towards the vertex
        a, b = head.half_width_mm * scale, head.half_length_mm * scale
        cos_phi, sin_phi = self.z.real, self.z.imag
        outer = a * b / np.sqrt((b * cos_phi) ** 2 + (a * sin_phi) ** 2) * frame.outline
        self.depth = outer - self.r  # mm below the skin, radial approximation of the normal distance
        self.depth_inner = self.depth - head.scalp_mm * frame.fit - self.skull  # mm below the inner table
        self.depth_brain = self.depth_inner - frame.rim

    def ellipse(self, centre, axes, angle=0.0, *, x: np.ndarray | None = None, reach_mm: float = 0.0) -> np.ndarray:
        """`ellipse` on this grid, computed only in the window that can hold it (a small one costs a fraction).

        Args:
            centre: (x, y) in the head's frame, mm.
            axes: half axes, mm.
            angle: rotation, radians.
            x: displaced x coordinates to use instead of the head's (mass effect) ...
            reach_mm: ... displaced by at most this many mm.
        """
        x = self.x if x is None else x
        rows, columns = self.frame.window(centre, max(axes) + reach_mm)
        mask = np.zeros(self.x.shape, bool)
        mask[rows, columns] = ellipse(x[rows, columns], self.y[rows, columns], centre, axes, angle)
        return mask


class Anatomy(NamedTuple):
    """A normal head at one level, painted on the pixel grid; lesions are painted into `tissue` and `hu` in place.

    Attributes:
        tissue: uint8 `(H, W)` `Tissue` codes.
        hu: float32 `(H, W)` HU.
        across: float `(H, W)`, mm from the midline (for the falx look-alike).
        along: bool `(H, W)`, where the interhemispheric fissure runs (not between the ventricles).
        sulci: bool `(H, W)`, the cortical sulci ...
        cisterns: bool `(H, W)`, ... and the fissures and cisterns: the subarachnoid spaces, where subarachnoid
            blood collects.
        ventricles: bool `(H, W)`, the ventricles (where intraventricular blood collects).
    """

    tissue: np.ndarray
    hu: np.ndarray
    across: np.ndarray
    along: np.ndarray
    sulci: np.ndarray
    cisterns: np.ndarray
    ventricles: np.ndarray


def draw_anatomy(
    rng: np.random.Generator,
    head: HeadShape,
    g: Geometry,
    level: float,
    *,
    fissures: bool = False,
    midline_shift: tuple[float, float] | None = None,
) -> Anatomy:
    """Paint the normal head; lengths in mm.

    Args:
        rng: draws the sulcal pattern and the midline (the same number of draws at every level).
        head: the patient's head.
        g: the slice's geometry.
        level: slice height, 0 (ventricles) to 1 (vertex).
        fissures: also the Sylvian fissures (level < 0.4) and the quadrigeminal cistern (level < 0.12).
        midline_shift: mass effect, (shift right in mm, anterior position in mm of its peak): the ventricles, deep
            grey matter and the falx move by up to the shift, and the ventricle on the far side is squeezed.
    """
    tissue = np.full(g.r.shape, Tissue.AIR, np.uint8)
    tissue[g.depth >= 0] = Tissue.SCALP
    scalp = g.depth - g.depth_inner - g.skull
    tissue[g.depth >= scalp] = Tissue.BONE
    below_outer_table = g.depth - scalp
    diploe = (below_outer_table >= 0.3 * g.skull) & (below_outer_table < (0.3 + head.diploe_fraction) * g.skull)
    tissue[diploe] = Tissue.DIPLOE
    tissue[g.depth_inner >= 0] = Tissue.CSF
    brain = g.depth_brain >= 0
    tissue[brain] = Tissue.WHITE
    db = g.depth_brain
    cortex = head.cortex_mm * g.fit
    tissue[brain & (db < cortex)] = Tissue.GREY

    # Sulci: lines where a winding phase crosses multiples of 2 pi, bending with depth and forking inward.
    k = head.n_sulci
    phase = k * g.frame.sulcal_angle + rng.uniform(0, 2 * np.pi)
    phase = phase + rng.uniform(-0.08, 0.08) * db
    index = np.round(phase / (2 * np.pi)).astype(np.int64) % k
    depths = (rng.uniform(6, 20, k) * g.fit)[index]  # mm, one per sulcus
    forks = depths * rng.uniform(0.35, 0.7, k)[index]
    spread = g.r / k  # mm per radian of phase
    half_width = 0.7  # mm
    distance = np.abs(wrap_angle(phase)) * spread
    for sign in (-1, 1):
        branch = np.abs(wrap_angle(phase + sign * 0.12 * np.clip(db - forks, 0, None))) * spread
        distance = np.where(db > forks, np.minimum(distance, branch), distance)
    inside = brain & (db < depths + cortex)
    tissue[inside & (distance < half_width + cortex) & (tissue == Tissue.WHITE)] = Tissue.GREY
    sulci = inside & (db < depths) & (distance < half_width)
    tissue[sulci] = Tissue.CSF

    # Deep structures; ventricles shrink to nothing by level 0.65 (centrum semiovale and above).
    v = head.ventricle_scale * g.fit
    size = max(0.0, 1 - level / 0.65)
    shift = np.float32(0) if midline_shift is None else _shift_profile(g.y, *midline_shift)
    x = g.x if midline_shift is None else g.x - shift  # deep structures move with the midline
    reach = 0.0 if midline_shift is None else abs(midline_shift[0])
    ventricles = np.zeros(g.r.shape, bool)
    gap_front, gap_back = 0.0, 0.0
    if level < 0.3:
        for side in (-1, 1):
            thalamus = g.ellipse((side * 9 * v, -6 * v), (7 * v, 9 * v), x=x, reach_mm=reach)
            caudate = g.ellipse((side * 11 * v, 12 * v), (4 * v, 7 * v), x=x, reach_mm=reach)
            tissue[thalamus & brain] = Tissue.GREY
            tissue[caudate & brain] = Tissue.GREY
    if size > 0:
        half_length, half_width_v = (8 + 18 * size) * v, (1.5 + 4 * size) * v
        tilt = 0.1 + 0.25 * size
        for side in (-1, 1):
            width = half_width_v * _squeeze(side, midline_shift)
            centre = (side * (half_width_v + 1.5 + 2 * size), 3 * v)
            ventricles |= g.ellipse(centre, (width, half_length), -side * tilt, x=x, reach_mm=reach)
        gap_front, gap_back = 3 * v + half_length + 4, half_length - 3 * v + 4
    if level < 0.3:
        for side in (-1, 1):  # occipital horns
            axes = (3 * v * _squeeze(side, midline_shift), 9 * v)
            ventricles |= g.ellipse((side * (11 + 3 * v), -20 * v), axes, side * 0.5, x=x, reach_mm=reach)
        ventricles |= (np.abs(x) < 1 + 0.8 * v) & (g.y > -12 * v) & (g.y < 4 * v)  # third ventricle
        gap_back = max(gap_back, 30 * v)
    tissue[ventricles] = Tissue.CSF

    # Interhemispheric fissure (CSF lined by cortex) with the falx, a thin dense line, in it.
    midline = rng.uniform(-0.004, 0.004) * g.y**2
    across = np.abs(g.x - midline) if midline_shift is None else np.abs(g.x - (midline + shift))
    along = (g.y > gap_front) | (g.y < -gap_back)
    fissure_width = rng.uniform(0.8, 1.6)
    tissue[brain & along & (across < fissure_width + cortex) & (tissue == Tissue.WHITE)] = Tissue.GREY
    fissure = (g.depth_inner >= 0) & along & (across < fissure_width)
    tissue[fissure] = Tissue.CSF
    tissue[(g.depth_inner >= 0) & along & (across < 0.5)] = Tissue.FALX
    cisterns = fissure & (tissue == Tissue.CSF)
    if fissures:
        cisterns |= _draw_fissures(rng, head, g, level, x, tissue, brain, cortex)

    hu_of = np.zeros(len(Tissue), np.float32)
    hu_of[[Tissue.AIR, Tissue.SCALP, Tissue.BONE, Tissue.DIPLOE, Tissue.CSF, Tissue.GREY, Tissue.WHITE]] = (
        -1000,
        head.scalp_hu,
        head.bone_hu,
        head.diploe_hu,
        head.csf_hu,
        head.grey_hu,
        head.white_hu,
    )
    hu_of[Tissue.FALX] = head.falx_hu
    return Anatomy(tissue, hu_of[tissue], across, along, sulci, cisterns, ventricles)


def _shift_profile(y: np.ndarray, shift_mm: float, centre_mm: float) -> np.ndarray:
    """Midline displacement, mm: largest at the mass, fading over ~5 cm front and back (the falx is fixed at the
    skull)."""
    return (shift_mm * np.exp(-(((y - centre_mm) / 50) ** 2))).astype(np.float32)


def _squeeze(side: int, midline_shift: tuple[float, float] | None) -> float:
    """Width factor of the ventricle on `side` (-1 left, +1 right): the one beside the mass, which pushes the midline
    the other way, narrows."""
    if midline_shift is None or side * midline_shift[0] >= 0:
        return 1.0
    return max(0.35, 1 - abs(midline_shift[0]) / 12)


def _draw_fissures(rng, head: HeadShape, g: Geometry, level, x, tissue, brain, cortex) -> np.ndarray:
    """Paint the Sylvian fissures (level < 0.4) and the quadrigeminal cistern (level < 0.12) as CSF lined by cortex;
    returns their mask. Draws the same numbers at every level."""
    v = head.ventricle_scale * g.fit
    front, insula = rng.uniform(2, 12, 2) * g.fit, rng.uniform(28, 38, 2) * g.fit
    widths, waves = rng.uniform(1.0, 2.5, 2), rng.uniform(0, 2 * np.pi, 2)
    cistern_width = rng.uniform(1.5, 3.0)
    spaces = np.zeros(g.r.shape, bool)
    clefts = []  # (distance from the cleft's centre line in mm, half width in mm, where it runs)
    if level < 0.4:
        for side, start, inner, width, wave in zip((-1, 1), front, insula, widths, waves, strict=True):
            lateral = side * x - inner  # mm lateral of the insula: the fissure runs inward and back to it
            centre = start + 0.25 * lateral + 2 * np.sin(lateral / 6 + wave)
            clefts.append((np.abs(g.y - centre), width * (1 - level / 0.4) / 2 + 0.3, brain & (lateral > 0)))
    if level < 0.12:  # an arc behind the third ventricle, around the tectum
        clefts.append((np.abs(np.hypot(x, g.y + 8 * v) - 12 * v), cistern_width / 2, brain & (g.y < -8 * v - 4)))
    for distance, half_width, where in clefts:
        tissue[where & (distance < half_width + cortex / 2) & (tissue == Tissue.WHITE)] = Tissue.GREY
        spaces |= where & (distance < half_width)
    tissue[spaces] = Tissue.CSF
    return spaces
