"""Every measured figure of the README and docs is one a record holds (``benchmarks/records/``), written in by ``make
docs`` (``benchmarks/docs.py``): a figure edited by hand, a record replaced without the text, or a record named by
the docs that does not exist fails here. The demo's sample output has the rows and columns ``make demo`` prints."""

from __future__ import annotations

import ast
import io
import json
import re
import shutil
import subprocess
import tokenize

import pytest
from conftest import ROOT

from benchmarks import docs, processes
from benchmarks import recording as records_module
from benchmarks.recording import (
    RECORD_KEEPING,
    RECORDS,
    changed_code,
    code_fingerprint,
    duration,
    markdown_table,
    read_record,
    table,
    write_record,
)
from vit_ct.run.summary import report

README = ROOT / "README.md"
# A measured figure outside a generated part: a duration, a size, a speed-up, a rate, a score of two or more
# decimals, a percentage, a ratio in words.
MEASURED = re.compile(
    r"\b\d[\d,]*(\.\d+)? ?(ms|s|min|h|GB|MB|GiB|MiB)\b|\b\d+(\.\d+)?x\b|\b0\.\d{2,}\b|\b\d[\d,.]* (slices|images)/s"
    r"|\b\d+(\.\d+)?\s?%|\bhalf the (time|memory)\b"
    r"|\b(twice|thrice|(two|three|four|five|six|seven|eight|nine|ten) times) (as|faster|slower|more|less|fewer)\b",
    re.IGNORECASE,
)
# The same shapes that are settings, formats or examples, not measurements: allowed in these phrases only (the
# paragraph, whitespace folded, must hold the phrase around the figure), each with its source.
SETTINGS = {
    "95% interval": "the report's intervals: a setting",
    "95% intervals": "the report's intervals: a setting",
    "95% specificity": "an operating point the report defines",
    "90% / 95%": "operating points the report defines",
    "at least 90% / 95%": "the operating points' definition",
    "90% (95%)": "the operating points' definition",
    "zoom ±10%": "augmentation range (configs, augment.py)",
    "shift ±6%": "augmentation range",
    "up to 6% of the side": "augmentation range",
    "10%) and shifts": "augmentation range",
    "rotation (10%)": "the simulator's draw",
    "(2%, clip": "the simulator's draw",
    "(25% of scanners)": "simulator",
    "for 30% of patients": "simulator",
    "gain (±2%)": "simulator",
    "0.82-1.08": "simulator head sizes",
    "0-0.12": "the pretraining's draw",
    "low_contrast_fraction: 0.15": "a config value",
    "chance 0.35": "the held-out set's draw (sim)",
    "at least 1% of the pixels": "the reader's rule (dicom.py)",
    "only 0% of the pixels": "an error message quoted",
    "steps of 0.01": "the report's grid",
    "specificity >= 0.90": "the operating point's definition",
    "std 0.02": "timm's init scheme",
    "decay 0.75": "a config value",
    "decay 0.999": "an option's example",
    "layer_decay 0.65": "an option",
    "timm 1.0.31": "a version",
    "0.03 HU steps": "float16's resolution",
    "four times the passes": "4 x 4 vs 2 x 2",
    "train/loss 0.5120": "an example line",
    "val/loss 0.4980": "an example line",
    "val/auroc 0.8710": "example",
    "val/scan_auroc 0.9000": "an example line",
    "P(lesion) 0.873": "an example caption",
    "several times as much": "points at the table above",
    "( to 0.75)": "an option's range (after a code span)",
    "HD95 within 0.01 mm": "the card test's tolerance (tests/model/test_shipped.py)",
}
# Numbers the docs state as prose without a record, each with where it comes from (the rule: a paper's
# figure, a configuration value, a fact of the file format or the code).
PROSE = {
    "128 KiB": "a float16 slice at 256 x 256: 256 * 256 * 2 bytes (the disk cache's format)",
    "30 min": "torch.distributed's default process-group timeout (Lightning's barrier in prepare_data)",
    "60 s": "the verdicts' lock timeout (vit_ct/review/verdicts.py)",
    "5 s": "how often the disk cache flushes while it is built (vit_ct/data/cache/slice_cache.py)",
    "0.625": "the thinnest slice the pretraining set draws (SLICE_THICKNESSES_MM, vit_ct/sim/protocol.py)",
}


