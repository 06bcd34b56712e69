"""``notebooks/attention_review.ipynb``: committed clean, calls only the package, and runs headless with papermill on
a checkpoint trained by the real ``vit-ct fit``, exporting its figures and CSVs and rendering to HTML."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from conftest import TINY_MODEL_ARGS, run_vit_ct, tiny_data_args
from PIL import Image

from vit_ct import review
from vit_ct.review import figures as review_figures
from vit_ct.review import notebook as review_notebook

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "attention_review.ipynb"
PARAMETERS = {"ckpt_path", "manifest", "split", "output_dir", "n_cases", "window", "batch_size", "flagged"}
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
    assert str(out / "attention_review.ipynb") in capsys.readouterr().out
    assert review_figures.HEADLESS_ENV not in os.environ  # restored

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


def test_a_cell_past_its_timeout_stops_the_run_and_the_cells_before_it_are_kept(tmp_path, monkeypatch, capsys):
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

    def stuck(*args, **kwargs):
        raise CellTimeoutError("A cell timed out while it was being executed, after 3 seconds.")

    monkeypatch.setattr(review_notebook, "execute_notebook", stuck)
    with pytest.raises(SystemExit, match="ran longer than --cell_timeout 3 s.*cells before it are in"):
        review_notebook.main(["--output_dir", "out", "--cell_timeout", "3"])
