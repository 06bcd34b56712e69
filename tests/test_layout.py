"""The package's layering, read from the imports (AST), and the public ``class_path`` of a saved config.

Each room imports only the rooms below it, exactly as docs/architecture.md states: ``files`` and ``progress``
(the foundation) nothing; ``data`` only those, its sub-rooms each only the ones before it in ``transforms``, ``io``,
``cache``, ``manifests``, then ``loading`` and ``datasets``; ``sim`` only ``data``; ``explain`` of ``data`` only
``transforms`` (the HU windows), no model; ``metrics`` ``data`` and ``explain``; ``model`` (the network and its
weights) of ``data`` only ``transforms``, and no Lightning; ``task`` (the LightningModule) those above; ``run`` those
and ``sim``; ``predict`` those and ``run``; ``inspection`` (a checkpoint opened with its data) the rooms ``predict`` may
import, not ``predict``; ``review`` and ``report`` those, ``predict`` and ``inspection``, neither the other; ``pacs``
(the round trip through a PACS, which runs ``vit-ct predict`` as a process) only the foundation; nothing imports the
CLI but ``python -m vit_ct``; no import cycle anywhere.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from vit_ct.cli import main

PACKAGE = Path(__file__).resolve().parents[1] / "vit_ct"
BASE = {"files", "progress"}
# data's sub-rooms, each importing only the ones before it (loading and datasets know each other not)
DATA_ORDER = ["data.transforms", "data.io", "data.cache", "data.manifests"]
DATA = {"data", *DATA_ORDER, "data.loading", "data.datasets"}
ALLOWED = {
    "files": set(),
    "progress": set(),
    "data": {"data", *BASE},
    **{room: {*DATA_ORDER[: i + 1], *BASE} for i, room in enumerate(DATA_ORDER)},
    "data.loading": {*DATA_ORDER, "data.loading", *BASE},
    "data.datasets": {*DATA_ORDER, "data.datasets", *BASE},
    "sim": {*DATA, "sim", *BASE},
    "explain": {"data.transforms", "explain", *BASE},
    "metrics": {*DATA, "explain", "metrics", *BASE},
    "model": {"data.transforms", "model", *BASE},  # the network and its weights: no metrics, maps or training
    "task": {*DATA, "explain", "metrics", "model", "task", *BASE},
    "run": {*DATA, "explain", "metrics", "model", "task", "sim", "run", *BASE},
    "predict": {*DATA, "explain", "metrics", "model", "task", "run", "predict", *BASE},
    "inspection": {*DATA, "explain", "metrics", "model", "task", "run", "inspection", *BASE},
    "review": {*DATA, "explain", "metrics", "model", "task", "run", "predict", "inspection", "review", *BASE},
    "report": {*DATA, "explain", "metrics", "model", "task", "run", "predict", "inspection", "report", *BASE},
    "pacs": {"pacs", *BASE},  # a client of the vit-ct command (predict runs as its own process), not of its modules
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Every vit_ct module -> the vit_ct modules it imports (at any depth of its code, lazy imports included)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vit_ct":
                for alias in node.names:  # `from vit_ct.review import cases` names a module
                    target = f"{node.module}.{alias.name}"
                    found.add(target if target in modules else node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == "vit_ct"}
        graph[name] = found
    return graph


def folder(module: str) -> str | None:
    """The room of a module: its folder under ``vit_ct/`` (``data.<sub-room>`` inside ``data/``), a foundation module,
    or None for the entry points at the top (``__init__``, ``__main__``, ``cli``)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "data" and (PACKAGE / "data" / parts[2]).is_dir():
        return f"data.{parts[2]}"
    return parts[1] if len(parts) > 2 or parts[-1] in ALLOWED else None


def test_every_room_has_its_rule():
    rooms = {folder(m) for m in imports()} - {None}
    assert rooms == set(ALLOWED), f"rooms without a rule {sorted(rooms - set(ALLOWED))}, rules without a room "
    f"{sorted(set(ALLOWED) - rooms)}"


@pytest.mark.medium
@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_each_folder_imports_only_the_folders_below_it(room):
    wrong = {
        (module, target)
        for module, targets in imports().items()
        if folder(module) == room
        for target in targets
        if folder(target) not in ALLOWED[room]
    }
    assert not wrong, f"{room}/ imports outside {sorted(ALLOWED[room])}: {sorted(wrong)}"


def test_the_network_and_its_weights_need_no_lightning():
    """Every module of ``vit_ct/model/`` imports in a fresh process without loading Lightning: the network and the
    weights it loads are usable (and testable) apart from the framework that trains them."""
    modules = sorted(m for m in imports() if folder(m) == "model" or m == "vit_ct.model")
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += "print(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] == 'lightning'}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert len(modules) > 5 and out.strip() == "[]", f"importing vit_ct.model loads {out.strip()}"


def test_nothing_imports_the_cli():
    importers = {m for m, targets in imports().items() if "vit_ct.cli" in targets}
    assert importers == {"vit_ct.__main__"}


