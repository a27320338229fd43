"""A durable store's frame in parts: each part committed and released while the loop runs the next, in order.

coordinator/io/frontdoor/core_driver.py §Parts: with SQLite (a writer thread) a frame is cut after
``CoreDriver.part_messages`` messages; each part's records go to the committer and its frames are
released once that part (and every earlier one) is committed, while the rest of the frame is still
being fed. A real core, a real SQLite committer on a temporary file, a real front door; the client's
frames go to a ``Sink`` (a session that is no websocket), which reads the file back at each release.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from coordinator.core import Coordinator, CoreConfig
from coordinator.io.frontdoor.connection import Session
from coordinator.io.frontdoor.core_driver import DURABLE_PART_MESSAGES, REAP_EVERY_MASK, CoreDriver, CoreSession
from coordinator.io.frontdoor.door import FrontDoor
from coordinator.io.frontdoor.gate import Gatekeeper
from coordinator.io.frontdoor.server import CORE_CODECS
from coordinator.io.stores.commit import GroupCommitter
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE, MemoryStore, Store
from coordinator.limits import Limits
from coordinator.read_policy import ReadPolicy
from coordinator.records import PlanCreated
from protocol.messages import Accepted, Submit

pytestmark = pytest.mark.timeout(60)

CLIENT = 7  # the client's conn_id


def in_file(path: Path) -> set[str]:
    """The plans committed in the file, as another process would see them."""
    check = sqlite3.connect(path)
    try:
        return {row[0] for row in check.execute("SELECT id FROM plans")}
    finally:
        check.close()


class Releases:
    """The client's sink: at each release, its ``accepted`` plans, the plans the file holds and the plans fed."""

    def __init__(self, core: Coordinator, path: Path | None) -> None:
        self.core = core
        self.path = path
        self.seen: list[tuple[list[str], set[str], int]] = []
        self.accepted = 0
        self.all = asyncio.Event()
        self.want = 0

    def deliver(self, msgs: list[Any]) -> None:
        plans = [m.plan_id for m in msgs if type(m) is Accepted]
        self.seen.append((plans, in_file(self.path) if self.path else set(), len(self.core.plans)))
        self.accepted += len(plans)
        if self.accepted >= self.want:
            self.all.set()


@asynccontextmanager
async def driven(store: Store) -> AsyncIterator[tuple[CoreDriver, CoreSession, Releases]]:
    """A core driven by a CoreDriver over ``store``'s committer, one client session open, its frames to a sink."""
    limits = Limits()
    core = Coordinator(CoreConfig(), new_id=lambda: "unused")
    door = FrontDoor(None, Gatekeeper(None, limits, max_frame_bytes=1 << 20), ReadPolicy(limits), CORE_CODECS)  # type: ignore[arg-type]  # no port: nothing is upgraded here
    failures: list[BaseException] = []
    made: list[GroupCommitter[Any]] = []

    def committer(release: Any) -> GroupCommitter[Any]:
        made.append(GroupCommitter(store, release, failures.append, inline_max_records=0))
        return made[0]

    driver = CoreDriver(core, door, limits, committer)
    driver.committer.start()
    releases = Releases(core, store.path if isinstance(store, SQLiteStore) else None)
    driver.sinks[CLIENT] = releases
    core.open_session(CLIENT, "client", 0.0, principal="alice")
    driver.flush()
    session = Session(CLIENT, None, CORE_CODECS[("client", "msgpack")], role="client")  # type: ignore[arg-type]  # fed directly
    try:
        yield driver, CoreSession(driver, session, clock=lambda: 0.0), releases
    finally:
        await made[0].close()
        assert not failures


def submits(count: int) -> list[Submit]:
    return [Submit(req_id=n, op="echo", args=None, plan_id=f"p{n:05d}") for n in range(1, count + 1)]


@pytest.fixture
def db(tmp_path: Path) -> SQLiteStore:
    return SQLiteStore(tmp_path / DB_FILE)


async def test_a_big_frame_is_released_in_parts_before_its_last_part_is_fed(db: SQLiteStore) -> None:
    """SQLite: the first part's frames go out at the next part's hand-over, before the frame's last part is fed."""
    count, part = 4000, 20
    msgs = submits(count)
    async with driven(db) as (driver, session, releases):
        driver.part_messages = part
        releases.want = count
        index, spent = session.take(msgs, 100_000, 0.0)
        assert (index, spent, releases.accepted) == (part, 0, 0)  # one part fed, handed to the writer
        committer = driver.committer
        assert isinstance(committer, GroupCommitter)
        _held_until(lambda: committer._reported == committer.submitted)  # the part is committed; the loop is busy
        index, _ = session.take(msgs, 100_000, 0.0, index)
        assert index == 2 * part
        first = next((seen for seen in releases.seen if seen[0]), None)
        assert first is not None, "the first part was not released at the second part's hand-over"
        first_plans, committed, fed_then = first
        assert first_plans == [m.plan_id for m in msgs[:part]] and set(first_plans) <= committed
        assert fed_then == 2 * part < count  # released before the frame's last part was fed
        await session.finish(msgs, index, 100_000)
        await asyncio.wait_for(releases.all.wait(), 30)
    db.close()
    assert committer.batches >= count // part  # one batch per part