def generated_parts_removed(text: str, *, keep_bare_figures: bool = False) -> str:
    text = docs.BLOCK.sub("", text)
    text = docs.FIGURE.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # commands and sample output
    if keep_bare_figures:  # `0.99` or `12 s` alone in a code span is a figure dressed as code
        text = re.sub(r"`\s*([\d.,]+\s?(%|x|s|ms|min)?)\s*`", r"\1", text)
    return re.sub(r"`[^`]*`", "", text)  # code, options and examples: `--trainer.callbacks.decay 0.999`


def test_every_generated_part_of_the_readme_and_docs_equals_its_record():
    found = [line for path in docs.documents() for line in docs.differences(path, docs.Records())]
    assert not found, "run `make docs` (or measure again):\n" + "\n".join(found)


def stray_figures(text: str, name: str = "<text>") -> list[str]:
    """Measurement-shaped figures of ``text`` outside generated parts and code, neither a stated setting
    (:data:`SETTINGS`) nor a reviewed prose number (:data:`PROSE`); a code span holding only a figure is read too."""
    stray = []
    text = generated_parts_removed(text, keep_bare_figures=True)
    for paragraph in re.split(r"\n\s*\n", text):
        folded = " ".join(paragraph.split())
        for match in MEASURED.finditer(folded):
            figure = match.group(0).strip()
            around = folded[max(0, match.start() - 40) : match.end() + 40]
            if figure in PROSE or any(figure in phrase and phrase in around for phrase in SETTINGS):
                continue
            stray.append(f"{name}: {figure!r} in {around!r}")
    return stray


def test_the_docs_state_no_measured_figure_outside_a_generated_part():
    stray = [line for path in docs.documents() for line in stray_figures(path.read_text(), path.name)]
    assert not stray, "figures without a record (measure them into one and mark them, or remove them):\n" + "\n".join(
        stray
    )


