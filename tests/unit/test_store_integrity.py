"""Store integrity on real SQLite files: checksums, generation, -wal watch, salvage, backup/restore/check.

Damage is injected into the files the store wrote (byte flips, a truncated or deleted ``-wal``,
a garbage header) and each test asserts that it is never served silently (issue #18).
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import msgspec
import pytest

from coordinator.io.stores.admin import backup_store, check_store, restore_store
from coordinator.io.stores.commit import GroupCommitter
from coordinator.io.stores.integrity import EXIT_STORE_DAMAGED, StoreDamaged, StoreError
from coordinator.io.stores.schema import SCHEMA_VERSION
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from coordinator.records import PlanCreated, PlanStatus, Record
from fleetwire.cli import store as cli_store
from fleetwire.cli.main import build_parser
from protocol.messages import Event, Submit


def created(plan_id: str, order: int, args: Any = None) -> PlanCreated:
    return PlanCreated(plan_id, "alice", order, Submit(req_id=1, op="echo", args=args, plan_id=plan_id))


def event(plan_id: str, seq: int, data: Any = None) -> Event:
    return Event(plan_id=plan_id, kind="log", data=data, seq=seq, attempt=1)


def lifecycle(plan_id: str, order: int) -> list[list[Record]]:
    """Three groups of one plan: submitted, running (inline events), succeeded with a result."""
    return [
        [created(plan_id, order, args={"marker": f"ARGS-{plan_id}"}), event(plan_id, 1, "queued"),
         PlanStatus(plan_id, "queued", next_seq=2)],
        [event(plan_id, 2, f"EVENT-{plan_id}"), PlanStatus(plan_id, "running", 1, "w", next_seq=3)],
        [event(plan_id, 3, "done"), PlanStatus(plan_id, "succeeded", 1, "w", next_seq=4, result=f"RESULT-{plan_id}")],
    ]  # fmt: skip


def fill(path: Path, n: int = 5, *, close: bool = True) -> SQLiteStore:
    """A store with ``n`` finished plans p0..p(n-1) and one long stream (events rows) on plan ``long``."""
    store = SQLiteStore(path)
    for i in range(n):
        for group in lifecycle(f"p{i}", i + 1):
            store.write(group)
    store.write([created("long", n + 1), *[event("long", s, f"SPILL-{s}" * 10) for s in range(1, 40)],
                 PlanStatus("long", "running", 1, "w", next_seq=40)])  # fmt: skip
    if close:
        store.close()  # the last connection checkpoints: everything is in the main file
    return store


def flip(path: Path, needle: bytes, offset: int = 2) -> None:
    """Flip one byte inside the first occurrence of ``needle`` in the file."""
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at >= 0, needle
    data[at + offset] ^= 0x20
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("needle", "what"),
    [
        (b"ARGS-p3", "its submit fails its checksum"),
        (b"RESULT-p2", "its status fails its checksum"),
        (b"EVENT-p1", "its events fail their checksum"),
        (b"SPILL-5", "its events from seq 1 fail their checksum"),
    ],
)
def test_a_flipped_payload_byte_is_named_with_the_plan_and_the_file(tmp_path: Path, needle: bytes, what: str) -> None:
    """A byte flipped in a submit, a status, inline events or an events row: load refuses and names plan and file."""
    path = tmp_path / DB_FILE
    fill(path)
    flip(path, needle)
    store = SQLiteStore(path)  # SQLite's own quick_check passes payload flips
    try:
        with pytest.raises(StoreDamaged) as info:
            store.load()
    finally:
        store.close()
    message = str(info.value)
    plan = "long" if needle.startswith(b"SPILL") else needle.decode().split("-")[1]
    assert f"plan {plan!r}: {what}" in message and str(path) in message
    assert "fleetwire store restore" in message and "--accept-store-loss" in message and "\n" not in message


def test_accept_store_loss_drops_the_damaged_plan_only_and_leaves_a_clean_file(tmp_path: Path) -> None:
    """With accept_loss the damaged plan is dropped (and deleted), the others load, and the next start is clean."""
    path = tmp_path / DB_FILE
    fill(path)
    flip(path, b"RESULT-p2")
    store = SQLiteStore(path, accept_loss=True)
    plans = store.load()
    assert [p.created.plan_id for p in plans] == ["p0", "p1", "p3", "p4", "long"]
    assert len(store.losses) == 1 and "'p2'" in store.losses[0]
    store.close()
    again = SQLiteStore(path)
    assert len(again.load()) == 5 and again.losses == []
    again.close()


def _crash_copy(store: SQLiteStore, dest: Path) -> Path:
    """The files as a kill -9 leaves them: database, -wal and generation file, copied while the store is open."""
    dest.mkdir()
    for suffix in ("", "-wal", ".generation"):
        shutil.copyfile(store.path.with_name(store.path.name + suffix), dest / (DB_FILE + suffix))
    return dest / DB_FILE


@pytest.mark.parametrize("keep", [0.25, 0.5, 0.9, -100])
def test_a_truncated_wal_after_a_crash_is_found_behind_the_generation(tmp_path: Path, keep: float) -> None:
    """The -wal cut at several points (torn or lost writes): the start names the lost commits instead of serving."""
    store = fill(tmp_path / "live" / DB_FILE, close=False)
    copy = _crash_copy(store, tmp_path / "crash")
    store.close()
    wal = copy.with_name(copy.name + "-wal")
    size = wal.stat().st_size
    with open(wal, "r+b") as f:
        f.truncate(int(size * keep) if keep > 0 else size + int(keep))
    with pytest.raises(StoreDamaged, match=r"holds \d+ commits but .*generation says 16 were acknowledged"):
        SQLiteStore(copy)


def test_a_deleted_wal_after_a_crash_is_found_and_accepting_it_starts_from_the_file(tmp_path: Path) -> None:
    """-wal deleted after a kill -9: refused; --accept-store-loss starts from the main file and says so."""
    store = fill(tmp_path / "live" / DB_FILE, close=False)
    copy = _crash_copy(store, tmp_path / "crash")
    store.close()
    copy.with_name(copy.name + "-wal").unlink()
    with pytest.raises(StoreDamaged, match="acknowledged"):
        SQLiteStore(copy)
    accepted = SQLiteStore(copy, accept_loss=True)
    assert len(accepted.losses) == 1 and "are lost" in accepted.losses[0]
    accepted.load()
    accepted.close()
    SQLiteStore(copy).close()  # accepted once: the generation file now follows the database


@pytest.mark.parametrize(("how", "said"), [("deleted", "deleted"), ("recreated", "deleted"), ("replaced", "replaced")])
def test_wal_deleted_or_replaced_under_a_running_store_stops_the_writer(tmp_path: Path, how: str, said: str) -> None:
    """The -wal removed or swapped while running: the check after the next commit raises (no reply released).

    Deleted and then created anew at its name (as a writer process that opens the file after the deletion
    does) is "deleted": the file the store writes into has no name left; renamed away, "replaced".
    """
    store = fill(tmp_path / DB_FILE, n=1, close=False)
    wal = store.path.with_name(store.path.name + "-wal")
    if how == "replaced":
        wal.rename(wal.with_name(wal.name + ".aside"))
    else:
        wal.unlink()
    if how != "deleted":
        wal.write_bytes(b"")
    store.write([created("after", 99)])  # committed into the deleted file: its reply must not go out
    with pytest.raises(StoreDamaged, match=f"-wal was {said} while the coordinator was running"):
        store.check_files()
    store.close()


async def test_wal_deleted_under_the_group_committer_is_a_fail_stop(tmp_path: Path) -> None:
    """Through the writer thread: the committer reports the failure and releases nothing more."""
    store = fill(tmp_path / DB_FILE, n=1, close=False)
    released: list[int] = []
    failures: list[BaseException] = []
    committer: GroupCommitter[int] = GroupCommitter(store, released.append, failures.append, file_check_interval_s=0)
    committer.start()
    committer.submit([created("a", 10)], 1)
    await committer.close()
    store.path.with_name(store.path.name + "-shm").unlink()
    committer.start()
    committer.submit([created("b", 11)], 2)
    await committer.close()
    store.close()
    assert released == [1] and len(failures) == 1 and "-shm was deleted" in str(failures[0])


def test_generation_counts_groups_not_records(tmp_path: Path) -> None:
    """One write of many records is one generation; the side file follows the database."""
    store = SQLiteStore(tmp_path / DB_FILE)
    start = store.generation
    store.write([r for i in range(50) for r in lifecycle(f"q{i}", i + 1)[0]])
    assert store.generation == start + 1
    assert int((tmp_path / (DB_FILE + ".generation")).read_text()) == start + 1
    store.close()


def test_inline_checksum_runs_on_across_reopens_with_and_without_load(tmp_path: Path) -> None:
    """Inline events appended after a reopen (with or without a load first) still verify."""
    path = tmp_path / DB_FILE
    store = SQLiteStore(path)
    store.write(lifecycle("p", 1)[0])
    store.close()
    store = SQLiteStore(path)  # no load: the writer reads the plan's checksum back
    store.write(lifecycle("p", 1)[1])
    store.close()
    store = SQLiteStore(path)
    store.load()
    store.write(lifecycle("p", 1)[2])
    store.write([event("p", 4, "after the end"), PlanStatus("p", "succeeded", 1, "w", next_seq=5)])
    store.close()
    store = SQLiteStore(path)
    (plan,) = store.load()
    store.close()
    assert [e.seq for e in plan.events] == [1, 2, 3, 4]


def test_garbage_header_is_refused_and_accepting_it_sets_the_file_aside(tmp_path: Path) -> None:
    """A file SQLite cannot open: one-line refusal; with accept_loss the file is kept aside and the store restarts."""
    path = tmp_path / DB_FILE
    fill(path)
    data = bytearray(path.read_bytes())
    data[0:100] = b"\xff" * 100
    path.write_bytes(bytes(data))
    with pytest.raises(StoreDamaged, match="not a database"):
        SQLiteStore(path)
    store = SQLiteStore(path, accept_loss=True)
    assert store.load() == [] and "kept as" in store.losses[0]
    store.close()
    assert list(tmp_path.glob(f"{DB_FILE}.damaged-*"))


def test_a_damaged_btree_page_fails_quick_check_and_salvage_keeps_the_other_pages(tmp_path: Path) -> None:
    """A page of the plans table overwritten: quick_check refuses; accept_loss rebuilds from the readable rows."""
    path = tmp_path / DB_FILE
    store = SQLiteStore(path)
    for i in range(400):  # several pages of plans
        store.write(lifecycle(f"p{i}", i + 1)[0])
    store.close()
    data = bytearray(path.read_bytes())
    page = 4096
    at = data.find(b"ARGS-p200")
    start = at - at % page
    data[start:start + page] = b"\x07" * page
    path.write_bytes(bytes(data))
    with pytest.raises(StoreDamaged, match=r"quick_check|malformed"):
        SQLiteStore(path)
    store = SQLiteStore(path, accept_loss=True)
    plans = store.load()
    store.close()
    assert 300 < len(plans) < 400 and "p200" not in {p.created.plan_id for p in plans}
    assert check_store(path).sound


def test_a_version_3_file_is_migrated_with_checksums(tmp_path: Path) -> None:
    """A version 3 file gets checksums for what it holds; a later flip in it is then found."""
    path = tmp_path / DB_FILE
    encode = msgspec.msgpack.encode
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE plans (id TEXT NOT NULL, owner TEXT NOT NULL, ord INTEGER NOT NULL, state TEXT NOT NULL,"
        " spec BLOB NOT NULL, status BLOB, events BLOB, nevents INTEGER NOT NULL DEFAULT 0);"
        "CREATE TABLE events (plan INTEGER NOT NULL, seq INTEGER NOT NULL, body BLOB NOT NULL,"
        " PRIMARY KEY (plan, seq)) WITHOUT ROWID; PRAGMA user_version=3;"
    )
    inline = encode([("log", "INLINE-a", 1, 1, False)])[1:]
    conn.execute("INSERT INTO plans VALUES ('a', 'alice', 1, 'queued', ?, ?, ?, 1)",
                 (encode(created("a", 1, "ARGS-a")), encode(PlanStatus("a", "queued", next_seq=2)), inline))
    conn.execute("INSERT INTO events VALUES (1, 2, ?)", (encode([("log", "ROW-a", 2, 1, False)]),))
    conn.commit()
    conn.close()
    store = SQLiteStore(path)
    (plan,) = store.load()
    store.close()
    assert [e.data for e in plan.events] == ["INLINE-a", "ROW-a"]
    assert check_store(path).sound and check_store(path).version == SCHEMA_VERSION
    flip(path, b"ROW-a")
    assert not check_store(path).sound


def test_backup_while_open_restore_refused_while_locked_then_restored(tmp_path: Path) -> None:
    """Online backup; restore refuses while a coordinator holds the lock, then puts the backup in, old -wal aside."""
    path = tmp_path / "data" / DB_FILE
    store = fill(path, close=False)
    report = backup_store(path, tmp_path / "backup.sqlite3")
    assert report.sound and sum(report.plans.values()) == 6
    with pytest.raises(StoreError, match="stop it before restoring"):
        restore_store(tmp_path / "backup.sqlite3", path)
    store.write(lifecycle("newer", 50)[0])  # after the backup: lost by the restore, on purpose
    store.close()
    path.with_name(DB_FILE + "-wal").write_bytes(b"stale wal")  # an old -wal must not be replayed into the backup
    _, aside = restore_store(tmp_path / "backup.sqlite3", path)
    assert aside is not None and aside.with_name(aside.name + "-wal").read_bytes() == b"stale wal"
    restored = SQLiteStore(path)  # the generation file follows the backup: not "behind"
    assert [p.created.plan_id for p in restored.load()] == [*(f"p{i}" for i in range(5)), "long"]
    restored.close()


def test_restore_refuses_a_damaged_backup(tmp_path: Path) -> None:
    path = tmp_path / "data" / DB_FILE
    fill(path)
    backup_store(path, tmp_path / "b.sqlite3")
    flip(tmp_path / "b.sqlite3", b"ARGS-p1")
    with pytest.raises(StoreError, match="pick another backup"):
        restore_store(tmp_path / "b.sqlite3", path)


def main(argv: list[str]) -> int:
    """``fleetwire ARGV`` without configure_logging (which would bind this test's captured stderr)."""
    ns = build_parser().parse_args(argv)
    status: int = asyncio.run(ns.func(ns))
    return status


def test_store_cli_check_backup_restore_exit_statuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`fleetwire store check` 0 sound / 3 damaged; backup and restore through the CLI."""
    data = tmp_path / "data"
    fill(data / DB_FILE)
    assert main(["store", "check", "--data-dir", str(data)]) == 0
    assert "6 plans" in capsys.readouterr().out
    assert main(["store", "backup", str(tmp_path / "b.sqlite3"), "--data-dir", str(data)]) == 0
    assert main(["store", "backup", str(tmp_path / "b.sqlite3"), "--data-dir", str(data)]) == 2
    flip(data / DB_FILE, b"RESULT-p0")
    assert main(["store", "check", "--data-dir", str(data), "--full"]) == EXIT_STORE_DAMAGED
    assert "DAMAGED: plan 'p0'" in capsys.readouterr().out
    assert main(["store", "restore", str(tmp_path / "b.sqlite3"), "--store", f"sqlite:{data / DB_FILE}"]) == 0
    assert main(["store", "check", "--data-dir", str(data), "--json"]) == 0


def test_exit_status_constants_agree() -> None:
    assert cli_store.EXIT_STORE_DAMAGED == EXIT_STORE_DAMAGED
