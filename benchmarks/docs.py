"""``make docs``: every measured figure of README.md and docs/*.md written in from its record (``benchmarks/records/``,
``benchmarks.recording``), and the tables read from the code. ``tests/test_docs.py`` checks that the Markdown equals
what this writes, so a figure edited by hand, or a record replaced without the text, fails ``make test``.

The Markdown carries HTML comments, which GitHub does not show, around what is generated:

    <!-- begin table RECORD TABLE -->      a record's table, whole, and the line saying how it was measured
    <!-- begin measured RECORD -->         only that line
    <!-- begin markdown RECORD KEY -->     Markdown a record keeps in its notes (a script's own printed tables)
    <!-- begin demo-report -->             the report ``make demo`` printed, from the demo's record
    <!-- begin demo-targets -->            the demo's figures against the targets (records demo and faithfulness)
    <!-- begin family-ranges -->           the held-out families beside the pretraining's ranges (from the code)
    <!-- begin package-map -->             every room and module of vit_ct/, each by its docstring (from the code)
    <!-- begin package-rooms -->           the top-level rooms of vit_ct/, one line each (from the code)
    ...
    <!-- end -->

    <!--fig RECORD KEY FORMAT-->0.968<!--/fig-->   one figure of a record, in a sentence or a table cell: KEY names
        one of its figures (or ``seconds``), FORMAT is a format spec (``.3f``, ``.1%``), a template (``{:.2f}x``) or
        ``duration`` (``7 min 28 s``)

    python -m benchmarks.docs            # write the generated parts
    python -m benchmarks.docs --check    # list what differs, write nothing (exit status 1 if anything does)

Both also list the records measured with earlier code (their fingerprinted files changed since, or written before
records kept one) or on a tree with uncommitted changes: what to measure again.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks import recording
from benchmarks.recording import RECORDS, cell, describe, duration, markdown_table, read_record

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- begin (?P<spec>[^>]*?) -->\n(?P<body>.*?)<!-- end -->", re.DOTALL)
FIGURE = re.compile(r"<!--fig (?P<spec>[^>]*?)-->(?P<value>.*?)<!--/fig-->")


def documents(root: Path = ROOT) -> list[Path]:
    """The Markdown the generator writes into: the README and every page of docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


class Records:
    """The records a document names, each read once."""

    def __init__(self, folder: Path = RECORDS):
        self.folder, self.cache = folder, {}

    def __getitem__(self, name: str) -> dict:
        if name not in self.cache:
            self.cache[name] = read_record(name, self.folder)
        return self.cache[name]

    def figure(self, name: str, key: str):
        record = self[name]
        if key in record["figures"]:
            return record["figures"][key]
        if key == "seconds":
            return record["seconds"]
        raise ValueError(f"record {name} has no figure {key!r} (it has {sorted(record['figures'])})")


def typed_today(command: str) -> str:
    """A record's command as it is typed in the checkout today: benchmarks written as scripts
    (``python benchmarks/NAME.py``) before they became a package run as ``python -m benchmarks.NAME``."""
    return re.sub(r"^python benchmarks/(\w+)\.py\b", r"python -m benchmarks.\1", command)


def measured(record: dict) -> str:
    """How a record was measured, in one line: the command, how long it took, the machine, the date, the commit, and
    whether the code it ran has changed since (:func:`earlier_code`)."""
    took = f" ({duration(record['seconds'])})" if record.get("seconds") is not None else ""
    machine = record["machine"]
    load = machine.get("load_average_1min")
    load = f", load average {load:g}" if load is not None else ""
    commit = (record.get("commit") or "unknown")[:7] + (" with uncommitted changes" if record.get("dirty") else "")
    command = typed_today(record["command"])
    line = f"Measured by `{command}`{took} on {describe(machine)}{load}; {record['date'][:10]}, commit {commit}."
    return line + earlier_code(record)


def changed_code(record: dict, root: Path | None = None) -> list[str] | None:
    """The files a record ran whose code changed since (:func:`benchmarks.recording.changed_code`: other bytes, or
    gone), less those that changed in comments and docstrings only: the file as git holds it at the record's commit,
    those very bytes, parses to the same code as the file now. None for a record written before records kept their
    code."""
    root = recording.ROOT if root is None else root
    changed = recording.changed_code(record, root)
    if not changed or not record.get("commit"):
        return changed
    return [relative for relative in changed
            if not _same_code_as_at(root, relative, record["code"][relative], record["commit"])]  # fmt: skip