def test_no_import_cycle():
    """Cycles among modules; the package facade ``vit_ct/__init__.py`` (which re-exports the public names) is left out,
    since importing any submodule runs it first by design."""
    graph = {m: {t for t in targets if t != "vit_ct"} for m, targets in imports().items() if m != "vit_ct"}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for target in graph.get(module, ()):
            visit(target, [*path, module])
        done.add(module)

    for module in graph:
        visit(module, [])


@pytest.mark.parametrize(
    ("room", "where", "line"),
    [("data", "data", "from vit_ct.task import ViTClassifier"),
     ("data.io", "data/io", "from vit_ct.data.loading.datamodule import CTSliceDataModule"),
     ("explain", "explain", "from vit_ct.data.io.reader import load_ct_slice")],
)  # fmt: skip
def test_the_rules_see_a_forbidden_import(room, where, line):
    """The walk is real: a data module that imports the model, a room of data that imports one after it, and
    explain reading files are each caught."""
    bad = PACKAGE / where / "_layout_probe.py"
    try:
        bad.write_text(f"def f():\n    {line}\n")
        with pytest.raises(AssertionError, match="_layout_probe"):
            test_each_folder_imports_only_the_folders_below_it(room)
    finally:
        bad.unlink()


def test_no_module_name_in_two_folders():
    """A base name means one concept: ``scans.py`` is the whole scans of ``data/io/``, nowhere else."""
    names = Counter(p.name for p in PACKAGE.rglob("*.py"))
    twice = {name for name, n in names.items() if n > 1} - {"__init__.py", "__main__.py"}
    assert not twice, {name: sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob(name)) for name in twice}


def test_the_public_class_paths_load_in_a_saved_config(tmp_path, capsys):
    """``class_path: vit_ct.SyntheticCTDataModule`` (the public name, as the README writes it) loads as its module's."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"data": {"class_path": "vit_ct.SyntheticCTDataModule", "init_args": {}}}))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["class_path"].split(".")[-1] == "SyntheticCTDataModule"


def test_the_top_of_the_package_holds_only_its_entry_points():
    """A reader sees the architecture in ``ls vit_ct/``: rooms by role, and at the top only the public API, the
    command, and the bases everything shares: writing files, progress bars."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "cli.py", "files.py", "progress.py"]
    oversized = {
        str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400
    }
    assert not oversized, f"modules over 400 lines, split them by concept: {oversized}"


def test_benchmarks_import_each_other_through_their_package():
    """``benchmarks`` is a package: a bare ``import small_data`` of a sibling finds nothing when a benchmark runs as
    ``python -m benchmarks.NAME`` (finer_maps and stem_relevance failed so)."""
    folder = PACKAGE.parent / "benchmarks"
    siblings = {path.stem for path in folder.glob("*.py")}
    bare = [f"{path.name}:{line} {name}" for path in sorted(folder.glob("*.py"))
            for line, name in _absolute_imports(path) if name.split(".")[0] in siblings]  # fmt: skip
    assert not bare, bare


def _absolute_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``path``: ``import a.b`` and ``from a.b import c`` give ``a.b``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_the_tests_mirror_the_rooms():
    """A room's tests live in the folder of its name (``tests/data/`` for ``vit_ct/data``, ``tests/benchmarks/`` for
    ``benchmarks``); at the top of ``tests/`` only what spans the checkout (layout, docs, README, the progress bars of
    every room) and the helpers the folders share."""
    tests = Path(__file__).resolve().parent
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | {"benchmarks"}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders <= rooms, f"test folders that name no room: {sorted(folders - rooms)}"
    top = sorted(p.name for p in tests.glob("test_*.py"))
    assert top == ["test_docs.py", "test_layout.py", "test_progress.py", "test_readme.py"], top
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert all(n == 1 for n in names.values()), [name for name, n in names.items() if n > 1]  # one module name each
    # A test module imports another only from its own folder (pytest puts that folder on the path); what two folders
    # share is a helper at the top of tests/ (conftest, cq500_layout, orthanc_servers, signalled, ...).
    reached = [f"{path.relative_to(tests)}:{line} {name}" for path in sorted(tests.glob("*/test_*.py"))
               for line, name in _absolute_imports(path) if name.startswith("test_")
               and not (path.parent / f"{name}.py").is_file() and not (tests / f"{name}.py").is_file()]  # fmt: skip
    assert not reached, reached
    # A `vit-ct` subprocess has only the top of tests/ on its path: the callbacks it loads by name are there (probes).
    loaded = [f"{path.relative_to(tests)}: {name}" for path in sorted(tests.rglob("test_*.py"))
              for name in re.findall(r"callbacks\+=(\w+)\.", path.read_text())
              if not (tests / f"{name}.py").is_file()]  # fmt: skip
    assert not loaded, f"probe callbacks a subprocess cannot import (move them to tests/probes.py): {loaded}"
