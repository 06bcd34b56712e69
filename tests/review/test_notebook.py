"""``notebooks/attention_review.ipynb``: committed clean, calls only the package, and runs headless with papermill on
a checkpoint trained by the real ``vit-ct fit``, exporting its figures and CSVs and rendering to HTML; its report cell
shows the ``vit-ct report`` of the predict output it opens."""

from __future__ import annotations

import ast
import base64
import json
import os
from pathlib import Path

import nbformat
import numpy as np
import pandas as pd
import pytest
from conftest import TINY_MODEL_ARGS, run_vit_ct, tiny_checkpoint_file, tiny_data_args
from PIL import Image
from predict_outputs import fake_predict_output
from sklearn.metrics import roc_auc_score

from vit_ct import review
from vit_ct.cli import main
from vit_ct.files import record_output
from vit_ct.report import report_files
from vit_ct.review import figures as review_figures
from vit_ct.review import notebook as review_notebook
from vit_ct.review import report_view

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "attention_review.ipynb"
PARAMETERS = {"ckpt_path", "manifest", "split", "output_dir", "n_cases", "window", "batch_size", "flagged"}
PARAMETERS |= {"predict_output", "report_dir"}  # the predict output the scan view and the report cell open
FIGURES = ("summary", "gallery", "case", "heads", "blocks", "windows")


def code_of(cell) -> str:
    """A code cell's Python, IPython magics left out."""
    return "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith("%"))


def tagged(nb, tag: str):
    (cell,) = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    return cell


def test_committed_notebook_is_clean_and_calls_only_the_package():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert review_notebook.NOTEBOOK == NOTEBOOK
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code), "commit it without outputs"
    assert nb.metadata["kernelspec"]["name"] == "python3"

    parameters = ast.parse(code_of(tagged(nb, "parameters")))
    assigned = {target.id for node in parameters.body for target in node.targets}
    assert not PARAMETERS - assigned and "interactive" in assigned, PARAMETERS - assigned
    for cell in code:  # no logic of its own: no functions, classes or lambdas; imports from vit_ct and IPython
        tree = ast.parse(code_of(cell))
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef | ast.Lambda)]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.module.split(".")[0] in ("vit_ct", "IPython"), node.module
            assert not isinstance(node, ast.Import), "import from vit_ct"


@pytest.mark.slow
def test_notebook_runs_headless_on_a_trained_checkpoint(synthetic_set, tmp_path, monkeypatch, capsys):
    from nbconvert import HTMLExporter

    demo = str(ROOT / "configs" / "demo.yaml")
    one_epoch = ["--trainer.max_epochs", "1", "--test_after_fit", "false"]
    run_vit_ct("fit", "--config", demo, *tiny_data_args(synthetic_set), *TINY_MODEL_ARGS, *one_epoch, cwd=tmp_path)
    summary = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())

    # As `python -m vit_ct.review` from the demo's folder: ckpt_path left to default to runs/latest's best.
    monkeypatch.chdir(tmp_path)
    review_notebook.main(["--manifest", str(synthetic_set), "--output_dir", "outputs/review", "--n_cases", "2"])
    out = tmp_path / "outputs" / "review"
    printed = capsys.readouterr().out
    assert str(out / "attention_review.ipynb") in printed
    # what it reviewed, said before it runs: the checkpoint the default chose, the manifest, the scans' folder
    assert f"reviewing {summary['best_checkpoint']} on {synthetic_set} (split test); scans of" in printed
    assert review_figures.HEADLESS_ENV not in os.environ  # restored
    # another split into the same folder: refused before any cell runs, the review as it was
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(SystemExit, match=r"holds a review of .* on .*manifest.csv.*--overwrite"):
        review_notebook.main(["--manifest", str(synthetic_set), "--output_dir", "outputs/review", "--split", "val"])
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before

    executed = nbformat.read(out / "attention_review.ipynb", as_version=4)
    outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    injected = next(c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", []))
    assert "interactive = False" in injected.source
    assert summary["best_checkpoint"] in "".join(o.get("text", "") for o in tagged(executed, "setup").outputs)
    for tag in ("gallery", "case", "browser"):  # figures, also where widgets would be shown interactively
        assert any("image/png" in o.get("data", {}) for o in tagged(executed, tag).outputs), tag

    for name in FIGURES:
        with Image.open(out / f"{name}.png") as png:
            assert png.format == "PNG" and min(png.size) > 100
    table = pd.read_csv(out / "review.csv")
    test_rows = pd.read_csv(synthetic_set).query("split == 'test'")
    assert list(table["image"]) == list(test_rows["image"]) and table["prob"].between(0, 1).all()
    flagged = pd.read_csv(out / "flagged.csv")  # default: the false negatives
    assert list(flagged["image"]) == list(review.gallery(table, "FN", None)["image"])
    assert (flagged["label"] == 1).all() and (flagged["prob"] <= 0.5).all()

    html, _ = HTMLExporter().from_notebook_node(executed)
    assert html.count("data:image/png;base64") >= len(FIGURES)


@pytest.mark.medium
def test_a_cell_past_its_timeout_stops_the_run_and_the_cells_before_it_are_kept(tmp_path, monkeypatch, capfd):
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("print('first cell done')"),
        nbformat.v4.new_code_cell("import time\ntime.sleep(60)"),
    ])  # fmt: skip
    notebook.cells[0].metadata["tags"] = ["parameters"]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, tmp_path / "slow.ipynb")
    monkeypatch.chdir(tmp_path)
    with pytest.raises((CellTimeoutError, DeadKernelError)):  # nbclient stops the kernel past the timeout
        review_notebook.execute_notebook(tmp_path / "out", notebook=tmp_path / "slow.ipynb", cell_timeout=3)
    executed = nbformat.read(tmp_path / "out" / "slow.ipynb", as_version=4)
    assert "first cell done" in "".join(o.get("text", "") for o in executed.cells[0].outputs)
    assert "over TCP" not in capfd.readouterr().err  # the kernel is reached over local sockets, not the network

    def stuck(*args, **kwargs):
        raise CellTimeoutError("A cell timed out while it was being executed, after 3 seconds.")

    monkeypatch.setattr(review_notebook, "execute_notebook", stuck)
    tiny_checkpoint_file(tmp_path / "model.ckpt")  # the command reads the checkpoint before any cell runs
    with pytest.raises(SystemExit, match="ran longer than --cell_timeout 3 s.*cells before it are in"):
        review_notebook.main(["--output_dir", "out2", "--cell_timeout", "3", "--ckpt_path", "model.ckpt"])