def _same_code_as_at(root: Path, relative: str, digest: str, commit: str) -> bool:
    path = root / relative
    if not path.is_file() or path.suffix not in (".py", ".yaml", ".yml"):
        return False
    try:
        before = subprocess.run(["git", "show", f"{commit}:{relative}"], cwd=root, capture_output=True,
                                check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):  # no git, or a clone without that commit: the bytes decide
        return False
    if hashlib.sha256(before).hexdigest()[:16] != digest:  # not the file the record ran
        return False
    return _code_of(before, path.suffix) == _code_of(path.read_bytes(), path.suffix)


def _code_of(source: bytes, suffix: str) -> object:
    """What a file does, without its comments: a Python module's syntax tree less its docstrings (positions left out),
    a YAML config's loaded value; a value equal to nothing for a file that does not parse."""
    import yaml

    try:
        if suffix != ".py":
            return yaml.safe_load(source)
        tree = ast.parse(source)
    except (SyntaxError, ValueError, yaml.YAMLError):
        return object()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):  # fmt: skip
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def earlier_code(record: dict) -> str:
    """A sentence for a record whose figures the current code may not give: written before records kept the code they
    ran, or some of that code changed since. Said without the list, which ``--check`` prints, so that the documents
    change when a record goes stale, not with every later edit."""
    changed = changed_code(record)
    if changed is None:
        return " **Measured with earlier code**: the record predates keeping the code it ran."
    if changed:
        return " **Measured with earlier code**: files it ran have changed since (`python -m benchmarks.docs --check`)."
    return ""


def table_block(records: Records, name: str, table: str | None = None) -> str:
    record = records[name]
    tables = record["tables"]
    if table is None and len(tables) == 1:
        table = next(iter(tables))
    if table not in tables:
        raise ValueError(f"record {name} has no table {table!r} (it has {sorted(tables)})")
    return markdown_table(tables[table]) + "\n\n" + measured(record)


def measured_block(records: Records, name: str) -> str:
    return measured(records[name])


def markdown_block(records: Records, name: str, key: str) -> str:
    record = records[name]
    if key not in record["notes"]:
        raise ValueError(f"record {name} keeps no {key!r} in its notes")
    return record["notes"][key].strip("\n") + "\n\n" + measured(record)


def demo_report_block(records: Records) -> str:
    return "```text\n" + records["demo"]["notes"]["report"].strip("\n") + "\n```"


