"""The writer process's fatal paths never stall the event loop (coordinator/io/stores/writer_process.py, §R29).

A 5 ms timer on the loop records its lateness while the child dies, closes its pipe before its exit, or is stopped
and cannot be killed at once; the groups in flight each get the error once (none acknowledged that was not
committed, none left unanswered). Real children, real SQLite files. The bound (0.5 s) is generous: the waits these
tests found on the loop were 1 s (the exit status awaited) and 5 s (the end after SIGKILL awaited). It bounds the
timer's lateness with the loop's thread blocked (LagProbe.worst_blocked_s): not its waits for a CPU or the
collector's pauses, which a loaded machine's whole-suite run made 1.16 s.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import structlog

from coordinator.io.stores import writer_process
from coordinator.io.stores.integrity import StoreError
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from coordinator.records import Record
from tests.integration.test_store_writer_process import plan, ready_child
from tests.waiting import LagProbe, alive, until

pytestmark = pytest.mark.timeout(60)

LAG_BOUND_S = 0.5

# The child's own program, run in its place: on SIGUSR1 it closes its pipes (every descriptor but stderr) and
# lingers 3 s before it exits, as a child does whose exit takes long after its pipe closed.
LINGERING_CHILD = textwrap.dedent("""
    import os, runpy, signal, time
    def close_and_linger(signum, frame):
        os.closerange(0, 2)
        os.closerange(3, 4096)
        time.sleep(3)
        os._exit(0)
    signal.signal(signal.SIGUSR1, close_and_linger)
    runpy.run_module("coordinator.io.stores.writer_child", run_name="__main__", alter_sys=True)
""")


def stalled(probe: LagProbe) -> str:
    return f"the loop stalled {probe.worst_blocked_s:.2f} s blocked ({probe.worst_s:.2f} s late in all)"


class Groups:
    """Groups sent through the store's ``sender`` on the loop; ``answers[n]``: the answers group n got."""

    def __init__(self, store: SQLiteStore) -> None:
        self.store = store
        self.answers: list[list[BaseException | None]] = []
        self.changed = asyncio.Event()
        store.serve_on(asyncio.get_running_loop(), self.changed.set)

    def send(self, records: Sequence[Record]) -> None:
        answers: list[BaseException | None] = []
        self.answers.append(answers)

        def done(error: BaseException | None) -> None:
            answers.append(error)
            self.changed.set()

        self.store.send(records, done)

    async def all_answered(self) -> None:
        await until(lambda: all(self.answers), timeout_s=30)

    def committed(self) -> int:
        """The groups answered committed: the first ones, before every failed one, each answered once."""
        assert all(len(a) == 1 for a in self.answers), self.answers
        ok = [a[0] is None for a in self.answers]
        assert ok == sorted(ok, reverse=True), "a group acknowledged after one that failed"
        return sum(ok)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteStore]:
    opened = SQLiteStore(tmp_path / DB_FILE)
    opened.hand_writes_to_process()
    yield opened
    opened.close()


