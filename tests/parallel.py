"""Running the suite on pytest-xdist workers: the default worker count and the tests that run alone.

The suite mostly waits (real processes, real timers, a real PostgreSQL and Chromium): a serial
run on 2 quiet cores held a load average of about 0.4. ``pytest -n 2`` runs it on two xdist
workers, each taking whole test files (:func:`default_to_workers`). ``pytest`` with no paths
named (the README's command, CI's) runs on :data:`DEFAULT_WORKERS` workers: 2. On 2 quiet cores the whole
suite took 237.8 s this way against 414-428 s serially (2026-12-06, issue #25: 2,365 passed; the serial runs
were clean-clone `.ci/run`s). Under heavy load from other sessions (load average 8-10) both ran 2-4x slower and
a few timing-sensitive tests failed with two workers that passed serially (test_security's flood got fewer than
its burst of answers). Naming files or directories keeps a run serial, as do ``-n 0`` and
``-p no:xdist``. Without pytest-xdist installed (it comes with the ``test`` extra) everything
runs serially.

Each worker is a pytest process of its own: its session fixtures (the PostgreSQL server, the
shared Chromium, temp dirs) are its own; child processes' bytecode is shared (tests/conftest.py).
A module's module-scoped fixture (tests/integration/test_bench_smoke.py's benches,
tests/unit/test_architecture.py's parsed tree) is set up once: the module runs on one worker.

A test marked ``solo`` (``pytestmark = pytest.mark.solo`` for a module) runs with no other test
beside it: it waits for the other workers' current tests to end, and they start none until it
is done: for a test whose figures measure the machine (tests/e2e/test_dashboard_load.py's
frame gaps). Workers share a readers-writer lock in files: every test holds the
room shared, a solo test holds it exclusively. A solo test first takes the gate (which every
test passes through on its way in) and holds it until it has the room, so a stream of ordinary
tests on the other workers cannot starve it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

DEFAULT_WORKERS = 2  # see the module's docstring
SOLO_MARK = "solo"


def default_to_workers(config: pytest.Config, workers: int = DEFAULT_WORKERS) -> None:
    """``-n workers`` for a run naming no paths (xdist installed, no ``-n``; 0: serial); whole files to each worker.

    ``--dist loadfile`` (also for an explicit ``-n`` without ``--dist``): a module's tests go to one
    worker, so a module-scoped fixture is set up once, and in collection order
    (``--no-loadscope-reorder``), so the long end-to-end files start first and the many short unit
    files fill the end. (``--dist loadgroup`` would group finer, but pytest-xdist 3.8 cannot apply
    its groups under pytest 9.2: it renames a test by a node attribute pytest no longer reads.)
    """
    if not config.pluginmanager.hasplugin("xdist") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    option = config.option
    if option.usepdb or option.collectonly:
        return
    if option.numprocesses is None and not option.tx:
        if config.args_source is pytest.Config.ArgsSource.ARGS or not workers:
            return  # files or directories named: serial unless -n says otherwise
        option.numprocesses = workers
    if option.dist == "no" and not option.distload:
        option.dist = "loadfile"
        option.loadscopereorder = False


class MachineShare:
    """The readers-writer lock the workers of one run share (flock on two files in one directory)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._gate: IO[bytes] = open(directory / "gate", "ab")  # held open for the session
        self._room: IO[bytes] = open(directory / "room", "ab")  # held open for the session

    @contextlib.contextmanager
    def held(self, *, alone: bool) -> Iterator[None]:
        """The room held shared (``alone``: exclusively) for the block."""
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._room, fcntl.LOCK_UN)

    def close(self) -> None:
        self._gate.close()
        self._room.close()


def run_temp(config: pytest.Config) -> Path | None:
    """On an xdist worker, the run's temp dir, which all its workers share (None elsewhere).

    xdist hands each worker ``--basetemp RUN/popen-gwN``; pytest keeps the last three RUN dirs.
    """
    if not os.environ.get("PYTEST_XDIST_WORKER") or not config.option.basetemp:
        return None
    return Path(config.option.basetemp).parent


def worker_share(config: pytest.Config) -> MachineShare | None:
    """This xdist worker's handle on its run's lock (None outside xdist)."""
    shared = run_temp(config)
    return None if shared is None else MachineShare(shared / "machine-share")