def test_every_notebook_parameter_is_an_option_of_the_headless_review(capsys):
    with pytest.raises(SystemExit):
        review_notebook.main(["--help"])
    shown = capsys.readouterr().out
    for name, _, _ in review_notebook.notebook_parameters():
        if name not in review_notebook.HEADLESS_ONLY:
            assert f"--{name}" in shown, name
    parsed = vars(review_notebook.review_parser().parse_args(["--split", "None", "--window", "[40, 80]",
                                                              "--map_pixels", "--reviewer", "dr/smith"]))  # fmt: skip
    assert parsed == {"split": None, "window": [40, 80], "map_pixels": True, "reviewer": "dr/smith",
                      "output_dir": "outputs/review", "cell_timeout": None, "overwrite": False}  # fmt: skip


def test_a_review_of_other_inputs_is_replaced_only_with_overwrite_and_verdicts_are_kept(tmp_path):
    out = tmp_path / "review"
    out.mkdir()
    (out / "gallery.png").write_bytes(b"the first review's figure")
    first = {"ckpt_path": "/a.ckpt", "manifest": "/m.csv", "split": "test", "predict_output": None}
    (out / review_notebook.INPUTS).write_text(json.dumps(first))
    record_output(out, review_notebook.REVIEW)
    (out / "verdicts-dr_smith.csv").write_text("a reviewer's verdicts, written after the run")
    (out / "notes.txt").write_text("the user's")
    review_notebook.check_review_dir(out, first, overwrite=False)  # the same review again: taken
    other = {**first, "ckpt_path": "/b.ckpt"}
    with pytest.raises(SystemExit, match=r"holds a review of /a.ckpt on /m.csv; this one reviews /b.ckpt"):
        review_notebook.check_review_dir(out, other, overwrite=False)
    review_notebook.check_review_dir(out, other, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "verdicts-dr_smith.csv"]


def report_cell(predict_output, report_dir=None) -> list:
    """The notebook's own report cell, run as the kernel runs it (``review`` and ``display`` from the setup cell);
    returns what it displayed."""
    shown = []
    namespace = {"review": review, "display": lambda *x: shown.extend(x), "predict_output": predict_output,
                 "report_dir": report_dir}  # fmt: skip
    exec(code_of(tagged(nbformat.read(NOTEBOOK, as_version=4), "report")), namespace)
    return shown


