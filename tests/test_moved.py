"""Every name docs/moved.md says is kept under an old path loads from there, with a DeprecationWarning naming its new
place; a class a config names (data module, callback) loads as a ``class_path`` through ``vit-ct fit --print_config``.
The rows are read from docs/moved.md itself, so that the page, vit_ct/run/aliases.py and this test cannot drift."""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Callback, LightningDataModule

from vit_ct.cli import main
from vit_ct.run.aliases import ALIASES, MOVED

MOVED_PAGE = Path(__file__).resolve().parents[1] / "docs" / "moved.md"


def kept_names() -> list[tuple[str, str, set[str]]]:
    """(old module, name, the new modules its row names) for each name of the page's table of kept names."""
    rows = []
    for line in MOVED_PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not re.fullmatch(r"`vit_ct(\.\w+)+`", cells[0]):
            continue
        module = cells[0].strip("`")
        homes = {h.strip("` ") for h in cells[2].split(",")}
        rows += [(module, name.strip("` "), homes) for name in cells[1].split(",")]
    return rows


KEPT = kept_names()


def test_the_page_lists_exactly_what_the_aliases_keep():
    listed = {(module, name) for module, name, _ in KEPT}
    kept = {(module, name) for table in (ALIASES, MOVED) for module, names in table.items() for name in names}
    assert len(KEPT) > 30 and listed == kept, (sorted(listed - kept), sorted(kept - listed))
    for module, name, homes in KEPT:
        home = {**ALIASES, **MOVED}[module][name]
        assert home in homes, f"docs/moved.md: {module}.{name} lives in {home}, its row says {sorted(homes)}"


@pytest.mark.parametrize(("old", "name", "homes"), KEPT, ids=[f"{m}.{n}" for m, n, _ in KEPT])
def test_each_old_path_loads_with_a_warning_naming_the_new_place(old, name, homes):
    new = {**ALIASES, **MOVED}[old][name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = getattr(importlib.import_module(old), name)
    said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert f"{old}.{name} moved to {new}.{name}" in " ".join(said), said
    assert loaded is getattr(importlib.import_module(new), name)


def _config_key(obj) -> str | None:
    if isinstance(obj, type) and issubclass(obj, LightningDataModule):
        return "data"
    if isinstance(obj, type) and issubclass(obj, Callback):
        return "callbacks"
    return None


CLASS_PATHS = [
    (old, name)
    for old, name, _ in KEPT
    if _config_key(getattr(importlib.import_module({**ALIASES, **MOVED}[old][name]), name))
]
INIT_ARGS = {"CTSliceDataModule": {"manifest": "m.csv"}, "SliceDataModule": {"augment": False}}


@pytest.mark.parametrize(("old", "name"), CLASS_PATHS, ids=[f"{m}.{n}" for m, n in CLASS_PATHS])
def test_each_old_class_path_loads_in_a_config(tmp_path, capsys, old, name):
    """As a saved ``config.yaml`` names it: the data module, or a callback in ``trainer.callbacks``."""
    assert any(row[:2] == (old, name) for row in KEPT)
    class_path = f"{old}.{name}"
    entry = {"class_path": class_path, "init_args": INIT_ARGS.get(name, {})}
    cls = getattr(importlib.import_module({**ALIASES, **MOVED}[old][name]), name)
    config = {"data": entry} if _config_key(cls) == "data" else {"trainer": {"callbacks": [entry]}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(tmp_path / "config.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None), capsys.readouterr().err[-2000:]
    printed = yaml.safe_load(capsys.readouterr().out)
    chosen = printed["data"] if "data" in config else printed["trainer"]["callbacks"][0]
    assert chosen["class_path"].split(".")[-1] == name


def test_epoch_lines_by_its_first_path_is_among_them():
    """``vit_ct.progress.EpochLines`` (a module still there) loads as a class_path: issue 34 named it."""
    assert ("vit_ct.progress", "EpochLines") in CLASS_PATHS
