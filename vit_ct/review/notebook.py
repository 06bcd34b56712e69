"""``python -m vit_ct.review``: run ``notebooks/attention_review.ipynb`` headless with papermill, in a kernel of
this interpreter, writing the executed notebook beside the figures and CSVs it exports."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from vit_ct.review.figures import HEADLESS_ENV
from vit_ct.review.loading import project_path

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "attention_review.ipynb"


@contextlib.contextmanager
def _this_python_kernel() -> Iterator[str]:
    """A ``python3`` kernelspec that runs this interpreter, first on ``JUPYTER_PATH`` while inside: another
    ``python3`` kernel (user-wide, another environment) never runs the notebook."""
    with tempfile.TemporaryDirectory(prefix="vit-ct-kernel-") as folder:
        spec = Path(folder) / "kernels" / "python3"
        spec.mkdir(parents=True)
        argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "Python 3", "language": "python"}))
        previous = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [folder, previous]))
        try:
            yield "python3"
        finally:
            if previous is None:
                os.environ.pop("JUPYTER_PATH", None)
            else:
                os.environ["JUPYTER_PATH"] = previous


def execute_notebook(
    output_dir: str | os.PathLike,
    parameters: dict | None = None,
    *,
    notebook=NOTEBOOK,
    cell_timeout: float | None = None,
) -> Path:
    """Run the review notebook headless with papermill in the working folder; the executed notebook goes to
    ``output_dir/attention_review.ipynb`` beside the figures and CSVs it exports (saved after every cell). Returns
    its path. ``cell_timeout``: seconds one cell may run before the run stops with an error (default: no limit)."""
    import papermill

    output_dir = project_path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    executed = output_dir / Path(notebook).name
    parameters = {**(parameters or {}), "output_dir": str(output_dir), "interactive": False}
    previous = os.environ.get(HEADLESS_ENV)
    os.environ[HEADLESS_ENV] = "1"
    try:
        with _this_python_kernel() as kernel:
            papermill.execute_notebook(
                str(notebook),
                str(executed),
                parameters=parameters,
                kernel_name=kernel,
                cwd=os.getcwd(),
                progress_bar=False,
                execution_timeout=cell_timeout,
            )
    finally:
        if previous is None:
            os.environ.pop(HEADLESS_ENV, None)
        else:
            os.environ[HEADLESS_ENV] = previous
    return executed


def main(argv: list[str] | None = None) -> None:
    """``python -m vit_ct.review``: run the review notebook headless and print where its results are."""
    parser = argparse.ArgumentParser(prog="python -m vit_ct.review", description=main.__doc__)
    parser.add_argument("--ckpt_path", help="checkpoint (default: best of runs/latest/summary.json)")
    parser.add_argument("--manifest", help="manifest CSV (default: data/synthetic/manifest.csv)")
    parser.add_argument("--split", help="train, val or test (default: test)")
    parser.add_argument("--output_dir", default="outputs/review", help="figures, CSVs, executed notebook")
    parser.add_argument("--n_cases", type=int, help="cases per gallery group (default: 4)")
    parser.add_argument(
        "--map_shifts", type=int, help="rollout over this many shifted grids per axis (default: predict's; 1: one pass)"
    )
    parser.add_argument(
        "--map_pixels", action="store_true", default=None, help="rollout spread over the pixels (--model.map_pixels)"
    )
    parser.add_argument("--cell_timeout", type=float, help="seconds a cell may run, then stop with an error (no limit)")
    args = vars(parser.parse_args(argv))
    output_dir, cell_timeout = args.pop("output_dir"), args.pop("cell_timeout")
    parameters = {k: v for k, v in args.items() if v is not None}
    from nbclient.exceptions import CellTimeoutError, DeadKernelError  # papermill's executor

    try:
        executed = execute_notebook(output_dir, parameters, cell_timeout=cell_timeout)
    except (CellTimeoutError, DeadKernelError) as error:  # past --cell_timeout nbclient stops the kernel
        limit = f"longer than --cell_timeout {cell_timeout:g} s" if cell_timeout else "until its kernel died"
        done = project_path(output_dir) / NOTEBOOK.name
        raise SystemExit(f"error: a review cell ran {limit} ({type(error).__name__}: {error}); the cells before it "
                         f"are in {done}") from None  # fmt: skip
    print(f"review written to {executed.parent} (gallery.png, summary.png, case.png, flagged.csv, review.csv)")
    print(f"open it: {Path(sys.executable).with_name('jupyter')} lab {executed}")