def demo_targets_block(records: Records) -> str:
    """The demo's test figures against the project's targets, with whether each is met."""
    m = {key.removeprefix("test/"): value for key, value in records["demo"]["figures"].items()}
    floor = m["rollout_outside_head_floor"]
    finer = ""  # the maps read over shifted grids: the ceiling on their own grid too
    if "perfect_grid_dice" in m:
        finer = f"; on the map's finer grid: {m['perfect_grid_dice']:.3f} / {m['perfect_grid_hd95_mm']:.1f} mm"
    rows = [
        ("AUROC", f"**{m['auroc']:.3f}**", ">= 0.95", m["auroc"] >= 0.95),
        ("accuracy / sensitivity / specificity at p = 0.5",
         f"{m['accuracy']:.3f} / {m['sensitivity']:.3f} / {m['specificity']:.3f}", "", None),
        ("rollout pointing game (5 mm)", f"**{m['rollout_pointing']:.3f}**", ">= 0.93", m["rollout_pointing"] >= 0.93),
        ("rollout energy in mask / mask's area share",
         f"{m['rollout_energy']:.3f} / {m['rollout_mask_fraction']:.3f} = **{m['rollout_energy_ratio']:.1f}x**",
         ">= 5x", m["rollout_energy_ratio"] >= 5),
        ("rollout in-head pixel AUROC",
         f"**{m['rollout_pixel_auroc']:.3f}** (image floor {m['floor_image_pixel_auroc']:.3f}; head floor "
         f"{m['floor_head_pixel_auroc']:.3f})", ">= 0.93", m["rollout_pixel_auroc"] >= 0.93),
        ("rollout Dice at half max / HD95",
         f"**{m['rollout_dice']:.3f}** / {m['rollout_hd95_mm']:.1f} mm (perfect patch map: "
         f"{m['perfect_patch_dice']:.3f} / {m['perfect_patch_hd95_mm']:.1f} mm{finer})",
         ">= 0.65", m["rollout_dice"] >= 0.65),
        ("rollout on air patches (`rollout_air`)", f"**{m['rollout_air']:.1%}**", "<= 2%", m["rollout_air"] <= 0.02),
        ("rollout outside the head, slice grid", f"**{m['rollout_outside_head']:.1%}** (perfect patch-level map: "
         f"{floor:.1%})", "within 5 points of the floor", m["rollout_outside_head"] - floor <= 0.05),
    ]  # fmt: skip
    if "scan_auroc" in m:
        rows.insert(2, ("scan AUROC (a scan's most suspicious slice)", f"{m['scan_auroc']:.3f}", "", None))
    if "faithfulness" in {p.stem for p in records.folder.glob("*.json")}:
        f = records["faithfulness"]["figures"]
        methods = ("rollout", "last_block_attention", "gradient_rollout", "grad_cam", "floor_image")
        values = " / ".join(f"{f[f'{name}_deletion']:.3f}" for name in methods)
        met = f["rollout_deletion"] <= min(f["last_block_attention_deletion"], f["gradient_rollout_deletion"]) and (
            f["rollout_deletion"] < min(f["grad_cam_deletion"], f["floor_image_deletion"])
        )
        slices = records["faithfulness"]["notes"]["slices"]
        faithfulness, demo = records["faithfulness"], records["demo"]
        run_id = Path(demo["notes"]["summary"]["run_dir"]).name  # the demo's run: its checkpoints live under it
        scored_this_run = f"/{run_id}/checkpoints/" in faithfulness["command"]
        if faithfulness.get("commit") != demo.get("commit") or not scored_this_run:  # said in the row itself
            changes = " with uncommitted changes" if faithfulness.get("dirty") else ""
            values += f" (not this run: an earlier demo run's checkpoint, commit {faithfulness['commit'][:7]}{changes})"
        rows.append((f"deletion AUC, {slices} lesion slices (lower is better): rollout / last-block attention / "
                     "gradient rollout / Grad-CAM / image", values,
                     "rollout <= last-block and gradient rollout; < Grad-CAM and image", met))  # fmt: skip
    lines = ["| the demo's test set | this run | target | met |", "|---|---|---|---|"]
    for name, value, target, met in rows:
        lines.append(f"| {name} | {value} | {target} | {'' if met is None else 'yes' if met else '**no**'} |")
    return "\n".join(lines)


def family_ranges_block(records: Records) -> str:
    from benchmarks import family_ranges  # imported only where a document asks for its table

    rows = family_ranges.settings()
    outside = "; ".join(f"the {name} family's {', '.join(family_ranges.outside(name, rows)) or 'nothing'}"
                        for name in rows[0].families)  # fmt: skip
    text = f"Outside the pretraining's ranges: {outside}; every other setting lies inside."
    return family_ranges.markdown(rows) + "\n\n" + text


def summary(docstring: str | None) -> str:
    """A module's docstring to its first clause, in Markdown: up to the first full stop, semicolon or colon (after 20
    characters) outside brackets, whitespace folded, Sphinx roles and reST literals as code."""
    text = " ".join((docstring or "").split())
    text = re.sub(r":\w+:`~?([\w.]+)`", lambda m: f"`{m[1].rsplit('.', 1)[-1]}`", text)  # Sphinx roles: the name
    text = text.replace("``", "`")  # reST literals as Markdown's
    depth = 0
    for i, char in enumerate(text):
        depth += char in "([" and 1 or -(char in ")]")
        end_of_word = i + 1 == len(text) or text[i + 1] == " "
        if depth == 0 and end_of_word and (char in ".;" or (char == ":" and i >= 20)):
            return text[:i]
    return text


def package_modules(package: Path = ROOT / "vit_ct") -> dict[str, list[tuple[str, str]]]:
    """Every module of the package by room (``.`` for the top), each with its docstring's :func:`summary`."""
    import ast

    rooms: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        room = "/".join(relative.parts[:-1]) or "."
        rooms.setdefault(room, []).append((relative.name, summary(ast.get_docstring(ast.parse(path.read_text())))))
    return rooms


def package_map_block(records: Records) -> str:
    """Every room and module of ``vit_ct/`` with the first clause of its docstring: the map cannot drift from the
    code, since it is the code's own words."""
    lines = []
    for room, modules in package_modules().items():
        about = dict(modules).get("__init__.py", "") if room != "." else ""
        lines.append(f"- **`{'vit_ct' if room == '.' else room}/`**" + (f" {about}" if about else ""))
        lines += [f"  - `{name}`: {text}" for name, text in modules if room == "." or name != "__init__.py"]
    return "\n".join(lines)