def hand_writes_to_lingering_child(store: SQLiteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """``store.hand_writes_to_process()`` with a child that runs :data:`LINGERING_CHILD` (its pipe closes 3 s before
    it exits on SIGUSR1)."""
    popen = subprocess.Popen

    def lingering(args: list[str], **options: Any) -> subprocess.Popen[bytes]:
        return popen([args[0], "-c", LINGERING_CHILD, *args[3:]], **options)

    with monkeypatch.context() as patched:
        patched.setattr(subprocess, "Popen", lingering)
        store.hand_writes_to_process()


async def stream_until_failed(groups: Groups, first: int) -> None:
    """Groups sent every 2 ms from ``first`` on until one is answered with an error (StoreError from send ends it)."""
    n = first
    async with asyncio.timeout(30):
        while not any(e is not None for a in groups.answers for e in a):
            try:
                groups.send(plan(f"p{n}", n))
            except StoreError:
                break
            n += 1
            await asyncio.sleep(0.002)


async def test_a_child_killed_mid_run_fails_the_groups_out_and_the_loop_keeps_turning(store: SQLiteStore) -> None:
    """SIGKILL while groups stream: each group out is answered once, the failed ones naming the signal; no lag."""
    ready_child(store)
    groups = Groups(store)
    for n in range(1, 4):
        groups.send(plan(f"p{n}", n))
    await groups.all_answered()
    probe = LagProbe()
    assert store.writer_pid is not None
    os.kill(store.writer_pid, signal.SIGKILL)
    await stream_until_failed(groups, 4)
    await groups.all_answered()
    probe.stop()
    committed = groups.committed()
    assert 3 <= committed < len(groups.answers)
    assert all(isinstance(a[0], StoreError) and "signal 9" in str(a[0]) for a in groups.answers[committed:])
    assert probe.worst_blocked_s < LAG_BOUND_S, stalled(probe)
    store.leave_loop()


async def test_a_child_whose_pipe_closed_before_its_exit_fails_the_groups_without_waiting_on_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child's pipe closes 3 s before it exits: the loop never waits for the exit status (it waited 1 s), the
    groups out fail within about :data:`EXIT_WAIT_S` ("it closed its pipe"), and the child is then killed."""
    store = SQLiteStore(tmp_path / DB_FILE)
    try:
        hand_writes_to_lingering_child(store, monkeypatch)
        child = ready_child(store)
        groups = Groups(store)
        groups.send(plan("p1", 1))
        await groups.all_answered()
        probe = LagProbe()
        os.kill(child.pid, signal.SIGUSR1)
        await stream_until_failed(groups, 2)
        await groups.all_answered()
        probe.stop()
        committed = groups.committed()
        assert committed >= 1 and all("closed its pipe" in str(a[0]) for a in groups.answers[committed:])
        assert probe.worst_blocked_s < LAG_BOUND_S, stalled(probe)
        await until(lambda: not alive(child.pid), timeout_s=10)  # killed once failed, not left for its 3 s
        store.leave_loop()
    finally:
        await asyncio.to_thread(store.close)


async def test_a_stopped_child_that_sigkill_does_not_end_fails_the_groups_and_the_loop_keeps_turning(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGSTOP, and its SIGKILL without effect (a child in uninterruptible sleep: a disk that does not answer): the
    groups out fail at the reply timeout ("stuck") without the loop waiting for the end (it waited 5 s), and the
    child that did not end is logged."""
    child = ready_child(store)
    child.reply_timeout_s = 0.3
    monkeypatch.setattr(writer_process, "KILL_WAIT_S", 0.2, raising=False)
    monkeypatch.setattr(child.process, "kill", lambda: None)  # the SIGKILL pending, as in uninterruptible sleep
    groups = Groups(store)
    groups.send(plan("p1", 1))
    await groups.all_answered()
    probe = LagProbe()
    os.kill(child.pid, signal.SIGSTOP)
    try:
        with structlog.testing.capture_logs() as logs:
            await stream_until_failed(groups, 2)
            await groups.all_answered()
            probe.stop()
            committed = groups.committed()
            assert committed >= 1 and all("stuck" in str(a[0]) for a in groups.answers[committed:])
            assert probe.worst_blocked_s < LAG_BOUND_S, stalled(probe)
            await until(lambda: any("did not end after SIGKILL" in e["event"] for e in logs), timeout_s=10)
    finally:
        os.kill(child.pid, signal.SIGKILL)
    store.leave_loop()


async def test_a_store_closed_while_its_childs_exit_status_is_awaited_fails_the_groups_naming_the_closed_pipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child's pipe closed and its exit status not in yet (the wait made 60 s long) when the store is closed (in
    a thread, as CoordinatorServer.stop does): the groups out fail at once naming the closed pipe, the child is
    killed, and the close returns without waiting for the status."""
    monkeypatch.setattr(writer_process, "EXIT_WAIT_S", 60.0, raising=False)
    store = SQLiteStore(tmp_path / DB_FILE)
    try:
        hand_writes_to_lingering_child(store, monkeypatch)
        child = ready_child(store)
        groups = Groups(store)
        os.kill(child.pid, signal.SIGSTOP)  # the group stays unanswered
        groups.send(plan("p1", 1))
        os.kill(child.pid, signal.SIGUSR1)
        os.kill(child.pid, signal.SIGCONT)
        await until(lambda: not os.path.exists(f"/proc/{child.pid}/fd/1"), timeout_s=10)  # its pipe closed
        async with asyncio.timeout(10):
            await asyncio.to_thread(store.close)
        assert groups.committed() == 0 and "closed its pipe" in str(groups.answers[0][0])
        assert child.process.poll() is not None  # killed, not left for its 3 s
    finally:
        await asyncio.to_thread(store.close)
