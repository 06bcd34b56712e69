"""Progress bars (rich) that are safe inside a Jupyter kernel.

In a terminal rich redraws a bar from a refresh thread of its own. Inside a Jupyter kernel it draws into an
ipywidgets ``Output`` instead, and since ipykernel 7 output sent from a thread other than the cell's loses its place
(rich#3868, ipywidgets#4020): the bar stays empty, and a papermill run of the review notebook was once left waiting
forever on a cell whose kernel had gone idle. So inside a kernel the bar is redrawn by the thread that advances it,
at most :data:`KERNEL_REFRESH_S` apart (and once more at the end); headless kernels (papermill, ``python -m
vit_ct.review``, which set ``VIT_CT_HEADLESS=1``) draw no bar at all, since nobody watches it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

import rich.progress

HEADLESS_ENV = "VIT_CT_HEADLESS"  # "1": no widgets, no progress bars in this kernel (set by `python -m vit_ct.review`)
KERNEL_REFRESH_S = 0.5

T = TypeVar("T")


def in_jupyter_kernel() -> bool:
    """True inside an IPython kernel (JupyterLab, papermill, nbclient), where rich draws into widgets."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def headless_flag() -> bool | None:
    """``VIT_CT_HEADLESS`` read as a choice: True (1/true/yes), False (0/false/no) or None (unset)."""
    flag = os.environ.get(HEADLESS_ENV, "").strip().lower()
    return True if flag in ("1", "true", "yes") else False if flag in ("0", "false", "no") else None


class Progress(rich.progress.Progress):
    """:class:`rich.progress.Progress`, redrawn by the advancing thread inside a Jupyter kernel (see the module)."""

    def __init__(self, *columns, disable: bool = False, **kwargs) -> None:
        self._kernel = in_jupyter_kernel()
        if self._kernel:
            kwargs["auto_refresh"] = False
            disable = disable or headless_flag() is True
        super().__init__(*columns, disable=disable, **kwargs)
        self._drawn = 0.0

    def advance(self, task_id: rich.progress.TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        if self._kernel:
            self.refresh()

    def update(self, task_id: rich.progress.TaskID, **changes) -> None:
        super().update(task_id, **changes)
        if self._kernel:
            self.refresh()

    def refresh(self) -> None:
        if self._kernel and time.monotonic() - self._drawn < KERNEL_REFRESH_S:
            return
        self._drawn = time.monotonic()
        super().refresh()

    def stop(self) -> None:
        if self._kernel and not self.disable:
            self._drawn = 0.0
            self.refresh()  # the final counts
        super().stop()


def track(
    sequence: Iterable[T],
    description: str = "Working...",
    *,
    total: float | None = None,
    transient: bool = False,
    disable: bool = False,
) -> Iterator[T]:
    """:func:`rich.progress.track` through :class:`Progress`."""
    with Progress(*Progress.get_default_columns(), transient=transient, disable=disable) as bar:
        yield from bar.track(sequence, total=total, description=description)
