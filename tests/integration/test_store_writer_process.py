"""The SQLite store's writes in a child process (``--store-writer process``, coordinator/io/stores/writer_process.py).

Real SQLite files and real child processes: what the child commits is loaded back by a restart;
a child killed or stuck fails the store (nothing after it released) instead of hanging; close
drains; the parent never writes once the child owns the file; the child never outlives the parent.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.io.stores import writer_child, writer_process, writer_wire
from coordinator.io.stores.commit import GroupCommitter
from coordinator.io.stores.integrity import StoreError
from coordinator.io.stores.schema import GENERATION
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from coordinator.records import PlanCreated, PlanForgotten, PlanStatus, Record, UsageRows
from protocol.messages import Event, Submit
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


def plan(plan_id: str, order: int, *, ended: bool = False) -> list[Record]:
    """A plan's records: its creation, two events and its status (succeeded when ``ended``)."""
    submit = Submit(req_id=order, op="echo", args={"n": order}, plan_id=plan_id)
    records: list[Record] = [
        PlanCreated(plan_id, "alice", order, submit), Event(plan_id=plan_id, kind="queued", data={}, seq=1),
        Event(plan_id=plan_id, kind="running", data={"worker_id": "w1"}, seq=2, attempt=1),
    ]  # fmt: skip
    state = "succeeded" if ended else "running"
    records.append(PlanStatus(plan_id, state, 1, "w1", next_seq=3, result={"n": order} if ended else None))
    return records


class Released(list[Any]):
    """A committer's release callback: the payloads released, in order; ``failed`` once on_failure ran."""

    def __init__(self) -> None:
        super().__init__()
        self.done = asyncio.Event()
        self.failed = asyncio.Event()
        self.errors: list[BaseException] = []

    def __call__(self, payload: Any) -> None:
        self.append(payload)
        self.done.set()

    def fail(self, exc: BaseException) -> None:
        self.errors.append(exc)
        self.failed.set()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteStore]:
    opened = SQLiteStore(tmp_path / DB_FILE)
    opened.hand_writes_to_process()
    yield opened
    opened.close()


def started(store: SQLiteStore, **options: Any) -> tuple[Released, GroupCommitter[int]]:
    """A started committer on ``store`` with ``options``: ``inline_max_records=0`` sends every group through the
    writer thread to the child (none on the loop); ``inline_slow_s=60`` commits a lone group on the loop (never
    judged slow) and a busy one in the child."""
    seen = Released()
    committer: GroupCommitter[int] = GroupCommitter(store, seen, seen.fail, **options)
    committer.start()
    return seen, committer


def ready_child(store: SQLiteStore) -> writer_process.WriterProcess:
    """The store's writer process, once it has opened the file."""
    child = store._child
    assert child is not None
    child.wait_ready()
    return child


async def released(seen: Released, count: int) -> None:
    async with asyncio.timeout(30):
        while len(seen) < count and not seen.failed.is_set():
            seen.done.clear()
            await seen.done.wait()


async def test_groups_committed_by_the_writer_process_are_loaded_back_by_a_restart(
    store: SQLiteStore, tmp_path: Path
) -> None:
    """Plans, events, statuses, a forgotten plan and usage rows written through the child come back at a restart."""
    seen, committer = started(store, inline_slow_s=60)
    committer.submit(plan("p1", 1) + plan("p2", 2, ended=True) + plan("gone", 3, ended=True), 1)
    await released(seen, 1)
    late = Event(plan_id="p1", kind="log", data={"line": "x" * 600}, seq=3)  # a run too long for the row: spilled
    committer.submit([late, PlanForgotten("gone"), UsageRows([(3600, "alice", "ml", [1.0, 2.0])])], 2)
    await released(seen, 2)
    await committer.close()
    assert seen == [1, 2] and not seen.errors
    assert store.writer_pid is not None and store.generation == 2
    store.close()
    again = SQLiteStore(tmp_path / DB_FILE)  # the generation side file agrees, or this refuses
    try:
        plans = {p.created.plan_id: p for p in again.load()}
        assert sorted(plans) == ["p1", "p2"] and again.generation == 2
        assert [e.seq for e in plans["p1"].events] == [1, 2, 3] and plans["p1"].events[2].data == late.data
        assert plans["p2"].status is not None and plans["p2"].status.result == {"n": 2}
        assert [(r.hour_s, r.principal, r.values()[:2]) for r in again.load_usage()] == [(3600, "alice", [1.0, 2.0])]
    finally:
        again.close()


