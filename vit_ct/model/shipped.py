"""Pretrained head-CT weights that ship with vit-ct and load offline by name, like a timm tag
(``--model.pretrained vit-ct/headct-tiny-256``): half-precision safetensors beside a model card, a JSON in the spirit
of timm's ``pretrained_cfg`` and MONAI bundles' ``metadata.json`` (the input it expects, its architecture, version,
licence, data, recipe, figures, and what it is not).

``python -m vit_ct.model.shipped list`` names them; ``python -m vit_ct.model.shipped export CKPT --name NAME --card
CARD.json --record RECORD.json`` turns a vit-ct checkpoint into one (the card's own fields from CARD.json, the input
contract and the architecture from the checkpoint, its figures from the records of their measurement, e.g.
``benchmarks/shipped_card.py``'s); ``python -m vit_ct.model.shipped record NAME RECORD.json`` puts a record's figures
into the card of weights already exported. A record only enters the card of the very weights it measured.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vit_ct.files import atomic_write
from vit_ct.model.hparams import ARCHITECTURE

if TYPE_CHECKING:  # imported where used: `python -m vit_ct.model.shipped list` reads JSON cards, without torch
    from vit_ct.data.transforms.contract import InputContract

PREFIX = "vit-ct/"
FOLDER = Path(__file__).with_name("pretrained")


def is_shipped(tag: str | None) -> bool:
    """Whether ``tag`` names weights shipped with vit-ct (``vit-ct/<name>``) rather than a timm tag."""
    return bool(tag) and tag.startswith(PREFIX)


def shipped_names() -> list[str]:
    """The shipped weights, by the name ``--model.pretrained`` takes."""
    return sorted(PREFIX + card.stem for card in FOLDER.glob("*.json") if card.with_suffix(".safetensors").is_file())


def card(tag: str) -> dict[str, Any]:
    """The model card of shipped weights.

    Raises:
        ValueError: no such shipped weights (naming the ones there are).
    """
    path = FOLDER / f"{tag.removeprefix(PREFIX)}.json"
    if not is_shipped(tag) or not path.is_file() or not path.with_suffix(".safetensors").is_file():
        raise ValueError(f"--model.pretrained {tag}: no such weights ship with vit-ct; there are {shipped_names()}")
    return json.loads(path.read_text())


def weights_file(tag: str) -> Path:
    """The safetensors file of shipped weights (network keys; the patch head's as ``patch_head.*``, a sequence head's as
    ``sequence.*``)."""
    card(tag)
    return FOLDER / f"{tag.removeprefix(PREFIX)}.safetensors"


def input_contract(tag: str) -> InputContract:
    """How the shipped weights see their input (the card's ``input``)."""
    from vit_ct.data.transforms.contract import InputContract

    return InputContract.from_dict(card(tag)["input"])


def architecture(tag: str) -> dict[str, Any]:
    """The hyper-parameters of the network the shipped weights fill (the card's ``architecture``)."""
    return dict(card(tag)["architecture"])


def weights_sha256(path: str | Path) -> str:
    """The SHA-256 of a weights file: what ties a record of figures to the weights it measured."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def add_record(name: str, record_path: str | Path, folder: Path = FOLDER) -> Path:
    """Put the figures of a measurement's record (``benchmarks.recording``) into the card of shipped weights ``name``:
    ``card[<the record's card_section>] = {"figures": ..., "measured": how, when, where}``; returns the card.

    Raises:
        ValueError: the record is not one of these weights (no ``card_section``, another name, or another SHA-256 of
            the weights file: figures of other weights never enter this card).
    """
    record_path = Path(record_path)
    try:
        record = json.loads(record_path.read_text())
        notes, figures = record["notes"], record["figures"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"--record {record_path}: not a record of figures ({error})") from error
    card_path, weights = folder / f"{name}.json", folder / f"{name}.safetensors"
    if not card_path.is_file() or not weights.is_file():
        raise ValueError(f"{folder}: no shipped weights {name!r} (export them first)")
    section = notes.get("card_section")
    if not section or notes.get("weights") != PREFIX + name:
        raise ValueError(f"--record {record_path} measured {notes.get('weights')!r}, not {PREFIX + name}, or names no"
                         " card_section")  # fmt: skip
    if notes.get("weights_sha256") != weights_sha256(weights):
        raise ValueError(f"--record {record_path} measured other weights than {weights} (SHA-256 differs): measure"
                         " these weights again")  # fmt: skip
    document = json.loads(card_path.read_text())
    machine = record.get("machine", {})
    measured = {"record": record_path.name, "command": record.get("command"), "date": record.get("date"),
                "commit": record.get("commit"), "cpu": machine.get("cpu"), "native_bf16": machine.get("native_bf16"),
                "torch": machine.get("torch"), "precision": notes.get("precision")}  # fmt: skip
    kept = {key: value for key, value in document.get(section, {}).items() if key not in ("figures", "measured")}
    document[section] = {**kept, "figures": figures, "measured": measured}
    with atomic_write(card_path) as tmp:
        tmp.write_text(json.dumps(document, indent=2) + "\n")
    return card_path


def export(
    checkpoint_path: str | Path, name: str, fields: dict[str, Any], folder: Path = FOLDER, records: tuple = ()
) -> Path:
    """Write ``folder/<name>.safetensors`` (float16) and ``<name>.json`` from a vit-ct checkpoint; returns the card.

    Args:
        checkpoint_path: a checkpoint written by ``vit-ct fit``.
        name: the name after ``vit-ct/``.
        fields: the card's own fields (``version``, ``licence``, ``data``, ``recipe``, ``card_test``, ``not_for``...);
            never figures, which come from ``records``.
        folder: where to write.
        records: records of these weights' measurements (:func:`add_record`), e.g. ``benchmarks/shipped_card.py``'s
            after an earlier export of the same checkpoint (the export is deterministic: the same weights file).

    Raises:
        ValueError: not a vit-ct checkpoint, figures typed into ``fields``, or a record of other weights.
    """
    typed = sorted(k for k, v in fields.items() if k == "figures" or (isinstance(v, dict) and "figures" in v))
    if typed:
        raise ValueError(f"--card: figures typed into the card ({typed}); they come from records: --record RECORD")
    import torch
    from safetensors.torch import save_file

    from vit_ct.data.transforms.contract import InputContract

    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True)  # runs no code
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint or "hyper_parameters" not in checkpoint:
        raise ValueError(f"{checkpoint_path} is not a vit-ct checkpoint (no state_dict or hyper_parameters)")
    hparams = checkpoint["hyper_parameters"]
    state = {  # float16 weights; integer buffers (batch norm's counts) as they are
        key.removeprefix("vit."): (value.half() if value.is_floating_point() else value).contiguous()
        for key, value in checkpoint["state_dict"].items()
        if key.startswith(("vit.", "patch_head.", "sequence."))
    }
    document = {
        "name": PREFIX + name,
        **fields,
        "input": InputContract.from_checkpoint(checkpoint).to_dict(),
        "architecture": {key: hparams.get(key) for key in ARCHITECTURE},
    }
    with atomic_write(folder / f"{name}.safetensors") as tmp:
        save_file(state, str(tmp), metadata={"format": "pt", "name": PREFIX + name})
    with atomic_write(folder / f"{name}.json") as tmp:
        tmp.write_text(json.dumps(document, indent=2) + "\n")
    (folder / f"{name}.safetensors").chmod(0o644)  # package data: readable by every user of an installed copy
    for record in records:
        add_record(name, record, folder)
    return folder / f"{name}.json"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vit_ct.model.shipped", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the shipped weights")
    exporting = commands.add_parser("export", help="a checkpoint -> shipped weights and their card")
    exporting.add_argument("checkpoint")
    exporting.add_argument("--name", required=True, help="the name after vit-ct/")
    exporting.add_argument("--card", help="JSON file of the card's own fields (version, licence, data, recipe, ...)")
    exporting.add_argument("--folder", default=str(FOLDER), help="where to write (default: inside the package)")
    exporting.add_argument("--record", action="append", default=[], help="a record of these weights' figures")
    recording = commands.add_parser("record", help="a record's figures -> the card of exported weights")
    recording.add_argument("name", help="the name after vit-ct/")
    recording.add_argument("records", nargs="+", help="records of the weights' figures (benchmarks/records/*.json)")
    recording.add_argument("--folder", default=str(FOLDER), help="where the weights are (default: inside the package)")
    args = parser.parse_args(argv)
    if args.command == "list":
        for tag in shipped_names():
            print(tag, "-", card(tag).get("summary", ""))
        return
    try:
        if args.command == "record":
            for record in args.records:
                print(add_record(args.name, record, Path(args.folder)))
            return
        fields = json.loads(Path(args.card).read_text()) if args.card else {}
        print(export(args.checkpoint, args.name, fields, Path(args.folder), tuple(args.record)))
    except ValueError as error:  # one line naming the file or option, as vit-ct prints its errors
        raise SystemExit(f"{parser.prog} {args.command}: error: {error}") from None


if __name__ == "__main__":
    main()
