"""``python -m vit_ct.review``: run ``notebooks/attention_review.ipynb`` headless with papermill, in a kernel of
this interpreter, writing the executed notebook beside the figures and CSVs it exports."""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from vit_ct.files import file_times, record_output, recorded_files
from vit_ct.inspection.loading import project_path
from vit_ct.review.figures import HEADLESS_ENV

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "attention_review.ipynb"
REVIEW = "review"  # the command, as the review folder's output record names it


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


def _local_kernel_manager() -> type:
    """nbclient's kernel manager, reaching the kernel over local sockets (IPC) instead of TCP: nothing listens on the
    network, and the kernel has no reason to warn that its traffic is unencrypted."""
    from jupyter_client.manager import AsyncKernelManager

    class LocalKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs) -> None:
            super().__init__(transport="ipc", **kwargs)

    return LocalKernelManager


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
                kernel_manager_class=_local_kernel_manager(),
            )
    finally:
        if previous is None:
            os.environ.pop(HEADLESS_ENV, None)
        else:
            os.environ[HEADLESS_ENV] = previous
    return executed


HEADLESS_ONLY = ("interactive", "output_dir")  # set by the command itself (static figures; --output_dir below)
INPUTS = "review_inputs.json"  # in the review folder: what it reviewed; another review never replaces it unasked


def notebook_parameters(notebook: str | os.PathLike = NOTEBOOK) -> list[tuple[str, object, str]]:
    """The notebook's parameters as its ``parameters`` cell states them: (name, default, the comment after it). The
    headless command's options are made from them, so the two never drift apart."""
    cells = json.loads(Path(notebook).read_text())["cells"]
    (source,) = ["".join(c["source"]) for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    parameters = []
    for line in source.splitlines():
        code, _, comment = line.partition("#")
        name, sep, value = code.partition("=")
        if sep and name.strip().isidentifier():
            parameters.append((name.strip(), ast.literal_eval(value.strip()), comment.strip()))
    return parameters


def _value(text: str):
    """An option's value as the notebook's Python reads it: a literal (``None``, ``12``, ``[40, 80]``), else text."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def review_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vit_ct.review",
        description="Run notebooks/attention_review.ipynb headless (static figures) and print where its results are."
        " Every parameter of the notebook is an option; values are read as Python literals (None, 12, [40, 80]),"
        " else as text.",
    )
    for name, default, comment in notebook_parameters():
        if name in HEADLESS_ONLY:
            continue
        described = f"{comment or name} (default {default!r})"
        if isinstance(default, bool):  # a switch: --map_pixels / --no-map_pixels
            parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=described)  # fmt: skip
        else:  # only the options given reach the notebook, so None given stays None
            parser.add_argument(f"--{name}", type=_value, default=argparse.SUPPRESS, metavar=name.upper(),
                                help=described)  # fmt: skip
    parser.add_argument("--output_dir", default="outputs/review", help="figures, CSVs, the executed notebook")
    parser.add_argument("--cell_timeout", type=float, help="seconds a cell may run, then stop with an error (no limit)")
    parser.add_argument("--overwrite", action="store_true", help="replace a review of other inputs in --output_dir"
                        " (its figures and tables; the reviewers' verdicts are kept)")  # fmt: skip
    return parser


def review_inputs(parameters: dict) -> dict:
    """What a review reads, resolved as the notebook resolves it: the checkpoint, the manifest and split, and the
    predict output whose scans it shows."""
    from vit_ct.inspection.loading import resolve_checkpoint
    from vit_ct.model.weights_input import read_checkpoint

    defaults = {name: default for name, default, _ in notebook_parameters()}
    given = {**defaults, **parameters}
    predict_output = given["predict_output"]
    checkpoint = resolve_checkpoint(given["ckpt_path"])
    read_checkpoint(checkpoint)  # a file that is no readable checkpoint is refused here, in one line, not in a cell
    return {
        "ckpt_path": str(checkpoint),
        "manifest": str(project_path(given["manifest"])),
        "split": given["split"],
        "predict_output": str(project_path(predict_output)) if predict_output else None,
    }


def check_review_dir(output_dir: Path, inputs: dict, *, overwrite: bool) -> None:
    """Refuse an ``output_dir`` holding a review of other inputs (or files of no review) unless ``overwrite``; with it,
    remove the files that review wrote (its record), never the reviewers' verdicts or anything else."""
    if not output_dir.is_dir() or not any(output_dir.iterdir()):
        return
    try:
        earlier = json.loads((output_dir / INPUTS).read_text())
    except (OSError, ValueError):
        earlier = None
    if earlier == inputs:
        return  # the same review again: its files are rewritten
    if not overwrite:
        what = (f"a review of {earlier.get('ckpt_path')} on {earlier.get('manifest')}" if isinstance(earlier, dict)
                else "files of no review it can tell")  # fmt: skip
        raise SystemExit(f"error: --output_dir {output_dir} holds {what}; this one reviews {inputs['ckpt_path']} on"
                         f" {inputs['manifest']}. Choose another --output_dir, or pass --overwrite to replace it (its"
                         " figures and tables; the reviewers' verdicts are kept)")  # fmt: skip
    for name in recorded_files(output_dir, REVIEW):  # verdicts are written after a run: never in its record
        (output_dir / name).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m vit_ct.review``: run the review notebook headless and print where its results are."""
    args = vars(review_parser().parse_args(argv))
    output_dir, cell_timeout = project_path(args.pop("output_dir")), args.pop("cell_timeout")
    overwrite = args.pop("overwrite")
    parameters = args  # the notebook's, as given on the command line
    from nbclient.exceptions import CellTimeoutError, DeadKernelError  # papermill's executor

    try:
        inputs = review_inputs(parameters)
    except ValueError as error:  # no checkpoint, or none vit-ct reads: the message names it and says what to do
        raise SystemExit(f"error: {error}") from None
    check_review_dir(output_dir, inputs, overwrite=overwrite)
    before = file_times(output_dir)  # the reviewers' verdicts are there too: the record lists only this run's files
    scans = f"; scans of {inputs['predict_output']}" if inputs["predict_output"] else ""
    print(f"reviewing {inputs['ckpt_path']} on {inputs['manifest']} (split {inputs['split']}){scans}")
    try:
        executed = execute_notebook(output_dir, parameters, cell_timeout=cell_timeout)
    except (CellTimeoutError, DeadKernelError) as error:  # past --cell_timeout nbclient stops the kernel
        limit = f"longer than --cell_timeout {cell_timeout:g} s" if cell_timeout else "until its kernel died"
        done = project_path(output_dir) / NOTEBOOK.name
        raise SystemExit(f"error: a review cell ran {limit} ({type(error).__name__}: {error}); the cells before it "
                         f"are in {done}") from None  # fmt: skip
    (output_dir / INPUTS).write_text(json.dumps(inputs, indent=1) + "\n")
    record_output(output_dir, REVIEW, since=before)
    print(f"review written to {executed.parent} (gallery.png, summary.png, case.png, flagged.csv, review.csv)")
    print(f"open it: {Path(sys.executable).with_name('jupyter')} lab {executed}")
