"""vit-ct's progress bars: rich's own in a terminal; inside a Jupyter kernel no refresh thread (ipykernel >= 7 loses
a thread's widget output), redrawn by the advancing thread at most every KERNEL_REFRESH_S; none in a headless kernel."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

from vit_ct import progress
from vit_ct.review.notebook import _this_python_kernel


def _refreshes(monkeypatch) -> list[int]:
    calls = []
    monkeypatch.setattr(progress.rich.progress.Progress, "refresh", lambda self: calls.append(1))
    return calls


def test_outside_a_kernel_it_is_richs_progress_with_its_refresh_thread():
    assert not progress.in_jupyter_kernel()  # pytest runs no kernel
    with progress.Progress() as bar:
        assert bar.live.auto_refresh and bar.live._refresh_thread is not None


def test_in_a_kernel_the_advancing_thread_redraws_at_most_every_half_second(monkeypatch):
    monkeypatch.setattr(progress, "in_jupyter_kernel", lambda: True)
    monkeypatch.delenv(progress.HEADLESS_ENV, raising=False)
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    calls = _refreshes(monkeypatch)
    with progress.Progress() as bar:
        assert not bar.live.auto_refresh and bar.live._refresh_thread is None  # no thread of its own
        task = bar.add_task("work", total=40)
        before = len(calls)
        for i in range(40):  # 40 advances 1/8 s apart: 5 s, half through advance, half through update
            now[0] = 100.0 + 0.125 * (i + 1)
            bar.advance(task) if i % 2 else bar.update(task, advance=1)
        assert bar.tasks[0].completed == 40
        drawn = len(calls) - before
    assert drawn == 10  # a redraw per 0.5 s, by the advancing thread
    assert len(calls) == before + drawn + 1  # and the final counts when it stops


def test_track_yields_everything_and_a_headless_kernel_draws_nothing(monkeypatch):
    monkeypatch.setattr(progress, "in_jupyter_kernel", lambda: True)
    monkeypatch.setenv(progress.HEADLESS_ENV, "1")
    assert progress.Progress().disable  # a headless kernel: nobody watches a bar
    assert list(progress.track(range(7), "work")) == list(range(7))
    monkeypatch.setenv(progress.HEADLESS_ENV, "0")
    assert not progress.Progress().disable
    assert list(progress.track(iter(range(3)), "work", total=3)) == [0, 1, 2]


@pytest.mark.slow
def test_a_real_kernel_is_recognised_and_its_bar_has_no_refresh_thread():
    cell = "\n".join([
        "from vit_ct import progress",
        "with progress.Progress() as bar:",
        "    seen = progress.in_jupyter_kernel(), bar.live._refresh_thread is None",
        "print(*seen)",
        "print(sum(progress.track(range(100), 'work')))",
    ])  # fmt: skip
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    with _this_python_kernel() as kernel:
        NotebookClient(nb, timeout=120, kernel_name=kernel).execute()
    text = "".join(o.get("text", "") for o in nb.cells[0].outputs if o.output_type == "stream")
    assert text.split() == ["True", "True", "4950"]


class _Loss:
    """A logged loss that counts how often its value is read (each read is a host wait on a GPU)."""

    def __init__(self) -> None:
        self.reads = 0

    def __float__(self) -> float:
        self.reads += 1
        return 0.5


def test_the_fits_bar_reads_the_loss_at_the_logging_interval_only():
    from types import SimpleNamespace

    from vit_ct.run.epoch_progress import LoggedLossBar

    loss, bar = _Loss(), LoggedLossBar()
    trainer = SimpleNamespace(training=True, global_step=0, log_every_n_steps=10, loggers=[], progress_bar_metrics={},
                              callback_metrics={"train/loss": loss})  # fmt: skip
    shown = []
    for step in range(25):
        trainer.global_step = step
        for _ in range(3):  # the bar refreshes several times a step
            shown.append(bar.get_metrics(trainer, None)["train/loss"])
    assert shown == [0.5] * 75
    assert loss.reads == 3 * 3  # steps 0, 10 and 20, at each refresh of theirs; no other step reads the value
    trainer.training = False  # validation: the bar shows validation's own figures
    assert "train/loss" not in bar.get_metrics(trainer, None)