async def test_a_killed_writer_process_fails_the_store_and_nothing_after_it_is_released(store: SQLiteStore) -> None:
    """kill -9 of the child: the next commit fails the store (naming the signal); it and later batches stay held."""
    seen, committer = started(store, inline_max_records=0)
    committer.submit(plan("p1", 1), 1)
    await released(seen, 1)
    pid = store.writer_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    committer.submit(plan("p2", 2), 2)
    committer.submit(plan("p3", 3), 3)
    await asyncio.wait_for(seen.failed.wait(), 30)
    assert seen == [1]
    assert isinstance(seen.errors[0], StoreError) and "signal 9" in str(seen.errors[0])
    await committer.close()
    assert seen == [1] and len(seen.errors) == 1


async def test_a_stuck_writer_process_fails_the_store_instead_of_hanging(store: SQLiteStore) -> None:
    """A child that stops answering (SIGSTOP) fails the store once its reply is overdue; nothing is released."""
    seen, committer = started(store, inline_max_records=0)
    committer.submit(plan("p1", 1), 1)
    await released(seen, 1)
    child = store._child
    assert child is not None
    child.reply_timeout_s = 0.5
    os.kill(child.pid, signal.SIGSTOP)
    committer.submit(plan("p2", 2), 2)
    await asyncio.wait_for(seen.failed.wait(), 30)
    assert seen == [1] and "stuck" in str(seen.errors[0])
    await committer.close()
    await until(lambda: child.process.poll() is not None, timeout_s=10)  # killed (not waited on the loop), not stopped


async def test_close_drains_every_queued_group_then_stops_the_writer_process(
    store: SQLiteStore, tmp_path: Path
) -> None:
    """Batches still queued at close are committed and released, then the child exits on its own (status 0)."""
    seen = Released()
    committer: GroupCommitter[int] = GroupCommitter(store, seen, seen.fail)
    committer.start()
    for n in range(1, 51):
        committer.submit(plan(f"p{n}", n), n)
    await committer.close()
    assert seen == list(range(1, 51)) and not seen.errors
    child = store._child
    assert child is not None
    store.close()
    assert child.process.returncode == 0
    again = SQLiteStore(tmp_path / DB_FILE)
    try:
        assert len(again.load()) == 50
    finally:
        again.close()


async def test_the_parent_writes_only_its_inline_commits_once_the_writer_process_owns_the_file(
    store: SQLiteStore,
) -> None:
    """After the hand-over a waiting write goes to the child (no row changed here); only try_write commits here."""
    before = store._db.total_changes
    store.write(plan("p1", 1))
    assert store._db.total_changes == before and store.writes == 1
    with pytest.raises(StoreError, match="writer process"):
        store.write_here(plan("p3", 3), wait=True)
    assert store.try_write(plan("p2", 2))  # the child is ready: its first commit answered
    assert store._db.total_changes > before and store.writes == 2 and store.generation == 2


