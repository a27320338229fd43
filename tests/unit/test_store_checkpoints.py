"""SQLite's WAL checkpoints off the event loop: the loop's commits (``try_write``) never copy the WAL into the file;
the writer's commits (a writer thread's ``write``, the writer process's) do, past SQLite's bound; with the committer
handing the writer a group at least every ``inline_run_max`` commits, the WAL stays bounded and every plan loads back.

Real SQLite files (docs/PERFORMANCE.md §P29: the checkpoint was one lone commit in ~900 on the loop, 3-20 ms).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from coordinator.io.stores.commit import GroupCommitter
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.sqlite_commit import WAL_AUTOCHECKPOINT
from coordinator.io.stores.store import DB_FILE
from coordinator.records import PlanCreated, Record
from protocol.messages import Submit

WAL_FRAME = 24 + 4096  # a frame's header and a page of SQLite's default size


def created(n: int) -> list[Record]:
    plan_id = f"plan-{n:06d}"
    return [PlanCreated(plan_id, "alice", n, Submit(req_id=n, op="echo", args=n, plan_id=plan_id))]


def sizes(store: SQLiteStore) -> tuple[int, int]:
    """The database file's size and its -wal's (the WAL's high-water mark: SQLite reuses it from its top)."""
    wal = store.path.with_name(store.path.name + "-wal")
    return store.path.stat().st_size, wal.stat().st_size


def test_commits_on_the_loop_never_checkpoint_and_the_writers_next_commit_does(tmp_path: Path) -> None:
    """Lone try_write commits past SQLite's bound leave the file as it was (the WAL grows); a write() checkpoints."""
    store = SQLiteStore(tmp_path / DB_FILE)
    try:
        store.load()
        store.write(created(0))  # the schema's pages copied by this first checkpointing commit, if at all
        file_before, _ = sizes(store)
        count = WAL_AUTOCHECKPOINT + 100
        for n in range(1, count + 1):
            assert store.try_write(created(n))
        file_after, wal = sizes(store)
        assert file_after == file_before  # nothing copied into the file by the loop's commits
        assert wal >= count * WAL_FRAME  # ... which went on past SQLite's bound
        store.write(created(count + 1))  # the writer thread's commit, past the bound: it checkpoints
        assert sizes(store)[0] > file_before
    finally:
        store.close()
    again = SQLiteStore(tmp_path / DB_FILE)
    try:
        assert len(again.load()) == count + 2
    finally:
        again.close()


def test_the_writer_process_checkpoints_what_the_loops_commits_left(tmp_path: Path) -> None:
    """With a writer process, the parent's lone commits leave the WAL to the child, whose next commit copies it."""
    store = SQLiteStore(tmp_path / DB_FILE)
    try:
        store.load()
        store.hand_writes_to_process()
        assert store._child is not None
        store._child.wait_ready()
        file_before, _ = sizes(store)
        count = WAL_AUTOCHECKPOINT + 100
        for n in range(1, count + 1):
            assert store.try_write(created(n))
        assert sizes(store)[0] == file_before
        store.write(created(count + 1))  # committed by the child
        assert sizes(store)[0] > file_before
    finally:
        store.close()
    again = SQLiteStore(tmp_path / DB_FILE)
    try:
        assert len(again.load()) == count + 1
    finally:
        again.close()


async def test_the_wal_stays_bounded_under_a_run_of_lone_commits(tmp_path: Path) -> None:
    """A sequential client's lone groups through the committer: the WAL never passes SQLite's bound by more than a
    run of inline commits, and the file takes the plans (the writer thread's checkpoints)."""
    store = SQLiteStore(tmp_path / DB_FILE)
    store.load()
    run = 100
    done = asyncio.Event()

    def release(payload: Any) -> None:
        done.set()

    committer: GroupCommitter[int] = GroupCommitter(store, release, lambda exc: None, inline_slow_s=60,
                                                    inline_run_max=run)  # fmt: skip
    committer.start()
    count = 2 * WAL_AUTOCHECKPOINT + 300
    try:
        for n in range(count):
            done.clear()
            committer.submit(created(n), n)
            await asyncio.wait_for(done.wait(), 10)
        await committer.close()
        file_size, wal = sizes(store)
    finally:
        store.close()
    assert committer.inline_commits >= count - count // run - 1  # the writer got one group a run
    assert wal <= (WAL_AUTOCHECKPOINT + run + 10) * WAL_FRAME
    assert file_size > 40 * 4096  # checkpointed more than once: the plans' pages are in the file
    again = SQLiteStore(tmp_path / DB_FILE)
    try:
        assert len(again.load()) == count
    finally:
        again.close()
