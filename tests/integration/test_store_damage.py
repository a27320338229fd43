"""A real ``fleetwire coordinator`` process on a store damaged the way an operator's bad day damages it.

Plans are acknowledged by a running coordinator, the coordinator is killed -9, the store's files
are damaged (the ``-wal`` cut or deleted, with or without its generation file, a payload byte flipped), and the
next start must refuse with one line and exit 3, or with ``--accept-store-loss`` start, log and count the loss on
/metrics.
The -wal deleted under a running coordinator stops it (exit 1) at the first commit 10 ms or more after the last check,
or at the store's writer process's open when it starts after the deletion (SQLite's "disk I/O error" there): either
way naming the deletion.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.io.stores.commit import GroupCommitter
from coordinator.io.stores.integrity import StoreDamaged
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from coordinator.records import PlanCreated
from fleetwire.sync import SyncClient
from protocol.messages import Submit

ROOT = Path(__file__).resolve().parents[2]


class Coordinator:
    """``python -m fleetwire coordinator --insecure --port 0`` on ``data_dir``."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleetwire", "coordinator", "--insecure", "--port", "0",
             "--data-dir", str(data_dir), "--log-format", "json", *extra],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.url = ""

    def wait_listening(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        m = re.search(r"listening on (ws://\S+)", line)
        assert m, (line, self.proc.stderr.read() if self.proc.stderr else "")
        self.url = m.group(1)
        return self.url

    def finish(self, timeout_s: float = 30.0) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout_s)
        return self.proc.returncode, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate(timeout=30)