def test_the_writer_process_carries_no_token_and_dies_with_its_parent(tmp_path: Path) -> None:
    """A coordinator killed with -9: its writer child is gone too; the child's environment holds none of its tokens."""
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from coordinator.io.stores.sqlite import SQLiteStore
        store = SQLiteStore(Path({str(tmp_path / DB_FILE)!r}))
        store.hand_writes_to_process()
        print(store.writer_pid, flush=True)
        time.sleep(60)
    """)
    env = {**os.environ, "FLEETWIRE_CLIENT_TOKEN": "s3cret-client", "FLEETWIRE_WORKER_TOKEN": "s3cret-worker"}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        assert not any("s3cret" in value for value in child.environ().values())
        parent.kill()
        parent.wait(10)
        gone, _ = psutil.wait_procs([child], timeout=20)
        assert gone
    finally:
        parent.kill()
        parent.wait(10)
        if parent.stdout is not None:
            parent.stdout.close()


async def test_a_coordinator_with_store_writer_process_commits_through_its_child(tmp_path: Path) -> None:
    """``store_writer="process"``: the server hands the SQLite store's writes to a child at start, stops it at stop."""
    settings = ServerSettings(port=0, insecure=True, store=f"sqlite:{tmp_path / DB_FILE}", store_writer="process")
    server = CoordinatorServer(settings)
    await server.start()
    try:
        assert isinstance(server.store, SQLiteStore)
        pid = server.store.writer_pid
        assert pid is not None and psutil.Process(pid).ppid() == os.getpid()
        child = server.store._child
    finally:
        await server.stop()
    assert child is not None and child.process.returncode == 0


def test_the_writer_process_stores_the_bytes_the_thread_stores(tmp_path: Path) -> None:
    """The same groups written by the child and by this process leave identical rows (blobs and checksums)."""
    ended = PlanStatus("p1", "succeeded", 1, "w1", next_seq=4, result={"ok": True})
    groups = [plan("p1", 1) + plan("gone", 2, ended=True),
              [Event(plan_id="p1", kind="log", data=[1, "x"], seq=3), Event(plan_id="p1", kind="tick", seq=4), ended,
               PlanForgotten("gone")]]  # fmt: skip
    rows = []
    for writer in ("thread", "process"):
        path = tmp_path / writer / DB_FILE
        store = SQLiteStore(path)
        if writer == "process":
            store.hand_writes_to_process()
        for group in groups:
            store.write(group)
        store.close()
        db = sqlite3.connect(path)
        try:
            rows.append(db.execute("SELECT rowid, * FROM plans ORDER BY rowid").fetchall())
        finally:
            db.close()
    assert rows[0] == rows[1] and len(rows[0]) == 1


def crossing_groups() -> list[list[Record]]:
    """Groups whose keys cross sides when they alternate parent (even) and child (odd): rowids, CRC chains, forgets."""
    ended_a = PlanStatus("a", "succeeded", 1, "w1", next_seq=5, result={"ok": 1})
    return [
        plan("a", 1) + plan("gone1", 2, ended=True),  # parent: a's rowid and events checksum
        [Event(plan_id="a", kind="log", data=[3], seq=3), *plan("b", 3), PlanForgotten("gone1")],  # child
        [Event(plan_id="b", kind="log", data=[3], seq=3), Event(plan_id="a", kind="log", data=[4], seq=4),
         *plan("gone2", 4, ended=True)],  # parent: both chains run on from the child's values
        [Event(plan_id="b", kind="log", data=[4], seq=4), ended_a, PlanForgotten("gone2")],  # child
        [*plan("c", 5), PlanForgotten("b")],  # parent: forgets a plan the child created
        [Event(plan_id="c", kind="log", data=[3], seq=3), Event(plan_id="a", kind="late", seq=5),
         Event(plan_id="c", kind="log", data="x" * 600, seq=4)],  # child: an ended plan's events once more, a spill
        [Event(plan_id="c", kind="log", data=[5], seq=5), *plan("d", 6)],  # parent
    ]  # fmt: skip


