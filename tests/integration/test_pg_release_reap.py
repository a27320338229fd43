"""A committed PostgreSQL group whose release waits for its callback goes out within the next frame the driver reads.

coordinator/io/stores/pg_commit.py ("Pipelined"): when the next group is gathered, a committed group's payloads are
released a callback later, once the next statement is on its way. That callback waits for the loop's next turn,
behind the frames read meanwhile (a worker's frame of a thousand results is a core step of tens of ms), so the
driver releases such a payload itself, every ``REAP_EVERY_MASK`` + 1 messages of a frame and at each step's flush
(``PipelinedCommitter.reported`` / ``reap``; coordinator/io/frontdoor/core_driver.py). A real core, a real
PostgreSQL server (tests/pg.py; skipped without one), a real front door; the client's frames go to a ``Sink``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from coordinator.core import Coordinator, CoreConfig
from coordinator.io.frontdoor.connection import Session
from coordinator.io.frontdoor.core_driver import REAP_EVERY_MASK, CoreDriver, CoreSession
from coordinator.io.frontdoor.door import FrontDoor
from coordinator.io.frontdoor.gate import Gatekeeper
from coordinator.io.frontdoor.server import CORE_CODECS
from coordinator.io.stores.pg_commit import PipelinedCommitter
from coordinator.io.stores.postgres import PgStore
from coordinator.limits import Limits
from coordinator.read_policy import ReadPolicy
from coordinator.records import Record
from protocol.messages import Accepted, Submit
from tests.integration.test_pg_store import CLUSTER, hold
from tests.unit.test_store import created

pytestmark = pytest.mark.timeout(60)

CLIENT = 7  # the client's conn_id


class HookedPgStore(PgStore):
    """A PgStore that runs ``on_begin(n)`` as its n-th group commit begins, in the committer's own step."""

    begun = 0
    on_begin: Callable[[int], None] | None = None

    async def write_async(self, records: Sequence[Record]) -> None:
        self.begun += 1
        if self.on_begin is not None:
            self.on_begin(self.begun)
        await super().write_async(records)


@pytest.fixture
def pg(pg_dsn: str) -> Iterator[HookedPgStore]:
    store = HookedPgStore(pg_dsn, CLUSTER)
    hold(store)
    yield store
    store.close()


def submits(first: int, count: int) -> list[Submit]:
    return [Submit(req_id=n, op="echo", args=None, plan_id=f"p{n:05d}") for n in range(first, first + count)]


class Releases:
    """The client's sink: at each release, its ``accepted`` plans and how many plans the core had been fed."""

    def __init__(self, core: Coordinator) -> None:
        self.core = core
        self.seen: list[tuple[list[str], int]] = []

    def deliver(self, msgs: list[Any]) -> None:
        self.seen.append(([m.plan_id for m in msgs if type(m) is Accepted], len(self.core.plans)))


async def test_a_deferred_release_goes_out_within_the_next_frame_not_after_it(pg: HookedPgStore) -> None:
    """Group A committed, B gathered: A's payload goes REAP_EVERY_MASK + 1 messages into the frame the driver reads
    before A's callback runs (not once that frame is fed); every payload once, in order, after its own commit."""
    limits = Limits()
    core = Coordinator(CoreConfig(), new_id=lambda: "unused")
    door = FrontDoor(None, Gatekeeper(None, limits, max_frame_bytes=1 << 20), ReadPolicy(limits), CORE_CODECS)  # type: ignore[arg-type]  # no port: nothing is upgraded here
    failures: list[BaseException] = []
    driver = CoreDriver(core, door, limits, lambda release: pg.make_committer(release, failures.append))
    committer = driver.committer
    assert isinstance(committer, PipelinedCommitter)
    releases = Releases(core)
    driver.sinks[CLIENT] = releases
    core.open_session(CLIENT, "client", 0.0, principal="alice")
    driver.flush()
    session = CoreSession(driver, Session(CLIENT, None, CORE_CODECS[("client", "msgpack")], role="client"),  # type: ignore[arg-type]  # fed directly
                          clock=lambda: 0.0)  # fmt: skip
    a, b, frame = submits(1, 3), submits(4, 2), submits(6, 4 * (REAP_EVERY_MASK + 1))
    fed_at_frame: list[int] = []

    def on_begin(n: int) -> None:
        if n == 1:  # A's statement goes now: B is read meanwhile and gathered behind it
            assert session.take(b, 100_000, 0.0)[0] == len(b)
        elif n == 2:  # A's commit returned, B's begins: A's release waits for its callback; the driver reads a frame
            fed_at_frame.append(len(core.plans))
            assert session.take(frame, 100_000, 0.0)[0] == len(frame)

    pg.on_begin = on_begin
    committer.start()
    assert session.take(a, 100_000, 0.0)[0] == len(a)
    await committer.close()
    assert not failures and fed_at_frame == [len(a) + len(b)]
    accepted = [plans for plans, _ in releases.seen if plans]
    assert [p for plans in accepted for p in plans] == [s.plan_id for s in a + b + frame]  # in order, each once
    first = next(seen for seen in releases.seen if seen[0])
    assert first[0] == [s.plan_id for s in a]
    assert first[1] == len(a) + len(b) + REAP_EVERY_MASK + 1  # within the frame, not after its last message
    assert pg.begun == 3  # A, B, then the frame's group: nothing committed twice


async def test_reap_releases_a_committed_group_once_and_in_order(pg: HookedPgStore) -> None:
    """PipelinedCommitter.reap releases the committed group whose callback is due; the callback then releases
    nothing twice; reap before a commit returned, or with nothing due, releases nothing."""
    released: list[str] = []
    failures: list[BaseException] = []
    committer: PipelinedCommitter[str] = pg.make_committer(released.append, failures.append)
    seen: list[tuple[bool, list[str]]] = []

    def on_begin(n: int) -> None:
        seen.append((committer.reported(), list(released)))
        if n == 1:  # A's statement goes now: B is gathered behind it; reap has nothing committed to release
            committer.submit([created("p2", 2)], "B")
            committer.reap()
        elif n == 2:  # A returned, B begins: A's release is due
            committer.reap()
            seen.append((committer.reported(), list(released)))

    pg.on_begin = on_begin
    committer.start()
    committer.submit([created("p1", 1)], "A")
    await committer.close()
    assert not failures
    assert seen == [(False, []), (True, []), (False, ["A"])]
    assert released == ["A", "B"] and committer.transactions == 2
