"""The small-data benchmark's held-out scanner families beside what the pretraining draws, read from the code: for each
setting, the range ``python -m vit_ct.sim.pretraining`` draws (``CohortConfig``'s defaults, the set behind
``configs/pretrain.yaml``) and each family's value (``HELDOUT``, ``HELDOUT_FAR`` in ``benchmarks/small_data.py``), with
whether the value lies inside that range, outside it, or partly. ``make docs`` prints the table into the README and
``tests/benchmarks/test_small_data.py`` checks every verdict against the pretraining's real draws.

    python -m benchmarks.family_ranges
"""

from __future__ import annotations

import inspect
import math
from typing import NamedTuple

from benchmarks.small_data import HELDOUT_FAMILIES
from vit_ct.sim.bleed import draw_bleed
from vit_ct.sim.cohort import CohortConfig
from vit_ct.sim.projector import FILTER_NAMES, Kernel
from vit_ct.sim.protocol import REFERENCE_SPACING_MM, REFERENCE_THICKNESS_MM

INSIDE, OUTSIDE, PARTLY = "inside", "outside", "partly outside"


class Setting(NamedTuple):
    """One row: what the pretraining draws, and per family its value and verdict."""

    name: str
    pretraining: str
    families: dict[str, tuple[str, str]]  # family -> (value, verdict)


def photons_range(config: CohortConfig) -> tuple[float, float]:
    """The photons per detector bin and view the pretraining's acquisitions get: the dose range at the reference pixel
    size and thickness, scaled by the pixel size and the square root of the thickness (``sample_protocol``) and by
    the per-slice tube-current modulation (``simulate_cohort_patient``), at the ends of each range."""
    scanner = config.scanner
    low_spacing, high_spacing = scanner.pixel_spacing_mm_range
    thin, thick = min(scanner.slice_thicknesses_mm), max(scanner.slice_thicknesses_mm)
    low = scanner.photons_per_ray_range[0] * low_spacing / REFERENCE_SPACING_MM
    high = scanner.photons_per_ray_range[1] * high_spacing / REFERENCE_SPACING_MM
    low *= math.sqrt(thin / REFERENCE_THICKNESS_MM) / scanner.dose_modulation
    high *= math.sqrt(thick / REFERENCE_THICKNESS_MM) * scanner.dose_modulation
    return low, high


def interval_verdict(value: tuple[float, float], drawn: tuple[float, float]) -> str:
    """Whether the interval ``value`` lies inside ``drawn``, outside it, or overlaps it."""
    if drawn[0] <= value[0] and value[1] <= drawn[1]:
        return INSIDE
    return OUTSIDE if value[1] < drawn[0] or value[0] > drawn[1] else PARTLY


def kernel_verdict(kernels: tuple[str | Kernel, ...], config: CohortConfig) -> str:
    """A named window is drawn by the pretraining for some patients; a continuous kernel lies inside when both its
    sharpness and its edge enhancement lie inside the ranges drawn."""
    scanner = config.scanner

    def drawn(kernel: str | Kernel) -> bool:
        if isinstance(kernel, str):
            return scanner.window_kernel_fraction > 0 and kernel in FILTER_NAMES
        return (scanner.half_response_range[0] <= kernel.half_response <= scanner.half_response_range[1]
                and scanner.edge_boost_range[0] <= kernel.edge_boost <= scanner.edge_boost_range[1])  # fmt: skip

    inside = [drawn(kernel) for kernel in kernels]
    return INSIDE if all(inside) else OUTSIDE if not any(inside) else PARTLY


def kernel_text(kernel: str | Kernel) -> str:
    if isinstance(kernel, str):
        return kernel
    return f"half response {kernel.half_response:g}, edge boost {kernel.edge_boost:g}"


def _span(low: float, high: float, unit: str = "") -> str:
    """``0.7-1.0``: both ends with as many decimals as the finer one needs."""
    decimals = max(len(f"{v:g}".partition(".")[2]) for v in (low, high))
    text = f"{low:.{decimals}f}" if low == high else f"{low:.{decimals}f}-{high:.{decimals}f}"
    return text + unit


def _photons(value: float) -> str:
    return f"{value:.1e}".replace("e+0", "e")