@pytest.mark.parametrize("held", [writer_process.KEYS_HELD_BYTES, 1], ids=["keys-held", "keys-sent-at-once"])
def test_inline_and_child_commits_alternating_store_the_bytes_the_thread_stores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: int
) -> None:
    """Groups committed alternately by the parent (try_write) and the child leave the thread's rows, and load back."""
    monkeypatch.setattr(writer_process, "KEYS_HELD_BYTES", held)
    tables = []
    for writer in ("thread", "process"):
        path = tmp_path / writer / DB_FILE
        store = SQLiteStore(path)
        store.load()
        if writer == "process":
            store.hand_writes_to_process()
            assert store._child is not None
            store._child.wait_ready()
        for n, group in enumerate(crossing_groups()):
            if writer == "process" and n % 2 == 0:
                before = store._db.total_changes
                assert store.try_write(group) and store._db.total_changes > before  # committed by the parent
            else:
                store.write(group)
        store.close()
        db = sqlite3.connect(path)
        try:
            tables.append([db.execute(query).fetchall() for query in (
                "SELECT rowid, * FROM plans ORDER BY rowid", "SELECT * FROM events ORDER BY plan, seq",
                GENERATION)])  # fmt: skip
        finally:
            db.close()
    assert tables[0] == tables[1]
    assert [row[1] for row in tables[1][0]] == ["a", "c", "d"] and tables[1][2] == [(7,)]
    again = SQLiteStore(tmp_path / "process" / DB_FILE)  # every checksum is checked by the load
    try:
        plans = {p.created.plan_id: p for p in again.load()}
        assert [e.seq for e in plans["a"].events] == [1, 2, 3, 4, 5]
        assert [e.seq for e in plans["c"].events] == [1, 2, 3, 4, 5] and again.generation == 7
    finally:
        again.close()


@pytest.mark.parametrize("opened", [False, True], ids=["before-its-open", "after-its-open"])
async def test_lone_commits_never_wait_for_a_writer_process_still_starting(
    store: SQLiteStore, tmp_path: Path, opened: bool
) -> None:
    """While the child starts (here: stopped), lone commits go on on the loop; the child then applies their keys."""
    child = store._child
    assert child is not None
    if opened:  # its ready reply (generation 0) waits in the pipe, unread: the commits below come after its open
        assert select.select([child.process.stdout], [], [], 30)[0]
    os.kill(child.pid, signal.SIGSTOP)
    try:
        seen, committer = started(store, inline_slow_s=60)
        committer.submit(plan("p1", 1), 1)
        await released(seen, 1)
        committer.submit(plan("p1", 1, ended=True)[3:], 2)  # p1 ends: its keys (an ended plan) are held too
        await released(seen, 2)
        assert committer.inline_commits == 2 and store.generation == 2
    finally:
        os.kill(child.pid, signal.SIGCONT)
    for n in range(2, 32):  # a busy group: the child, which read the file at generation 0, 1 or 2, commits it
        committer.submit(plan(f"p{n}", n), n + 1)
    await released(seen, 32)
    assert committer.inline_commits == 2 and child.generation == store.generation and not seen.errors
    await committer.close()
    store.close()
    again = SQLiteStore(tmp_path / DB_FILE)
    try:
        plans = {p.created.plan_id: p for p in again.load()}
        assert len(plans) == 31 and plans["p1"].status is not None and plans["p1"].status.state == "succeeded"
        assert [e.seq for e in plans["p31"].events] == [1, 2]
    finally:
        again.close()


