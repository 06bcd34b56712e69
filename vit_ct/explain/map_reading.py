"""How a command reads a model's maps, as one value: over how many shifted grids (:mod:`vit_ct.explain.shifted`)
and whether down to the pixel (:mod:`vit_ct.explain.pixels`). Each command states its default once
(:data:`DEFAULT_READING`); the value is checked when it is made, and never stored on the model: the command hands it to
the steps that read maps (the trainer's ``ReadMaps`` callback, or directly to the inference of the review)."""

from __future__ import annotations

from dataclasses import dataclass

from vit_ct.explain.shifted import READ_SHIFTS


@dataclass(frozen=True)
class MapReading:
    """How the maps are read.

    Args:
        shifts: Read the rollout on a grid this many times finer than the patches, from ``shifts**2`` passes over the
            slice shifted by multiples of ``patch_size / shifts`` pixels (their mean probability: ``prob_tta``); 1: one
            pass. Must divide the patch size (:meth:`check`).
        pixels: Spread each cell of the rollout over its pixels by the gradient x input through the stem (one
            backward pass per pass).
    """

    shifts: int = 1
    pixels: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.shifts, bool) or not isinstance(self.shifts, int) or self.shifts < 1:
            raise ValueError(f"map_shifts must be a whole number >= 1, got {self.shifts!r}")
        if not isinstance(self.pixels, bool):
            raise ValueError(f"map_pixels must be true or false, got {self.pixels!r}")

    def check(self, patch_size: int) -> MapReading:
        """This reading, after checking it fits a model of ``patch_size`` pixel patches."""
        if patch_size % self.shifts:
            raise ValueError(f"map_shifts must be a whole number >= 1 dividing patch_size ({patch_size}), got"
                             f" {self.shifts}")  # fmt: skip
        return self

    @property
    def passes(self) -> int:
        """Forward passes per slice."""
        return self.shifts**2


ONE_PASS = MapReading()  # the rollout on the patch grid, from one forward pass

# A fit's validation reads one pass (a fit does not pay for finer maps); the commands that show maps to a person read
# them finer (READ_SHIFTS); the review reads as predict does.
DEFAULT_READING = {
    "fit": ONE_PASS,
    "validate": ONE_PASS,
    "test": MapReading(shifts=READ_SHIFTS),
    "predict": MapReading(shifts=READ_SHIFTS),
    "review": MapReading(shifts=READ_SHIFTS),
}