@pytest.fixture
def acknowledged(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A data dir whose coordinator acknowledged 300 plans (in many group commits) and was then killed -9."""
    coordinator = Coordinator(tmp_path)
    try:
        url = coordinator.wait_listening()
        with SyncClient(url) as client:
            for i in range(30):
                client.submit_many("echo", [{"marker": f"ARGS-{i}-{j}"} for j in range(10)])
    finally:
        coordinator.kill()
    assert (tmp_path / (DB_FILE + "-wal")).stat().st_size > 0
    yield tmp_path, 300


def _refused(data_dir: Path) -> str:
    rc, err = Coordinator(data_dir).finish()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 3, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(data_dir / DB_FILE) in lines[0] and "fleetwire store restore" in lines[0]
    assert "--accept-store-loss" in lines[0]
    return lines[0]


@pytest.mark.parametrize("keep", [0.3, 0.7, 0.95])
def test_a_truncated_wal_is_refused_with_one_line_and_exit_3(acknowledged: tuple[Path, int], keep: float) -> None:
    """Finding 1: the -wal cut after a kill -9 (a torn or lost write) no longer starts silently."""
    data_dir, _ = acknowledged
    wal = data_dir / (DB_FILE + "-wal")
    os.truncate(wal, int(wal.stat().st_size * keep))
    assert "were acknowledged" in _refused(data_dir)


def test_a_truncated_wal_with_the_generation_file_deleted_is_refused(acknowledged: tuple[Path, int]) -> None:
    """Issue #25 part 4: the -wal cut after a kill -9 and the generation file gone too: refused, exit 3."""
    data_dir, _ = acknowledged
    wal = data_dir / (DB_FILE + "-wal")
    os.truncate(wal, int(wal.stat().st_size * 0.5))
    (data_dir / (DB_FILE + ".generation")).unlink()
    assert "is missing or empty" in _refused(data_dir)


def test_a_deleted_wal_is_refused_then_accepted_and_counted(acknowledged: tuple[Path, int]) -> None:
    """Finding 2 (after the kill): refused; --accept-store-loss starts, logs and counts it on /metrics."""
    data_dir, _ = acknowledged
    (data_dir / (DB_FILE + "-wal")).unlink()
    _refused(data_dir)
    coordinator = Coordinator(data_dir, "--accept-store-loss")
    try:
        url = coordinator.wait_listening().replace("ws://", "http://")
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert re.search(r"^fleetwire_store_loss_accepted_total 1\.0$", metrics, re.M), metrics
    finally:
        coordinator.proc.send_signal(signal.SIGTERM)
        rc, err = coordinator.finish()
    assert rc in (0, -signal.SIGTERM) and "store damage accepted" in err  # SIGTERM may beat the handler
    again = Coordinator(data_dir)  # accepted once: the next start is clean
    try:
        again.wait_listening()
    finally:
        again.kill()


def test_a_flipped_payload_byte_is_refused_naming_the_plan(acknowledged: tuple[Path, int]) -> None:
    """Finding 3: a flipped byte in a plan's args (which SQLite's checks pass) is named, not served."""
    data_dir, _ = acknowledged
    db = data_dir / DB_FILE
    fold = "import sqlite3; c = sqlite3.connect({!r}); c.execute('PRAGMA wal_checkpoint(TRUNCATE)'); c.close()"
    subprocess.run([sys.executable, "-c", fold.format(str(db))], check=True)  # the -wal folded into the file
    data = bytearray(db.read_bytes())
    at = data.find(b"ARGS-7-3")
    assert at > 0
    data[at + 5] ^= 0x01
    db.write_bytes(bytes(data))
    assert "checksum" in _refused(data_dir)


def test_an_unreadable_store_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """Finding 4: a file that is not a database: one line, exit 3."""
    (tmp_path / DB_FILE).write_bytes(b"this is not a database" * 500)
    assert "not a database" in _refused(tmp_path)


def test_wal_deleted_under_a_running_coordinator_stops_it(tmp_path: Path) -> None:
    """Finding 2 (while running): the next commit stops the coordinator (exit 1) instead of acknowledging."""
    coordinator = Coordinator(tmp_path)
    try:
        url = coordinator.wait_listening()
        client = SyncClient(url)
        client.submit("echo", {"n": 1})
        (tmp_path / (DB_FILE + "-wal")).unlink()
        # A commit at least 10 ms after the last check finds the -wal gone: the coordinator stops. The
        # submitting thread ends at the first error (the coordinator gone), and is joined here: left
        # running, its client's reconnect gives up minutes later inside some other test.
        stop = threading.Event()

        def keep_submitting() -> None:
            for n in range(2, 500):
                if stop.is_set():
                    return
                try:
                    client.submit("echo", {"n": n})
                except Exception:  # the coordinator gone, or the client closed under it
                    return
                stop.wait(0.02)

        submitter = threading.Thread(target=keep_submitting, daemon=True)
        submitter.start()
        deadline = time.monotonic() + 20
        while coordinator.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        rc, err = coordinator.finish()
    finally:
        coordinator.kill()
    stop.set()
    client.close()
    submitter.join(timeout=30)
    assert not submitter.is_alive()
    assert rc == 1 and "was deleted while the coordinator was running" in err


@pytest.mark.timeout(60)
async def test_a_writer_process_that_opens_after_the_wal_was_deleted_stops_the_store_naming_the_deletion(
    tmp_path: Path,
) -> None:
    """The writer process's open fails on the missing -wal with "disk I/O error": the store reports "was deleted"."""
    store = SQLiteStore(tmp_path / DB_FILE)
    try:
        store.write([PlanCreated("p1", "alice", 1, Submit(req_id=1, op="echo", args={}, plan_id="p1"))])
        (tmp_path / (DB_FILE + "-wal")).unlink()  # before the child opens the file (it recreates an empty -wal)
        store.hand_writes_to_process()
        released: list[int] = []
        errors: list[BaseException] = []
        failed = asyncio.Event()

        def on_failure(exc: BaseException) -> None:
            errors.append(exc)
            failed.set()

        # Every group through the writer thread to the child (none on the loop): the child's open is what fails.
        committer: GroupCommitter[int] = GroupCommitter(store, released.append, on_failure, inline_max_records=0)
        committer.start()
        committer.submit([PlanCreated("p2", "alice", 2, Submit(req_id=2, op="echo", args={}, plan_id="p2"))], 2)
        await asyncio.wait_for(failed.wait(), 30)
        await committer.close()
    finally:
        store.close()
    assert released == [] and len(errors) == 1
    assert isinstance(errors[0], StoreDamaged), errors[0]
    assert "-wal was deleted while the coordinator was running" in str(errors[0])
