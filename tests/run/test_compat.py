"""The private names of Lightning, jsonargparse, W&B, timm and torch that vit-ct reaches exist in the installed
releases (`make floors` runs this at the lowest declared versions too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from vit_ct.cli import main
from vit_ct.run import compat

NAMEDTUPLE_API = ("_fields", "_asdict", "_replace", "_make")
DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")


def test_every_private_name_vit_ct_reaches_exists_in_the_installed_libraries():
    assert compat.missing_private_names() == []


def test_a_release_without_one_of_them_is_caught(monkeypatch):
    monkeypatch.delattr(ModelCheckpoint, "_monitor_candidates")
    assert compat.missing_private_names() == ["ModelCheckpoint._monitor_candidates"]


def test_every_private_access_of_the_package_goes_through_compat():
    """Outside compat.py, no `x._name` of another object (only `self._` / `super()._` of vit-ct's own classes, and the
    documented NamedTuple API)."""
    package = Path(compat.__file__).parent
    found = []
    for path in package.rglob("*.py"):
        if path.name == "compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            public = node.attr.startswith("__") or node.attr in NAMEDTUPLE_API if isinstance(node, ast.Attribute) else 1
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not public:
                owner = node.value
                own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
                own = own or (isinstance(owner, ast.Call) and getattr(owner.func, "id", "") == "super")
                if not own:
                    found.append(f"{path.relative_to(package)}:{node.lineno} .{node.attr}")
    assert found == []


def test_a_bad_value_is_summarised_in_one_line_from_jsonargparses_own_message(capsys):
    """The summary reads jsonargparse's real message (its format is what compat checks on a new release)."""
    with pytest.raises(SystemExit):
        main(["fit", "--config", DEMO, "--data.init_args.predict_split", "tset"])
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .startswith("vit-ct fit: error: data.predict_split: got 'tset'; expected Literal['train', 'val', 'test']")
    )