async def test_frames_never_overtake_their_records_or_an_earlier_part(db: SQLiteStore) -> None:
    """Each release finds its plans, and every earlier part's, committed in the file; releases keep submit order."""
    count = 3 * DURABLE_PART_MESSAGES + 7
    async with driven(db) as (driver, session, releases):
        assert driver.part_messages == DURABLE_PART_MESSAGES
        releases.want = count
        await session.received(submits(count), 100_000, 0.0)
        await asyncio.wait_for(releases.all.wait(), 30)
    db.close()
    accepted: list[str] = []
    for plans, committed, _ in releases.seen:
        accepted += plans
        assert set(accepted) <= committed  # this part's records and every earlier part's are durable
    assert accepted == [s.plan_id for s in submits(count)]  # in order, none lost, none twice
    assert len([plans for plans, _, _ in releases.seen if plans]) >= 4  # the frame went out in its parts


async def test_the_memory_store_takes_a_frame_whole() -> None:
    """A store that commits at once has no parts: one step, one release for the whole frame."""
    count = 3 * DURABLE_PART_MESSAGES
    async with driven(MemoryStore()) as (driver, session, releases):
        assert driver.part_messages == 0
        releases.want = count
        index, _ = session.take(submits(count), 100_000, 0.0)
        assert index == count
        await asyncio.wait_for(releases.all.wait(), 30)
    assert [len(plans) for plans, _, _ in releases.seen if plans] == [count]


def _hold_at(driver: CoreDriver, plan_id: str, condition: Callable[[], bool]) -> None:
    """Hold the loop inside the driver, before it feeds ``plan_id``'s submit, until ``condition`` (another thread's)."""
    receive = driver.receive

    def held(conn_id: int, msg: Any, now: float) -> None:
        if msg.plan_id == plan_id:
            _held_until(condition)
        receive(conn_id, msg, now)

    driver.receive = held  # type: ignore[method-assign]  # the driver's own receive, called after the hold


async def test_a_part_reported_committed_is_released_within_the_next_part(db: SQLiteStore) -> None:
    """A commit reported while the next part is fed goes out REAP_EVERY_MASK + 1 messages into it, not at its end."""
    count, part = 2 * 200, 200
    msgs = submits(count)
    async with driven(db) as (driver, session, releases):
        driver.part_messages = part
        committer = driver.committer
        assert isinstance(committer, GroupCommitter)
        releases.want = count
        index, _ = session.take(msgs, 100_000, 0.0)
        assert index == part and releases.accepted == 0
        _hold_at(driver, msgs[part].plan_id, lambda: committer._reported >= 1)  # the first part committed meanwhile
        assert session.take(msgs, 100_000, 0.0, index)[0] == count
        first = next((seen for seen in releases.seen if seen[0]), None)
        assert first is not None and first[0] == [m.plan_id for m in msgs[:part]]
        assert set(first[0]) <= first[1]  # its plans were in the file when it went out
        assert first[2] == part + REAP_EVERY_MASK + 1 < count  # released within the second part, not after it
        await asyncio.wait_for(releases.all.wait(), 30)
    db.close()


def _held_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Hold the loop (as other sessions' parts do) until another thread makes ``condition`` true."""
    deadline = time.monotonic() + timeout_s
    held = threading.Event()
    while not condition():
        assert time.monotonic() < deadline, "the writer never reported"
        held.wait(0.001)  # the loop must stay blocked here: no asyncio wait can stand in


async def test_a_reported_commit_is_released_at_the_next_hand_over_not_behind_the_loops_queue(db: SQLiteStore) -> None:
    """GroupCommitter.reap releases what the writer reported before the loop runs the report's callback, once."""
    released: list[str] = []
    failures: list[BaseException] = []
    committer: GroupCommitter[str] = GroupCommitter(db, released.append, failures.append, inline_max_records=0)
    committer.start()
    committer.submit([PlanCreated("p1", "alice", 1, submits(1)[0])], "first")
    _held_until(lambda: "p1" in in_file(db.path))  # committed; its callback waits for the loop
    _held_until(lambda: committer.transactions == 0 and committer._reported == 1)
    committer.reap()
    assert released == ["first"]  # here, in the loop's own step
    committer.submit([PlanCreated("p2", "alice", 2, submits(2)[1])], "second")
    await committer.close()
    assert released == ["first", "second"] and not failures  # the late callback released nothing twice
    db.close()


async def test_a_session_whose_step_fanned_out_has_its_frames_taken_whole(db: SQLiteStore) -> None:
    """A step that sent to more than part_max_sessions sessions: the rest of its frame and the next are whole."""
    count, part = 300, 20
    msgs = submits(count)
    async with driven(db) as (driver, session, releases):
        driver.part_messages, driver.part_max_sessions = part, 0  # the client alone counts as a fan-out here
        releases.want = count + 50 + 80
        index, _ = session.take(msgs, 100_000, 0.0)
        assert index == part and driver.step_sessions == 1 and session.whole
        index, _ = session.take(msgs, 100_000, 0.0, index)
        assert index == count  # not cut again
        more = [Submit(req_id=n, op="echo", args=None, plan_id=f"q{n:05d}") for n in range(1, 51)]
        assert session.take(more, 10_000, 0.0)[0] == len(more)  # the next frame: whole too
        driver.part_max_sessions = 8
        later = submits(count + 80)[count:]
        assert session.take(later[:40], 10_000, 0.0)[0] == 40  # whole: the last step was wide when it was taken
        assert session.take(later[40:], 10_000, 0.0)[0] == part and not session.whole  # narrow again: cut
        await session.finish(later[40:], part, 10_000)
        await asyncio.wait_for(releases.all.wait(), 30)
    db.close()