def package_rooms_block(records: Records) -> str:
    """The top-level rooms of ``vit_ct/`` and the modules at its top, one line each, for the README's overview."""
    rooms = package_modules()
    lines = [f"- `{name}`: {text}" for name, text in rooms["."] if name != "__init__.py"]
    lines += [f"- `{room}/`: {dict(modules).get('__init__.py', '')}" for room, modules in rooms.items()
              if room != "." and "/" not in room]  # fmt: skip
    return "\n".join(lines)


BLOCKS: dict[str, Callable[..., str]] = {
    "table": table_block,
    "measured": measured_block,
    "markdown": markdown_block,
    "demo-report": demo_report_block,
    "demo-targets": demo_targets_block,
    "family-ranges": family_ranges_block,
    "package-map": package_map_block,
    "package-rooms": package_rooms_block,
}


def render(text: str, records: Records, source: str = "<text>") -> str:
    """``text`` with every generated part written from the records (and the code).

    Raises:
        ValueError: a marker names an unknown kind, record, table or figure (naming ``source`` and its line).
    """

    def where(match: re.Match) -> str:
        return f"{source} line {text.count(chr(10), 0, match.start()) + 1}"

    def block(match: re.Match) -> str:
        kind, *args = match["spec"].split()
        if kind not in BLOCKS:
            raise ValueError(f"{where(match)}: unknown generated part {kind!r}; expected one of {sorted(BLOCKS)}")
        try:
            body = BLOCKS[kind](records, *args)
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(f"{where(match)}: <!-- begin {match['spec']} -->: {error}") from error
        return f"<!-- begin {match['spec']} -->\n{body}\n<!-- end -->"

    def figure(match: re.Match) -> str:
        parts = match["spec"].split()
        if len(parts) != 3:
            raise ValueError(f"{where(match)}: <!--fig {match['spec']}-->: expected <!--fig RECORD KEY FORMAT-->")
        name, key, spec = parts
        try:
            value = cell(records.figure(name, key), spec)
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(f"{where(match)}: <!--fig {match['spec']}-->: {error}") from error
        return f"<!--fig {match['spec']}-->{value}<!--/fig-->"

    return FIGURE.sub(figure, BLOCK.sub(block, text))


def differences(path: Path, records: Records) -> list[str]:
    """Each generated part of ``path`` whose text is not what its record (or the code) gives, as one line each."""
    text = path.read_text()
    rendered = render(text, records, str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path))
    if rendered == text:
        return []
    found = []
    for pattern in (BLOCK, FIGURE):
        for now, then in zip(pattern.finditer(text), pattern.finditer(rendered), strict=True):
            if now.group(0) != then.group(0):
                line = text.count("\n", 0, now.start()) + 1
                found.append(f"{path.name} line {line}: {now.group(0)[:160]!r} should read {then.group(0)[:160]!r}")
    return found or [f"{path.name}: differs from its records"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="list what differs; write nothing")
    parser.add_argument("--records", type=Path, default=RECORDS, help="the records' folder")
    args = parser.parse_args(argv)
    records = Records(args.records)
    changed = []
    for path in documents():
        found = differences(path, records)
        if found and not args.check:
            path.write_text(render(path.read_text(), records, path.name))
        changed += found
    for line in changed:
        print(("differs: " if args.check else "written: ") + line)
    for line in stale_records(args.records):
        print(line)
    return 1 if changed and args.check else 0


def stale_records(folder: Path = RECORDS) -> list[str]:
    """One line per record whose measured code changed since (:func:`changed_code`), or that
    was measured on a tree with uncommitted changes, or written before records kept their code: what to measure
    again before its figures are read as the current code's."""
    lines = []
    for path in sorted(folder.glob("*.json")):
        record = read_record(path.stem, folder)
        changed = changed_code(record)
        if changed is None:
            lines.append(f"earlier code: {path.stem} (written before records kept the code they ran)")
        elif changed:
            shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
            lines.append(f"earlier code: {path.stem} ({shown} changed since)")
        if record.get("dirty"):
            lines.append(f"uncommitted: {path.stem} (measured on commit {str(record.get('commit'))[:7]} with changes)")
    return lines


if __name__ == "__main__":
    sys.exit(main())