# A measurement in the package's comments and docstrings or the configs' comments: a duration, a speed-up, a rate, a
# cost in percent, a score. They point at the record that measured it instead (the benchmark's module).
CODE_MEASURED = re.compile(
    r"(?<![\w-])\d[\d,]*(\.\d+)?(-\d+(\.\d+)?)? ?(ms|s|min|minutes|seconds|hours)\b"
    r"|\b\d+(\.\d+)?(-\d+(\.\d+)?)?x (faster|slower|cheaper|quicker|as fast)"
    r"|\b(twice|thrice|(two|three|four|five|ten) times) (as fast|as slow|faster|slower|cheaper)"
    r"|\b\d[\d,.]* (slices|images|steps|items|samples|scans)/s\b"
    r"|\d+(\.\d+)?\s?% (slower|faster|more time|less time|cheaper|of the time|more memory|less memory)"
    r"|\b(AUROC|AUC|Dice|pointing|accuracy|sensitivity|specificity)( of)? \d?\.\d+",
)
# Reviewed: arithmetic or a format's fact, not a measurement.
CODE_FACTS = {
    "4x cheaper": "a projection 2x coarser on both axes samples a quarter as much (vit_ct/sim/scanner.py)",
}


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """Each comment and docstring of a module's ``source`` with its line, code spans (examples) removed."""
    found = [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        docstring = isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        if docstring and (doc := ast.get_docstring(node, clean=False)) is not None:
            found.append((node.body[0].lineno, doc))
    return [(line, re.sub(r"``.*?``", "", " ".join(text.split()))) for line, text in found]


def measured_in_code(text: str, where: str) -> list[str]:
    return [
        f"{where}: {m.group(0)!r} in {text[max(0, m.start() - 40) : m.end() + 30]!r}"
        for m in CODE_MEASURED.finditer(text)
        if m.group(0) not in CODE_FACTS
    ]


def test_the_code_and_configs_state_no_measured_figure_and_point_at_the_record():
    found = []
    for path in sorted((ROOT / "vit_ct").rglob("*.py")):
        for line, text in comments_and_docstrings(path.read_text()):
            found += measured_in_code(text, f"{path.relative_to(ROOT)}:{line}")
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        for line, text in enumerate(path.read_text().splitlines(), 1):
            if "#" in text:
                found += measured_in_code(text[text.index("#") :], f"{path.relative_to(ROOT)}:{line}")
    assert not found, (
        "a measured figure in code or a config: name the benchmark that records it instead:\n" + "\n".join(found)
    )
    example = "# 0.4 ms a slice, 1.3-1.4x faster, 860 slices/s, ~20% slower, AUROC 0.93, twice as fast; 4x cheaper"
    seen = [line.split(": ", 1)[1].split(" in ")[0] for line in measured_in_code(example, "x")]
    assert seen == [
        "'0.4 ms'",
        "'1.3-1.4x faster'",
        "'860 slices/s'",
        "'20% slower'",
        "'AUROC 0.93'",
        "'twice as fast'",
    ]
    assert comments_and_docstrings('"""Example: ``42.1 s``."""\nx = 1  # 0.4 ms\n') == [
        (2, "# 0.4 ms"),
        (1, "Example: ."),
    ]


def test_the_package_map_is_every_module_in_its_own_words(tmp_path):
    """docs/architecture.md's map is written from the code: each module named once with its docstring's first
    clause; a module added, removed or redescribed without `make docs` fails the check above."""
    modules = docs.package_modules()
    listed = {f"{room}/{name}" for room, names in modules.items() for name, _ in names}
    assert listed == {p.relative_to(ROOT / "vit_ct").as_posix() if p.parent != ROOT / "vit_ct" else f"./{p.name}"
                      for p in (ROOT / "vit_ct").rglob("*.py")}  # fmt: skip
    undescribed = [f"{room}/{name}" for room, names in modules.items() for name, text in names if len(text) < 10]
    assert undescribed == [], "give each module a docstring whose first clause says what it holds"
    assert docs.summary("What a report reads: a model's predictions (a `vit-ct predict` output). More.") == (
        "What a report reads: a model's predictions (a `vit-ct predict` output)"
    )
    assert docs.summary("The model (:mod:`~vit_ct.task.classifier`; ``x``). Rest.") == "The model (`classifier`; `x`)"
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert "- **`data/io/`**" in page and "  - `reader.py`: Read one CT slice" in page


def test_a_figure_written_outside_the_markers_is_seen():
    """What a careless edit adds: percentages, two-decimal scores, figures in code spans and ratios in words."""
    added = "AUROC 0.99 on real CT, 97% sensitivity, `0.995` pixel AUROC, twice as fast as nnU-Net."
    found = [line.split(": ", 1)[1].split(" in ")[0] for line in stray_figures(added)]
    assert found == ["'0.99'", "'97%'", "'0.995'", "'twice as'"]
    assert stray_figures("the report's 95% intervals by patient; zoom ±10%") == []  # stated settings


def test_a_figure_edited_by_hand_fails(tmp_path):
    text = README.read_text()
    figure = next(docs.FIGURE.finditer(text))
    edited = text[: figure.start("value")] + "1" + text[figure.start("value") :]  # 0.968 -> 10.968
    (tmp_path / "README.md").write_text(edited)
    found = docs.differences(tmp_path / "README.md", docs.Records())
    line = text.count("\n", 0, figure.start()) + 1
    assert found and found[0].startswith(f"README.md line {line}:"), found
    block = next(docs.BLOCK.finditer(text))
    body = block.group("body")
    digit = re.search(r"\d", body).start() + block.start("body")
    edited = text[:digit] + str((int(text[digit]) + 1) % 10) + text[digit + 1 :]
    (tmp_path / "README.md").write_text(edited)
    assert docs.differences(tmp_path / "README.md", docs.Records()), "a digit of a generated table changed by hand"


def test_a_record_replaced_without_the_text_fails(tmp_path):
    text = README.read_text()
    name, key, _spec = next(m["spec"].split() for m in docs.FIGURE.finditer(text) if "seconds" not in m["spec"])
    folder = tmp_path / "records"
    shutil.copytree(RECORDS, folder)
    record = json.loads((folder / f"{name}.json").read_text())
    record["figures"][key] = record["figures"][key] * 0.5 + 0.001  # a record measured again
    (folder / f"{name}.json").write_text(json.dumps(record))
    assert not docs.differences(README, docs.Records(RECORDS))
    assert docs.differences(README, docs.Records(folder))


def test_a_marker_naming_no_record_or_figure_is_refused_by_file_and_line(tmp_path):
    with pytest.raises(ValueError, match=r"X\.md line 2: .*nothing\.json: no such record"):
        docs.render("text\n<!--fig nothing auroc .3f-->0.9<!--/fig-->\n", docs.Records(tmp_path), "X.md")
    write_record("r", {"auroc": 0.9}, command="python x.py", folder=tmp_path)
    with pytest.raises(ValueError, match=r"X\.md line 1: .*record r has no figure 'pointing'"):
        docs.render("<!--fig r pointing .3f-->0.9<!--/fig-->", docs.Records(tmp_path), "X.md")
    with pytest.raises(ValueError, match=r"unknown generated part 'chart'"):
        docs.render("<!-- begin chart r -->\n<!-- end -->", docs.Records(tmp_path), "X.md")
    assert docs.render("<!--fig r auroc .1%-->?<!--/fig-->", docs.Records(tmp_path)) == (
        "<!--fig r auroc .1%-->90.0%<!--/fig-->"
    )


def test_a_record_holds_the_figures_the_command_the_commit_and_the_machine(tmp_path):
    results = table(["method", "ms"], [["a", 1.234], ["b", None]], [None, ".1f"])
    path = write_record("bench", {"a_ms": 1.234}, command="python -m benchmarks.x --n 2", tables={"t": results},
                        seconds=448.4, folder=tmp_path)  # fmt: skip
    record = read_record("bench", tmp_path)
    assert path == tmp_path / "bench.json" and record["figures"] == {"a_ms": 1.234}
    assert record["command"] == "python -m benchmarks.x --n 2" and record["seconds"] == 448.4
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]) and isinstance(record["dirty"], bool)
    assert {"cpu", "cpus_usable", "native_bf16", "torch"} <= set(record["machine"])
    assert markdown_table(record["tables"]["t"]) == "| method | ms |\n|---|---:|\n| a | 1.2 |\n| b |  |"
    assert (duration(448.4), duration(52), duration(4980)) == ("7 min 28 s", "52 s", "1 h 23 min")
    with pytest.raises(ValueError, match="record name 'Bad name'"):
        write_record("Bad name", {}, command="x", folder=tmp_path)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json is not valid JSON"):
        read_record("broken", tmp_path)
    with pytest.raises(ValueError, match="every row and the formats need 2 cells"):
        table(["a", "b"], [[1]])
    assert records_module.RECORDS == ROOT / "benchmarks" / "records"


