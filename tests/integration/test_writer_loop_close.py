"""Review of 5ce510b (the SQLite store's writer process served on the event loop): its close with groups out.

The bugs it found (strict xfails here first) are fixed in coordinator/io/stores/writer_process.py: WriterProcess.leave()
answers the groups still out from the replies the pipe holds and fails the rest at once (it never waits on the loop),
and a close that gave up waiting for leave() keeps the pipes open for it to close."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.io.stores import commit, writer_end
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from tests.integration.test_store_writer_process import plan, ready_child, started
from tests.waiting import LagProbe, until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteStore]:
    opened = SQLiteStore(tmp_path / DB_FILE)
    opened.hand_writes_to_process()
    yield opened
    opened.close()


async def test_a_store_closed_with_groups_out_answers_them_and_the_committers_close_returns(
    store: SQLiteStore,
) -> None:
    """The store closed (in a thread, as CoordinatorServer.stop does) while the loop's groups wait for replies:
    each group is answered, released or failed (commit-before-send: failed is safe), and the committer's close
    after it returns instead of waiting for answers nobody reads any more."""
    seen, committer = started(store, inline_max_records=0)
    ready_child(store)
    for n in range(1, 50):
        committer.submit(plan(f"p{n}", n), n)
    await asyncio.to_thread(store.close)
    async with asyncio.timeout(5):
        await committer.close()
    assert len(seen) == 49 or seen.errors


async def test_a_store_closed_with_groups_out_to_a_stuck_child_keeps_the_loop_responsive(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child stopped (SIGSTOP: a disk that does not answer) with groups out, the store closed in a thread: the
    loop keeps turning (a 10 ms probe is never late by 1 s) while the close ends the child (after its grace, made
    0.5 s), and the groups fail."""
    monkeypatch.setattr(writer_end, "CLOSE_GRACE_S", 0.5, raising=False)
    seen, committer = started(store, inline_max_records=0)
    child = ready_child(store)
    os.kill(child.pid, signal.SIGSTOP)
    for n in range(1, 20):
        committer.submit(plan(f"p{n}", n), n)
    probe = LagProbe()
    try:
        await asyncio.to_thread(store.close)
    finally:
        late_s = probe.stop()
    assert seen == [] and seen.errors
    # blocked, not waiting for a CPU or the collector (tests/waiting.py LagProbe)
    assert probe.worst_blocked_s < 1.0, f"the loop stalled {probe.worst_blocked_s:.1f} s blocked ({late_s:.1f} s late)"


async def test_a_store_closed_with_groups_out_to_a_stuck_child_is_bounded_by_the_grace_and_logs_them(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child stopped (SIGSTOP) with groups out and the store closed on its own (no committer close first): the
    close kills the child once the store's close grace passed (writer_end.CLOSE_GRACE_S, made 0.3 s; it waited
    its 10 s), and its log names the groups given up as not acknowledged, never as committed. The 5 s bound is a
    generous correctness bound, not a timing goal."""
    monkeypatch.setattr(writer_end, "CLOSE_GRACE_S", 0.3, raising=False)
    seen, committer = started(store, inline_max_records=0)
    child = ready_child(store)
    os.kill(child.pid, signal.SIGSTOP)
    try:
        for n in range(1, 20):
            committer.submit(plan(f"p{n}", n), n)
        await until(lambda: child.in_flight)
        with capture_logs() as logs:
            async with asyncio.timeout(5):
                await asyncio.to_thread(store.close)
        assert child.process.poll() == -signal.SIGKILL
        assert seen == [] and seen.errors
        [given_up] = [entry for entry in logs if "given up" in entry["event"]]
        assert given_up["killed"] is True and given_up["groups"] >= 1 and given_up["sent_after_generation"] >= 0
        assert "not acknowledged" in given_up["event"] and given_up["log_level"] == "error"
    finally:
        if child.process.poll() is None:
            os.kill(child.pid, signal.SIGKILL)


def _is_pipe(fd: int) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:
        return False


async def test_a_close_the_loop_does_not_leave_in_time_keeps_the_pipes_until_it_does(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store closed in a thread while the loop is blocked past the close's wait for leave(): the close ends
    the child but keeps the pipes' fd numbers (a late leave() acting on numbers released, maybe reused by then,
    would take another file off the loop); the late leave() closes them once it has taken them off the loop."""
    monkeypatch.setattr(writer_end, "LEAVE_WAIT_S", 0.05)
    started(store, inline_max_records=0)
    child = ready_child(store)
    fds = (child.process.stdin.fileno(), child.process.stdout.fileno())  # type: ignore[union-attr]
    closing = threading.Thread(target=store.close)
    closing.start()
    closing.join(30)  # the loop blocked meanwhile: leave() cannot run
    assert not closing.is_alive()
    assert child.process.poll() is not None, "the child outlived the close"
    assert all(map(_is_pipe, fds)), "the close released fd numbers the loop still serves"
    await until(lambda: not any(map(_is_pipe, fds)))


async def test_a_stop_with_groups_out_to_a_stuck_child_gives_up_after_the_grace_and_kills_it(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CoordinatorServer.stop's order (the committer's close, then the store's in a thread) with the child stopped
    (SIGSTOP: a disk that does not answer) and groups out: the committer's close gives up after its grace
    (commit.CLOSE_GRACE_S, made 0.3 s) instead of the 120 s stuck check, the groups fail (never released: not
    acknowledged, committed or not) naming the stop, the child is killed, and the store's close does not wait 10 s
    for it either. The 5 s bounds are generous correctness bounds, not timing goals."""
    monkeypatch.setattr(commit, "CLOSE_GRACE_S", 0.3, raising=False)
    seen, committer = started(store, inline_max_records=0)
    child = ready_child(store)
    os.kill(child.pid, signal.SIGSTOP)
    try:
        for n in range(1, 20):
            committer.submit(plan(f"p{n}", n), n)
        async with asyncio.timeout(5):
            await committer.close()
        assert seen == [] and seen.errors
        assert "at the stop" in str(seen.errors[0]) and "not acknowledged" in str(seen.errors[0])
        async with asyncio.timeout(5):
            await asyncio.to_thread(store.close)
        assert child.process.poll() == -signal.SIGKILL
    finally:
        if child.process.poll() is None:
            os.kill(child.pid, signal.SIGKILL)


async def test_a_coordinators_stop_with_a_stuck_writer_child_is_bounded_by_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CoordinatorServer.stop (SIGTERM, ``fleetwire up``'s Ctrl-C) with the writer child stopped and a group out:
    it returns after the grace (made 0.3 s; it waited for the 120 s stuck check), the store's failure names the stop,
    and the child is killed. The group (80 records: too many for a commit on the loop) goes to the child."""
    monkeypatch.setattr(commit, "CLOSE_GRACE_S", 0.3, raising=False)
    settings = ServerSettings(port=0, insecure=True, store=f"sqlite:{tmp_path / DB_FILE}", store_writer="process")
    server = CoordinatorServer(settings)
    await server.start()
    assert isinstance(server.store, SQLiteStore)
    child = ready_child(server.store)
    os.kill(child.pid, signal.SIGSTOP)
    try:
        committer: Any = server.driver.committer  # a payload never released: the group is never answered
        committer.submit([r for n in range(20) for r in plan(f"p{n}", n)], None)
        async with asyncio.timeout(5):
            await server.stop()
        assert server.fatal is not None and server.fatal.done()
        assert "at the stop" in str(server.fatal.result())
        assert child.process.poll() == -signal.SIGKILL
    finally:
        if child.process.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
