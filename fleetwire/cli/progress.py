"""Progress bars for the CLI's transfers (``fleetwire submit --input``, ``fleetwire output``).

A bar appears on standard error for each input or output of at least :data:`MIN_BYTES`, only
when standard error is a terminal and ``--json`` was not given: a script or a pipe sees
nothing new. The bars follow the direct path's transfer threads
(:attr:`fleetwire.direct.DirectTransport.progress`; rich's progress is thread-safe); bytes
carried by the relay show no bar.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # rich is imported only when bars are drawn (a command's start-up does not pay for it)
    from rich.progress import Progress, TaskID

    from fleetwire.direct import DirectTransport

__all__ = ["MIN_BYTES", "Bars", "transfer_progress"]

MIN_BYTES = 4 << 20  # smaller transfers finish before a bar is worth drawing


class Bars:
    """``progress(name, done, size)`` for a transport: one bar per name, made on its first report."""

    def __init__(self, progress: Progress, verb: str) -> None:
        self._progress = progress
        self._verb = verb
        self._tasks: dict[str, TaskID] = {}
        self._lock = threading.Lock()

    def __call__(self, name: str, done: int, size: int) -> None:
        if size < MIN_BYTES:
            return
        with self._lock:
            task = self._tasks.get(name)
            if task is None:
                task = self._tasks[name] = self._progress.add_task(f"{self._verb} {name}", total=size)
        self._progress.update(task, completed=done, total=size)


def _direct(transport: Any) -> DirectTransport | None:
    """The direct transport inside the client's transport (itself, or an ``AutoTransport``'s ``direct``)."""
    from fleetwire.direct import DirectTransport

    if isinstance(transport, DirectTransport):
        return transport
    inner = getattr(transport, "direct", None)
    return inner if isinstance(inner, DirectTransport) else None


@contextlib.asynccontextmanager
async def transfer_progress(client: Any, verb: str, *, as_json: bool) -> AsyncIterator[None]:
    """Show bars for the client's direct transfers while the block runs (when stderr is a terminal)."""
    direct = _direct(client.transport)
    if as_json or direct is None or not sys.stderr.isatty():
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        direct.progress = Bars(progress, verb)
        try:
            yield
        finally:
            direct.progress = None