def report_rows(text: str) -> list[str]:
    """Each line of a report without its figures and paths: its row name, the names of its figures, the columns."""
    words = (word for line in text.strip("\n").splitlines() for word in [line.split()])
    return [" ".join(w for w in line if "/" not in w and not re.match(r"[-\d.]", w)) for line in words]


def test_the_readme_sample_output_has_the_rows_and_columns_the_demo_prints_today(tmp_path):
    """The report of the demo's record is the README's sample (test above); here it is held against what
    ``vit_ct.run.summary.report`` prints today from the same run's summary: same rows, same columns."""
    demo = read_record("demo")
    sample = re.search(r"<!-- begin demo-report -->\n```text\n(.*?)```", README.read_text(), re.DOTALL).group(1)
    assert sample.strip() == demo["notes"]["report"].strip()
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    for name, rows in demo["notes"]["rows"].items():  # the row counts the report prints
        (outputs / f"{name}.csv").write_text("a\n" + "1\n" * rows)
    today = report(outputs, demo["notes"]["summary"])
    assert report_rows(today) == report_rows(sample)
    assert "perfect_patch" in sample and "hd95_mm" in sample and "dice" in sample


def test_the_demo_left_the_checkout_as_it_was():
    assert read_record("demo")["notes"]["tracked_files_unchanged"]