async def test_a_lone_round_trip_commits_on_the_loop_and_a_busy_one_in_the_child(
    store: SQLiteStore, tmp_path: Path
) -> None:
    """Process mode: an idle writer's small group is committed by the parent's connection, a large one by the child."""
    seen, committer = started(store, inline_slow_s=60)
    assert store._child is not None
    store._child.wait_ready()
    committer.submit(plan("p1", 1), 1)  # lone: on the loop
    await released(seen, 1)
    assert committer.inline_commits == 1 and store.generation == 1 and store._child.generation == 1
    assert len(store._child._keys_held) == 1  # its keys go in front of the next group: the child not woken now
    for n in range(2, 32):  # 120 records gathered in one loop iteration: the child commits them
        committer.submit(plan(f"p{n}", n), n)
    await released(seen, 31)
    assert committer.inline_commits == 1
    committer.submit([Event(plan_id="p2", kind="log", data=[3], seq=3)], 32)  # lone again: a child's plan, here
    await released(seen, 32)
    assert committer.inline_commits == 2 and store._child.generation == store.generation
    await committer.close()
    assert seen == list(range(1, 33)) and not seen.errors
    store.close()
    again = SQLiteStore(tmp_path / DB_FILE)
    try:
        plans = {p.created.plan_id: p for p in again.load()}
        assert len(plans) == 31 and [e.seq for e in plans["p2"].events] == [1, 2, 3]
    finally:
        again.close()


def test_groups_waiting_in_the_pipe_are_committed_as_one_transaction_and_answered_in_order(
    store: SQLiteStore, tmp_path: Path
) -> None:
    """Five groups sent while the child is stopped: one commit (one generation) answers all five, in send order."""
    child = ready_child(store)
    answered: list[tuple[int, BaseException | None]] = []
    os.kill(child.pid, signal.SIGSTOP)
    try:
        for n in range(1, 6):
            store.send(plan(f"p{n}", n), lambda error, n=n: answered.append((n, error)))
    finally:
        os.kill(child.pid, signal.SIGCONT)
    store.drain()
    assert answered == [(n, None) for n in range(1, 6)]
    assert store.generation == 1 and child.generation == 1
    store.close()
    again = SQLiteStore(tmp_path / DB_FILE)
    try:
        assert [p.created.plan_id for p in again.load()] == [f"p{n}" for n in range(1, 6)]
    finally:
        again.close()