def settings(config: CohortConfig = CohortConfig(), families: dict | None = None) -> list[Setting]:  # noqa: B008
    """Every compared setting, pretraining beside each held-out family (default: the benchmark's two)."""
    families = {name: phantom for name, (phantom, _seed) in (families or HELDOUT_FAMILIES).items()}
    scanner = config.scanner
    small_radius = inspect.signature(draw_bleed).parameters["small_radius_mm"].default  # the phantom's
    photons = photons_range(config)
    windows = round(100 * scanner.window_kernel_fraction)

    def per_family(value, verdict) -> dict[str, tuple[str, str]]:
        return {name: (value(phantom), verdict(phantom)) for name, phantom in families.items()}

    def one_value(value: float, drawn: tuple[float, float]) -> str:
        return interval_verdict((value, value), drawn)

    return [
        Setting(
            "reconstruction kernel",
            f"half response {_span(*scanner.half_response_range)} of Nyquist, edge boost "
            f"{_span(*scanner.edge_boost_range)}; for {windows}% of patients a named window "
            f"({', '.join(FILTER_NAMES)})",
            per_family(lambda p: "; ".join(map(kernel_text, p.kernels)), lambda p: kernel_verdict(p.kernels, config)),
        ),
        Setting(
            "pixel spacing",
            f"{_span(*scanner.pixel_spacing_mm_range)} mm, raised where a large head needs the field of view",
            per_family(
                lambda p: f"{p.pixel_spacing_mm:g} mm",
                lambda p: one_value(p.pixel_spacing_mm, scanner.pixel_spacing_mm_range),
            ),  # fmt: skip
        ),
        Setting(
            "dose: photons per detector bin and view",
            f"{_photons(photons[0])}-{_photons(photons[1])} (log-uniform "
            f"{_photons(scanner.photons_per_ray_range[0])}-{_photons(scanner.photons_per_ray_range[1])} at "
            f"{REFERENCE_SPACING_MM:g} mm pixels and {REFERENCE_THICKNESS_MM:g} mm slices, scaled by pixel size, "
            f"thickness and up to {scanner.dose_modulation:g}x tube-current modulation)",
            per_family(
                lambda p: "-".join(map(_photons, p.photons_per_ray_range)),
                lambda p: interval_verdict(p.photons_per_ray_range, photons),
            ),  # fmt: skip
        ),
        Setting(
            "slice thickness",
            f"{min(scanner.slice_thicknesses_mm):g}-{max(scanner.slice_thicknesses_mm):g} mm, levels "
            f"{config.sub_slice_mm:g} mm apart averaged (one level up to {config.sub_slice_mm:g} mm)",
            per_family(lambda p: "one level", lambda p: INSIDE),
        ),
        Setting(
            "bone beam hardening",
            _span(*scanner.beam_hardening_range),
            per_family(
                lambda p: f"{p.beam_hardening:g}", lambda p: one_value(p.beam_hardening, scanner.beam_hardening_range)
            ),  # fmt: skip
        ),
        Setting(
            "bleed contrast",
            f"{_span(*config.bleed_hu_range)} HU; {config.low_contrast_fraction:.0%} of bleeds in the lowest 10 HU",
            per_family(
                lambda p: f"{_span(*p.bleed_hu_range)} HU; {p.low_contrast_fraction:.0%} in the lowest 10 HU",
                lambda p: interval_verdict(p.bleed_hu_range, config.bleed_hu_range),
            ),  # fmt: skip
        ),
        Setting(
            "small bleeds",
            f"{config.small_fraction:.0%} of bleeds; intraparenchymal radius {_span(*config.small_radius_mm)} mm",
            per_family(
                lambda p: f"{p.small_fraction:.0%}; radius {_span(*small_radius)} mm",
                lambda p: interval_verdict(small_radius, config.small_radius_mm),
            ),  # fmt: skip
        ),
        Setting(
            "bleed kinds",
            ", ".join(config.bleed_types),
            per_family(
                lambda p: ", ".join(p.bleed_types),
                lambda p: INSIDE if set(p.bleed_types) <= set(config.bleed_types) else PARTLY,
            ),  # fmt: skip
        ),
    ]


def markdown(rows: list[Setting] | None = None) -> str:
    """The table as the README prints it."""
    rows = settings() if rows is None else rows
    names = list(rows[0].families)
    header = ["setting", "the pretraining draws", *(f"{name} family" for name in names)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [f"{value} (**{verdict}**)" if verdict != INSIDE else f"{value} ({verdict})"
                 for value, verdict in (row.families[name] for name in names)]  # fmt: skip
        lines.append("| " + " | ".join([row.name, row.pretraining, *cells]) + " |")
    return "\n".join(lines)


def outside(family: str, rows: list[Setting] | None = None) -> list[str]:
    """The settings of ``family`` not inside the pretraining's ranges."""
    rows = settings() if rows is None else rows
    return [row.name for row in rows if row.families[family][1] != INSIDE]


if __name__ == "__main__":
    print(markdown())
    for name in HELDOUT_FAMILIES:
        print(f"{name}: outside the pretraining's ranges: {', '.join(outside(name)) or 'nothing'}")