def test_a_record_keeps_the_code_it_ran_and_the_check_lists_what_changed_since(tmp_path):
    path = write_record("r", {"auroc": 0.9}, command="python -m benchmarks.docs --config configs/demo.yaml",
                        folder=tmp_path, git={"commit": "abc", "dirty": False})  # fmt: skip
    record = read_record("r", tmp_path)
    assert {"configs/demo.yaml", "benchmarks/processes.py"} <= set(record["code"])
    assert not RECORD_KEEPING & set(record["code"])  # writing and checking records measures nothing
    assert changed_code(record) == []  # the code as it is now
    assert changed_code({"code": {**record["code"], "benchmarks/docs.py": "0" * 16}}) == []  # as older records list
    root = tmp_path / "checkout"
    (root / "configs").mkdir(parents=True)
    (root / "configs" / "x.yaml").write_text("a: 1\n")
    code = code_fingerprint("vit-ct fit --config configs/x.yaml", root=root)
    assert list(code) == ["configs/x.yaml"]  # this process's vit_ct modules lie outside that root
    (root / "configs" / "x.yaml").write_text("a: 2\n")
    assert changed_code({"code": code}, root=root) == ["configs/x.yaml"]
    assert changed_code({"figures": {}}) is None  # written before records kept their code
    old = json.loads(path.read_text())
    old.pop("code")
    path.write_text(json.dumps({**old, "dirty": True}))
    assert docs.stale_records(tmp_path) == [
        "earlier code: r (written before records kept the code they ran)",
        "uncommitted: r (measured on commit abc with changes)",
    ]


def test_the_code_of_a_command_a_benchmark_starts_as_a_process_joins_its_record(tmp_path, monkeypatch):
    """``timed_vit_ct`` runs the command as a user does, in its own process: the modules that process imported (here
    the report's) are part of the record's code."""
    monkeypatch.setattr(processes, "CHILD_CODE", set())
    with pytest.raises(RuntimeError, match="vit-ct report failed"):  # a run that fails still says what it ran
        processes.timed_vit_ct("report", str(tmp_path / "nothing"), "--manifest", str(tmp_path / "none.csv"))
    ran = {path.relative_to(records_module.ROOT).as_posix() for path in processes.CHILD_CODE}
    assert {"vit_ct/__main__.py", "vit_ct/report/report_command.py", "vit_ct/report/report_files.py"} <= ran
    code = code_fingerprint("python -m benchmarks.report_time")
    assert {"vit_ct/report/report_files.py", "vit_ct/report/evidence.py"} <= set(code)