async def test_a_commit_that_fails_in_the_child_fails_the_store_naming_its_error(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child cannot commit a request (not msgpack): the store fails naming the child's error; none released."""
    seen, committer = started(store, inline_max_records=0)
    monkeypatch.setattr(writer_process, "encode_group", lambda encoder, records: b"\xc1 not msgpack")
    committer.submit(plan("p1", 1), 1)
    await asyncio.wait_for(seen.failed.wait(), 30)
    assert seen == [] and isinstance(seen.errors[0], StoreError) and "DecodeError" in str(seen.errors[0])
    await committer.close()


async def test_a_garbled_reply_fails_the_store(store: SQLiteStore) -> None:
    """A reply that is not the next generation (written into the child's reply pipe here) fails the store."""
    seen, committer = started(store, inline_max_records=0)
    child = ready_child(store)
    pipe = os.readlink(f"/proc/self/fd/{child._in}")  # the child's end of it: the same "pipe:[inode]"
    (end,) = [fd for fd in os.listdir(f"/proc/{child.pid}/fd") if os.readlink(f"/proc/{child.pid}/fd/{fd}") == pipe
              and os.stat(f"/proc/{child.pid}/fd/{fd}", follow_symlinks=False).st_mode & 0o200]  # fmt: skip
    os.kill(child.pid, signal.SIGSTOP)  # nothing of its own comes first
    reply = os.open(f"/proc/{child.pid}/fd/{end}", os.O_WRONLY)
    os.write(reply, writer_wire.REPLY_HEADER.pack(7, 1, 0))
    os.close(reply)
    committer.submit(plan("p1", 1), 1)
    await asyncio.wait_for(seen.failed.wait(), 30)
    assert seen == [] and "answered generation 7" in str(seen.errors[0])
    await committer.close()


def test_keys_from_the_parent_that_do_not_apply_fail_the_childs_next_reply(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Garbled keys sent after an inline commit: the child fails its next group naming the error, and exits."""
    child = ready_child(store)
    monkeypatch.setattr(store, "keys_message", lambda: b"\xc1")
    assert store.try_write(plan("p1", 1))  # committed here; its keys go with the next group
    with pytest.raises(StoreError, match="DecodeError"):
        store.write(plan("p2", 2))
    assert child.process.wait(10) == 1


def test_garbled_keys_in_a_reply_fail_the_store(store: SQLiteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply whose keys this store cannot apply fails it (the keys can no longer be trusted) and stops the child."""
    child = store._child
    assert child is not None

    def garbled(message: bytes) -> None:
        raise ValueError("not keys")

    monkeypatch.setattr(child, "_on_keys", garbled)
    with pytest.raises(StoreError, match="keys of generation 1 cannot be applied: ValueError: not keys"):
        store.write(plan("p1", 1))
    assert child.process.wait(10) is not None  # killed, not waited for by the store


def test_a_writer_process_that_outlives_its_coordinator_keeps_the_store_locked(store: SQLiteStore) -> None:
    """The lock file is the child's too: with the parent's hold gone, a new store is refused until the child ends."""
    child = store._child
    assert child is not None and store._lock_fd is not None
    child.wait_ready()
    os.close(store._lock_fd)  # what the parent's death does to its hold
    store._lock_fd = None
    with pytest.raises(StoreError, match="another coordinator"):
        SQLiteStore(store.path)
    os.kill(child.pid, signal.SIGKILL)
    child.process.wait(10)
    SQLiteStore(store.path).close()


def test_a_writer_process_whose_parent_died_leaves_the_wal_as_the_death_left_it(store: SQLiteStore) -> None:
    """The end of the child's stdin with no close request (its parent killed -9) is no close: no checkpoint.

    Linux closes a killed parent's pipes before it sends the child its parent-death SIGKILL; a child that closed
    its connection (the file's last) at that end checkpointed the -wal into the file and deleted it now and then
    (test_store_damage's fixture found no -wal after its kill -9). Here the parent's connection is closed first,
    as its death closes it, then the child's stdin, as its death closes it.
    """
    child = ready_child(store)
    child.write(plan("p1", 1, ended=True), wait=True)
    wal = Path(f"{store.path}-wal")
    size = wal.stat().st_size
    store._db.close()  # what the parent's death does to its connection
    assert child.process.stdin is not None
    child.process.stdin.close()  # ... and to the child's stdin, before the parent-death signal
    assert child.process.wait(10) == 0
    assert wal.stat().st_size == size  # not checkpointed away: the file as the parent's death left it
    check = sqlite3.connect(store.path)  # its -wal recovered, as after any crash
    try:
        assert check.execute("SELECT id FROM plans").fetchall() == [("p1",)]
    finally:
        check.close()


_SQLITE_MEMORY = """
import ctypes, sqlite3, sys
from coordinator.io.stores.writer_child import sqlite_for_one_thread
set_up = sqlite_for_one_thread() if sys.argv[2] == "set" else None
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("CREATE TABLE t (x BLOB)")
db.executemany("INSERT INTO t VALUES (?)", [(bytes(100),)] * 100)
lib = ctypes.CDLL(next(line.split()[-1] for line in open("/proc/self/maps") if "/libsqlite3." in line))
lib.sqlite3_memory_used.restype = ctypes.c_int64
print(set_up, lib.sqlite3_memory_used(), db.execute("SELECT count(*) FROM t").fetchone()[0])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the library is found in /proc/self/maps")
def test_the_writer_childs_sqlite_keeps_no_memory_statistics(tmp_path: Path) -> None:
    """writer_child.sqlite_for_one_thread: SQLite's allocations take no global mutex for statistics (none counted)."""

    def run(mode: str) -> list[str]:
        args = [sys.executable, "-c", _SQLITE_MEMORY, str(tmp_path / f"{mode}.db"), mode]
        root = Path(__file__).resolve().parents[2]
        return subprocess.run(args, capture_output=True, text=True, check=True, cwd=root).stdout.split()

    assert run("set") == ["True", "0", "100"]  # set, and the connection works
    as_is = run("as-is")
    assert as_is[0] == "None" and int(as_is[1]) > 0 and as_is[2] == "100"  # statistics kept by default


# A dying writer process's hold on the lock file: the file names its (dead) coordinator; it lets go in half a second.
_DYING_WRITER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, sys.argv[2].encode())
print("held", flush=True)
time.sleep(0.5)
"""


def test_a_coordinator_restarted_at_once_after_a_kill_waits_for_its_dying_writer(tmp_path: Path) -> None:
    """The lock file names a dead coordinator whose writer process still holds it: the open waits for it, then opens."""
    path = tmp_path / DB_FILE
    SQLiteStore(path).close()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    holder = subprocess.Popen([sys.executable, "-c", _DYING_WRITER, f"{path}.lock", dead], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        SQLiteStore(path).close()  # waited for the holder to end instead of refusing
    finally:
        holder.kill()
        holder.wait(10)
        if holder.stdout is not None:
            holder.stdout.close()


async def test_a_writer_process_that_cannot_start_stops_the_coordinator_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No child can be started: the server's start raises StoreError naming why, and its port is closed again."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(writer_process.subprocess, "Popen", refuse)
    settings = ServerSettings(port=0, insecure=True, store=f"sqlite:{tmp_path / DB_FILE}", store_writer="process")
    server = CoordinatorServer(settings)
    try:
        with pytest.raises(StoreError, match="cannot start the store's writer process"):
            await server.start()
        assert server._server is not None and not server._server.is_serving()
    finally:
        await server.stop()


def test_a_store_closed_after_its_committers_loop_ended_takes_its_pipes_off_that_loop(tmp_path: Path) -> None:
    """The loop that served the child's pipes ended without the committer's close: the store's close still ends
    the child (status 0) and leaves nothing registered on that loop; the group sent before was committed."""
    store = SQLiteStore(tmp_path / DB_FILE)
    store.hand_writes_to_process()
    seen = Released()
    committer: GroupCommitter[int] = GroupCommitter(store, seen, seen.fail, inline_max_records=0)
    loop = asyncio.new_event_loop()

    async def sent() -> None:
        committer.start()
        committer.submit(plan("p1", 1), 1)
        await released(seen, 1)

    try:
        loop.run_until_complete(sent())
        child = store._child
        assert child is not None and child._loop is loop
        store.close()
        assert child._loop is None and child.process.returncode == 0 and seen == [1] and not seen.errors
        assert {child._in, child._out}.isdisjoint(loop._selector.get_map())  # type: ignore[attr-defined]
    finally:
        loop.close()


def test_the_childs_store_keeps_the_parents_bytes_and_updates_one_row_a_step(tmp_path: Path) -> None:
    """The child's path (its decode, _grouped, a writer store) stores the thread's rows, with no multi-row UPDATE."""
    groups = crossing_groups()
    thread_path, child_path = tmp_path / "thread" / DB_FILE, tmp_path / "child" / DB_FILE
    store = SQLiteStore(thread_path)
    for group in groups:
        store.write(group)
    store.close()
    SQLiteStore(child_path).close()
    child = SQLiteStore.writer(child_path, encode_record=writer_child._raw_of)
    statements: list[str] = []
    child._db.set_trace_callback(statements.append)
    decode = msgspec.msgpack.Decoder(tuple[bytes, list[msgspec.Raw]]).decode
    encoder = msgspec.msgpack.Encoder()
    for group in groups:
        codes, raws = decode(writer_wire.encode_group(encoder, group))
        assert child.write_grouped(*writer_child._grouped(codes, raws), len(raws), wait=True)
    child.close()
    tables = []
    for path in (thread_path, child_path):
        db = sqlite3.connect(path)
        try:
            tables.append([db.execute(query).fetchall() for query in (
                "SELECT rowid, * FROM plans ORDER BY rowid", "SELECT * FROM events ORDER BY plan, seq")])  # fmt: skip
        finally:
            db.close()
    assert tables[0] == tables[1] and len(tables[0][0]) == 3
    updates = [s for s in statements if s.startswith("UPDATE plans")]
    assert updates and not any("FROM (VALUES" in s for s in updates)


def test_a_busy_groups_request_and_its_reply_each_cross_the_pipe_in_one_system_call(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 5,000-plan group goes out in one write and its reply (header and ~150 KB of keys) comes in one read."""
    child = ready_child(store)
    calls: list[tuple[str, int]] = []
    read, write, writev = os.read, os.write, os.writev

    def counted(name: str, call: Any) -> Any:
        def wrapped(fd: int, *args: Any) -> Any:
            if fd in (child._in, child._out):
                calls.append((name, fd))
            return call(fd, *args)

        return wrapped

    monkeypatch.setattr(writer_process.os, "read", counted("read", read))
    monkeypatch.setattr(writer_process.os, "write", counted("write", write))
    monkeypatch.setattr(writer_process.os, "writev", counted("write", writev))
    errors: list[BaseException | None] = []
    store.send([r for n in range(5000) for r in plan(f"plan-{n:05}", n)], errors.append)
    store.drain()
    monkeypatch.undo()
    assert errors == [None] and store.generation == 1
    assert calls.count(("write", child._out)) == 1
    assert calls.count(("read", child._in)) == 1


async def test_busy_groups_go_to_the_child_from_the_loop_with_no_writer_or_receiver_thread(store: SQLiteStore) -> None:
    """Process mode: a busy group is written by the loop and its reply read there; no thread of the store's runs."""
    seen, committer = started(store, inline_max_records=0)
    for n in range(1, 4):
        committer.submit(plan(f"p{n}", n), n)
    await released(seen, 3)
    assert seen == [1, 2, 3] and not seen.errors and store.generation >= 1
    assert not [t.name for t in threading.enumerate() if t.name.startswith("fleetwire-store")]
    await committer.close()


async def test_groups_the_pipe_has_no_room_for_wait_off_the_loop_and_are_committed_in_order(
    store: SQLiteStore,
) -> None:
    """The child stopped with ~3 MiB of groups sent: the loop never blocks on the full pipe (a timer still runs),
    and once the child goes on every group is committed and released in order."""
    seen, committer = started(store, inline_max_records=0)
    child = ready_child(store)
    os.kill(child.pid, signal.SIGSTOP)
    try:
        for n in range(1, 11):  # plans of ~300 KB of args each
            submit = Submit(req_id=n, op="echo", args={"blob": "x" * 300_000}, plan_id=f"big{n}")
            committer.submit([PlanCreated(f"big{n}", "alice", n, submit)], n)
        assert child.unsent_bytes > 0  # the pipe (1 MiB) is full: the rest waits for add_writer
        ticked = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, ticked.set)
        await asyncio.wait_for(ticked.wait(), 5)  # the loop turns meanwhile
        assert seen == []
    finally:
        os.kill(child.pid, signal.SIGCONT)
    await released(seen, 10)
    assert seen == list(range(1, 11)) and not seen.errors and not child.unsent_bytes
    await committer.close()


async def test_a_commit_is_found_and_released_while_the_loop_is_held_in_a_frame(store: SQLiteStore) -> None:
    """No loop turn after the send (the loop busy in a frame): reported() reads the child's answer from the pipe, and
    reap() releases it there and then."""
    seen, committer = started(store, inline_max_records=0)
    ready_child(store)
    committer.submit(plan("p1", 1), 1)
    deadline = time.monotonic() + 10
    while not committer.reported():  # the loop held here, as in CoreSession.take's checks between messages
        assert time.monotonic() < deadline, "the child's answer was never read"
        threading.Event().wait(0.001)
    committer.reap()
    assert seen == [1] and not seen.errors
    await committer.close()
