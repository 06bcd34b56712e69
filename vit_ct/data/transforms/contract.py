"""How a model sees its input: the input contract a vit-ct checkpoint carries (input size, HU windows, read options,
and whether a slice is read with its neighbours), so that evaluating, predicting, reviewing and fine-tuning prepare
slices exactly as the weights were trained on."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vit_ct.data.transforms.windows import WINDOW_PRESETS, parse_windows

CHECKPOINT_KEY = "vit_ct_input"  # top-level key of a vit-ct checkpoint
READ_OPTIONS = ("modalities", "stored_values_are_hu")  # the load_ct_slice options that change what a model sees
# The input of a model and a data module built with no arguments (the demo's): 12 x 12 patches of 1.2 mm pixels, brain
# and subdural windows (blood beside bone is clearer in the subdural window).
DEFAULT_WINDOWS: tuple[str, ...] = ("brain", "subdural")
DEFAULT_IMG_SIZE = 192
# With context, a slice is read with one neighbour below and one above it: the centre slice's windows come first, so
# that channel 0 .. C-1 are always the slice itself (what overlays show), then the slice below's, then the one above's.
CONTEXT_SLICES = 3


@dataclass(frozen=True)
class InputContract:
    """What a model's weights expect: slices padded to a square with air and resized to ``img_size``, windowed by
    ``windows`` (one channel each), read with ``read_options``; with ``context_mm``, each slice beside the slices of
    its scan that lie ``context_mm`` below and above it, windowed the same way (three times the channels).

    Attributes:
        img_size: Side of the square model input in pixels.
        patch_size: Side of a patch in pixels (``img_size`` is a multiple of it).
        in_chans: Input channels: one per window, times 3 with context.
        windows: ``(centre, width)`` in HU of each window; None where unknown (checkpoints written before the
            contract).
        read_options: ``load_ct_slice`` options (``modalities``, ``stored_values_are_hu``); None where unknown.
        context_mm: Distance in mm of the neighbours read with each slice: below and above it, the slice of its scan
            nearest to that distance (:mod:`vit_ct.data.manifests.neighbours`); None: each slice alone.
    """

    img_size: int
    patch_size: int
    in_chans: int
    windows: tuple[tuple[float, float], ...] | None = None
    read_options: dict[str, Any] | None = None
    context_mm: float | None = None

    def __post_init__(self) -> None:
        if self.context_mm is not None and not self.context_mm > 0:
            raise ValueError(f"an input contract's context_mm is a distance > 0 in mm (or None), got {self.context_mm}")
        if self.windows is not None and len(self.windows) * self.slices != self.in_chans:
            raise ValueError(
                f"an input contract needs one channel per window and slice: {self.windows} for {self.in_chans}"
                f" channels, {self.slices} slice(s)"
            )

    @property
    def slices(self) -> int:
        """Slices read for one: 1, or 3 with context."""
        return slices_read(self.context_mm)

    @classmethod
    def of(
        cls, *, img_size: int, patch_size: int, windows, read_options: dict[str, Any], context_mm: float | None = None
    ) -> InputContract:
        """The contract of slices prepared with these data arguments (``windows`` as ``parse_windows`` takes them)."""
        pairs = tuple(parse_windows(windows))
        options = {name: read_options[name] for name in READ_OPTIONS}
        if options["modalities"] is not None:
            options["modalities"] = tuple(options["modalities"])
        return cls(img_size, patch_size, len(pairs) * slices_read(context_mm), pairs, options, context_mm)

    def to_dict(self) -> dict[str, Any]:
        """Plain values, as a checkpoint stores them (loadable with ``torch.load(weights_only=True)``); a contract
        without context stores no ``context_mm``, as before context existed."""
        values = asdict(self)
        if self.context_mm is None:
            del values["context_mm"]
        values["windows"] = None if self.windows is None else [list(w) for w in self.windows]
        if self.read_options is not None and self.read_options.get("modalities") is not None:
            values["read_options"] = {**self.read_options, "modalities": list(self.read_options["modalities"])}
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> InputContract:
        windows = values.get("windows")
        options = values.get("read_options")
        if options is not None and options.get("modalities") is not None:
            options = {**options, "modalities": tuple(options["modalities"])}
        return cls(
            img_size=int(values["img_size"]),
            patch_size=int(values["patch_size"]),
            in_chans=int(values["in_chans"]),
            windows=None if windows is None else tuple((float(c), float(w)) for c, w in windows),
            read_options=options,
            context_mm=None if values.get("context_mm") is None else float(values["context_mm"]),
        )

    @classmethod
    def from_checkpoint(cls, checkpoint: dict[str, Any]) -> InputContract:
        """The contract a checkpoint records; for one written before contracts existed, what its hyper-parameters
        tell (input size, channels, patch size; windows and read options unknown)."""
        if isinstance(checkpoint.get(CHECKPOINT_KEY), dict):
            return cls.from_dict(checkpoint[CHECKPOINT_KEY])
        hparams = checkpoint.get("hyper_parameters") or {}
        return cls(
            img_size=int(hparams.get("img_size", 128)),  # the default of every release before contracts
            patch_size=int(hparams.get("patch_size", 16)),
            in_chans=int(hparams.get("in_chans", 1)),
        )

    def completed(self, *, windows=None, read_options: dict[str, Any] | None = None) -> InputContract:
        """This contract with what it does not know filled in (a checkpoint written before inputs were recorded):
        ``windows`` (as ``parse_windows`` takes them; none given: ``brain`` for a one-channel model) and the read
        options found in ``read_options`` (a data module's arguments; the rest keep the data module's defaults).
        What the contract knows stays as it is.

        Raises:
            ValueError: the windows give another number of channels than the model takes.
        """
        known = self.windows
        if known is None:
            given = windows if windows is not None else ("brain" if self.in_chans == 1 else None)
            known = tuple(parse_windows(given)) if given is not None else ()
            if len(known) * self.slices != self.in_chans:
                raise ValueError(
                    f"the model takes {self.in_chans} input windows, got {given!r}; its checkpoint predates recorded"
                    " inputs: pass the windows it was trained with (e.g. ['brain', 'subdural'])"
                )
        options = self.read_options
        if options is None:  # those the data arguments give; the rest keep the data module's defaults
            options = {name: value for name, value in (read_options or {}).items() if name in READ_OPTIONS} or None
            if options is not None and options.get("modalities") is not None:
                options["modalities"] = tuple(options["modalities"])
        return InputContract(self.img_size, self.patch_size, self.in_chans, known, options, self.context_mm)

    def data_arguments(self) -> dict[str, Any]:
        """The data module arguments (``img_size``, ``windows``, read options, ``context_mm`` where it has context)
        that prepare slices this way; only those the contract knows."""
        arguments: dict[str, Any] = {"img_size": self.img_size}
        if self.context_mm is not None:
            arguments["context_mm"] = self.context_mm
        if self.windows is not None:
            arguments["windows"] = [list(w) for w in self.windows]
        if self.read_options is not None:
            arguments.update(self.read_options)
            if arguments.get("modalities") is not None:
                arguments["modalities"] = list(arguments["modalities"])
        return arguments

    def describe(self) -> str:
        """E.g. ``192 x 192 px, windows brain 40/80 + subdural 80/200, CT only``."""
        text = f"{self.img_size} x {self.img_size} px"
        if self.windows is not None:
            text += ", windows " + " + ".join(describe_window(w) for w in self.windows)
        if self.read_options is not None:
            modalities = self.read_options.get("modalities", ("CT",))
            text += ", " + ("any modality" if modalities is None else "/".join(modalities) + " only")
            if self.read_options.get("stored_values_are_hu"):
                text += ", stored values taken as HU"
        if self.context_mm is not None:
            text += ", " + reading(self.context_mm)
        return text


def reading(context_mm: float | None) -> str:
    """How slices are read: ``each slice alone`` or ``each slice with its neighbours 5 mm below and above``."""
    if context_mm is None:
        return "each slice alone"
    return f"each slice with its neighbours {context_mm:g} mm below and above"


def slices_read(context_mm: float | None) -> int:
    """Slices read for one slice: 1 alone, 3 with context (the slice, the one below, the one above)."""
    return 1 if context_mm is None else CONTEXT_SLICES


def describe_window(window: tuple[float, float]) -> str:
    """``brain 40/80`` for a preset, else ``40/80`` (centre / width in HU)."""
    centre, width = window
    name = next((n for n, preset in WINDOW_PRESETS.items() if tuple(map(float, preset)) == (centre, width)), None)
    text = f"{centre:g}/{width:g}"
    return f"{name} {text}" if name else text