def test_a_comment_edited_since_leaves_the_record_current_and_a_code_edit_does_not(tmp_path):
    """A record stays current through an edit of comments and docstrings (the file at the record's commit, read
    without them, is the same code); any change to what the file does, or a commit git does not have, lists it."""
    root = tmp_path / "checkout"
    (root / "configs").mkdir(parents=True)
    (root / "probe.py").write_text("x = 1  # ten\n")
    (root / "configs" / "x.yaml").write_text("a: 1  # ten\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=root, check=True)
    subprocess.run([*git, "add", "."], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "m"], cwd=root, check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    record = {"commit": commit, "code": {name: records_module._digest(root / name)
                                         for name in ("probe.py", "configs/x.yaml")}}  # fmt: skip
    (root / "probe.py").write_text('"""A docstring."""\n# a note\nx = 1  # eleven\n\n')
    (root / "configs" / "x.yaml").write_text("# a note\na: 1\n")
    assert docs.changed_code(record, root=root) == []
    assert docs.changed_code({**record, "commit": "0" * 40}, root=root) == ["configs/x.yaml", "probe.py"]
    (root / "probe.py").write_text("x = 2  # eleven\n")
    (root / "configs" / "x.yaml").write_text("a: 2\n")
    assert docs.changed_code(record, root=root) == ["configs/x.yaml", "probe.py"]


def test_the_projects_records_refuse_a_tree_with_uncommitted_changes():
    before = sorted(RECORDS.glob("*.json"))
    with pytest.raises(ValueError, match=r"record never: the checkout had uncommitted changes .* commit, then measure"):
        write_record("never", {"x": 1}, command="python x.py", git={"commit": "abc", "dirty": True})
    assert sorted(RECORDS.glob("*.json")) == before


def test_the_readme_stays_short_enough_to_follow():
    """At most 300 lines: the overview, the two commands, the own-data path and the maps; the rest lives in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move detail into docs/"


def test_a_table_from_a_stale_record_says_so_under_it(tmp_path):
    """The line under a table says "Measured with earlier code" exactly while a file its record ran differs, and for a
    record that predates keeping its code; nothing for a current one."""
    code = tmp_path / "probe.py"
    code.write_text("x = 1\n")
    record = {"command": "python -m benchmarks.probe", "seconds": 1.0, "date": "2026-12-06T00:00:00",
              "commit": "abc1234", "dirty": False, "machine": {"cpu": "CPU", "cpus_usable": 2, "native_bf16": False,
              "torch": "2", "load_average_1min": 0.1}}  # fmt: skip
    current = {**record, "code": {"probe.py": records_module._digest(code)}}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(records_module, "ROOT", tmp_path)
        patch.setattr(records_module.changed_code, "__defaults__", (tmp_path,))
        assert "earlier code" not in docs.measured(current)
        code.write_text("x = 2\n")
        assert "**Measured with earlier code**: files it ran have changed" in docs.measured(current)
    assert "predates keeping the code" in docs.measured(record)


def test_the_deletion_row_says_when_it_scored_another_run_than_the_demos(tmp_path):
    """The targets table's deletion row is the README demo's only where the faithfulness record scored a checkpoint of
    that run, at its commit; otherwise the row itself says whose checkpoint it was."""
    for name in ("demo", "faithfulness"):
        shutil.copy(RECORDS / f"{name}.json", tmp_path)
    demo = json.loads((tmp_path / "demo.json").read_text())
    run_id = demo["notes"]["summary"]["run_dir"].rstrip("/").split("/")[-1]
    faithfulness = json.loads((tmp_path / "faithfulness.json").read_text())
    for checkpoint, commit, said in [(f"runs/vit-ct/{run_id}/checkpoints/final.ckpt", demo["commit"], False),
                                     ("runs/vit-ct/other/checkpoints/final.ckpt", demo["commit"], True),
                                     (f"runs/vit-ct/{run_id}/checkpoints/final.ckpt", "0" * 40, True)]:  # fmt: skip
        record = {**faithfulness, "command": f"python -m benchmarks.faithfulness --ckpt {checkpoint}", "commit": commit}
        (tmp_path / "faithfulness.json").write_text(json.dumps(record))
        row = docs.demo_targets_block(docs.Records(tmp_path)).splitlines()[-1]
        assert row.startswith("| deletion AUC") and ("not this run" in row) == said, (checkpoint, commit)
