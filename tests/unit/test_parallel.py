"""The suite's xdist set-up (tests/parallel.py): a solo test runs alone, and no stream of others starves it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.parallel import MachineShare, default_to_workers

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 10.0


class _Holder:
    """One worker's handle held in a thread of its own until :meth:`release`."""

    def __init__(self, directory: Path, *, alone: bool) -> None:
        self.share = MachineShare(directory)  # a file description of its own: another worker to flock
        self.alone = alone
        self.inside = threading.Event()
        self._leave = threading.Event()
        self._thread = threading.Thread(target=self._hold, daemon=True)
        self._thread.start()

    def _hold(self) -> None:
        with self.share.held(alone=self.alone):
            self.inside.set()
            self._leave.wait(WAIT_S)

    def release(self) -> None:
        self._leave.set()
        self._thread.join(WAIT_S)
        self.share.close()


@contextlib.contextmanager
def _holders(tmp_path: Path) -> Iterator[list[_Holder]]:
    held: list[_Holder] = []
    try:
        yield held
    finally:
        for holder in held:
            holder.release()


def test_solo_waits_for_the_running_test_and_later_tests_wait_for_it(tmp_path: Path) -> None:
    """A solo test waits for the test in progress; a test arriving while it waits starts only after it ended."""
    with _holders(tmp_path) as held:
        running = _Holder(tmp_path, alone=False)
        held.append(running)
        assert running.inside.wait(WAIT_S)
        solo = _Holder(tmp_path, alone=True)
        held.append(solo)
        assert not solo.inside.wait(0.2)  # the running test still holds the room
        later = _Holder(tmp_path, alone=False)
        held.append(later)
        assert not later.inside.wait(0.2)  # the solo test holds the gate: no new test starts (no starvation)
        running.release()
        assert solo.inside.wait(WAIT_S)
        assert not later.inside.wait(0.2)
        solo.release()
        assert later.inside.wait(WAIT_S)


def test_ordinary_tests_run_side_by_side(tmp_path: Path) -> None:
    """Two tests not marked solo hold the room together."""
    with _holders(tmp_path) as held:
        held.extend(_Holder(tmp_path, alone=False) for _ in range(2))
        assert all(holder.inside.wait(WAIT_S) for holder in held)


@pytest.mark.parametrize(
    ("argv", "default", "workers"),
    [([], 2, 2), ([], 0, None), (["tests/unit"], 2, None), (["-n", "3"], 2, 3), (["-n", "3"], 0, 3),
     (["-n", "0"], 2, 0), (["-p", "no:xdist"], 2, None)],
)  # fmt: skip
def test_a_run_naming_no_paths_gets_the_default_workers_each_taking_whole_files(
    argv: list[str], default: int, workers: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pytest` alone gets -n DEFAULT (0: serial); named paths, an explicit -n or xdist off keep theirs; workers take
    whole files (also for an explicit -n)."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # this test may itself run on a worker
    monkeypatch.chdir(ROOT)  # the repository's pyproject.toml: its testpaths
    config = pytest.Config.fromdictargs({}, argv)
    default_to_workers(config, default)
    assert getattr(config.option, "numprocesses", None) == workers
    if workers:
        assert (config.option.dist, config.option.loadscopereorder) == ("loadfile", False)