@pytest.mark.medium
def test_the_report_cell_shows_the_report_of_the_predict_output_it_opens(tmp_path, capsys):
    out, manifest = fake_predict_output(tmp_path)
    predictions = pd.read_csv(out / "predictions.csv")
    cnn = predictions[["image"]].assign(prob=np.random.default_rng(5).random(len(predictions)))
    cnn.to_csv(tmp_path / "cnn.csv", index=False)
    assert report_cell(str(out)) == []  # no report yet: the command that writes it, with the run's manifest
    assert capsys.readouterr().out.strip() == (
        f"no evidence report in {out / 'report'}: `vit-ct report {out} --manifest {manifest}` writes it"
    )
    main(
        [
            "report",
            str(out),
            "--manifest",
            str(manifest),
            "--bootstrap",
            "50",
            "--compare",
            f"cnn={tmp_path / 'cnn.csv'}",
        ]
    )
    record = json.loads((out / "report" / "report.json").read_text())

    headline, *images = report_cell(str(out))
    printed = capsys.readouterr().out
    assert str(out / "report" / "report.html") in printed and "48 slices" in printed  # patients 4..15 x 4: test
    test = predictions[predictions["image"].str[1:3].astype(int) >= 4]
    auroc = headline.loc[("slice", "auroc")]
    assert auroc["value"] == pytest.approx(roc_auc_score(test["label"], test["prob"]))
    assert [auroc["ci95_low"], auroc["ci95_high"], auroc["n"]] == [*record["slice"]["auroc"]["ci95"], len(test)]
    assert auroc["cnn"] == record["compare"]["cnn"]["slice"]["auroc"]["value"]
    pointing = record["maps"]["rollout"]["pointing"]
    assert headline.loc[("maps/rollout", "pointing"), "value"] == pointing["value"]
    assert headline.loc[("scan", "auroc"), "n"] == record["scan"]["auroc"]["n"]
    assert np.isnan(headline.loc[("maps/rollout", "pointing"), "cnn"])  # the CNN has no maps
    assert list(headline.index[:2]) == [("slice", "auroc"), ("slice", "average_precision")]
    figures = sorted((out / "report" / "figures").glob("*.png"))
    assert len(figures) == 5 and [image.data for image in images] == [png.read_bytes() for png in figures]

    elsewhere = tmp_path / "elsewhere"  # a report folder named by report_dir: shown whatever predict_output is
    main(["report", str(out), "--manifest", str(manifest), "--bootstrap", "20", "--output_dir", str(elsewhere)])
    headline, *images = report_cell(None, str(elsewhere))
    assert str(elsewhere / "report.html") in capsys.readouterr().out and len(images) == 5
    with pytest.raises(ValueError, match=f"report_dir {tmp_path}: no report.json there"):
        report_cell(str(out), str(tmp_path))
    report_cell(None)
    assert "`vit-ct report OUT --manifest M` writes OUT/report" in capsys.readouterr().out


def test_the_review_reads_the_report_files_by_the_reports_own_names():
    assert (report_view.REPORT_JSON, report_view.REPORT_HTML, report_view.FIGURES) == (
        report_files.REPORT_JSON, report_files.REPORT_HTML, report_files.FIGURES)  # fmt: skip


@pytest.mark.slow
def test_the_report_cell_draws_its_table_and_figures_in_a_kernel(tmp_path):
    """The parameters and report cells of the notebook, after the setup cell's imports, run by the headless runner
    (papermill, a real kernel): the table and each figure PNG are in the executed notebook's outputs."""
    out, manifest = fake_predict_output(tmp_path)
    main(["report", str(out), "--manifest", str(manifest), "--bootstrap", "20"])
    committed = nbformat.read(NOTEBOOK, as_version=4)
    imports = nbformat.v4.new_code_cell("from IPython.display import display\n\nfrom vit_ct import review")
    cells = [imports, tagged(committed, "parameters"), tagged(committed, "report")]
    nbformat.write(nbformat.v4.new_notebook(cells=cells, metadata=committed.metadata), tmp_path / "report.ipynb")

    executed = review_notebook.execute_notebook(tmp_path / "run", {"predict_output": str(out)},
                                                notebook=tmp_path / "report.ipynb")  # fmt: skip
    outputs = tagged(nbformat.read(executed, as_version=4), "report").outputs
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("slice" in o.get("data", {}).get("text/html", "") and "ci95_low" in o["data"]["text/html"]
               for o in outputs)  # fmt: skip
    shown = [base64.b64decode(o["data"]["image/png"]) for o in outputs if "image/png" in o.get("data", {})]
    assert shown == [png.read_bytes() for png in sorted((out / "report" / "figures").glob("*.png"))]
