"""A call in a given thread pool, as :func:`asyncio.to_thread` makes it in the loop's default one.

The coordinator's server loads its store and closes it in a thread (coordinator/io/frontdoor/server.py); a cluster
host gives its shards' cores threads of their own for that, and for its stores' opens and closes
(coordinator/io/cluster/teardown.py, "Off the loop"), so that more shards than the default executor's threads do not
start or stop in waves.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

__all__ = ["in_thread"]

_T = TypeVar("_T")


def in_thread(
    threads: Executor | None, call: Callable[[], _T], loop: asyncio.AbstractEventLoop | None = None
) -> asyncio.Future[_T]:
    """``call()`` in ``threads`` (None: the loop's default executor), in a copy of this context, as
    :func:`asyncio.to_thread` runs it. ``threads`` already shut down (a cluster host's stop ended while a store was
    still being made): the loop's default executor instead."""
    loop = loop or asyncio.get_running_loop()
    run = functools.partial(contextvars.copy_context().run, call)
    try:
        return loop.run_in_executor(threads, run)
    except RuntimeError:  # "cannot schedule new futures after shutdown"
        return loop.run_in_executor(None, run)
