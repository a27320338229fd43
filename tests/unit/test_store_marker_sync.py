"""The generation side file's periodic fdatasync runs in a thread of its own, never in the committing thread."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from coordinator.io.stores import integrity
from coordinator.io.stores.integrity import GenerationMarker
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from coordinator.records import PlanCreated
from protocol.messages import Submit

_real_fdatasync = os.fdatasync


def test_a_due_sync_runs_in_the_syncer_thread_and_reaches_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first write finds a sync due: a thread other than the writer's fdatasyncs the marker file."""
    synced_in: list[str] = []
    done = threading.Event()

    def recording_fdatasync(fd: int) -> None:
        _real_fdatasync(fd)
        synced_in.append(threading.current_thread().name)
        done.set()

    monkeypatch.setattr(integrity.os, "fdatasync", recording_fdatasync)
    marker = GenerationMarker(tmp_path / DB_FILE, sync_interval_s=60)
    marker.write(7)
    assert done.wait(10)
    marker.close()
    assert synced_in == ["fleetwire-marker-sync"]
    assert (tmp_path / (DB_FILE + ".generation")).read_text() == "7".zfill(20) + "\n"


def test_a_slow_sync_never_blocks_write_and_a_failed_one_is_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the marker's fdatasync hangs, write() still returns; once it fails, the next write() raises it."""
    entered, go, failed = threading.Event(), threading.Event(), threading.Event()

    def hanging_then_failing(fd: int) -> None:
        entered.set()
        go.wait(10)
        threading.Timer(0, failed.set).start()  # the syncer records the error right after this raises
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(integrity.os, "fdatasync", hanging_then_failing)
    marker = GenerationMarker(tmp_path / DB_FILE, sync_interval_s=60)
    marker.write(1)
    assert entered.wait(10)
    marker.write(2)  # the sync is still hanging: this must not wait for it
    assert marker.read() == 2
    go.set()
    assert failed.wait(10)
    syncer = marker._syncer
    assert syncer is not None
    syncer.join(10)  # the syncer stops at the failure, after recording it
    with pytest.raises(OSError, match="Input/output error"):
        marker.write(3)
    marker.close()


def test_a_store_whose_marker_sync_failed_refuses_the_next_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store turns a failed background sync of its marker into a StoreError at the next commit (fail-stop)."""
    failed = threading.Event()

    def failing(fd: int) -> None:
        threading.Timer(0, failed.set).start()
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(integrity.os, "fdatasync", failing)
    store = SQLiteStore(tmp_path / DB_FILE)  # its marker's first sync (at open) fails in the background
    assert failed.wait(10)
    marker = store._marker
    assert marker is not None and marker._syncer is not None
    marker._syncer.join(10)
    with pytest.raises(integrity.StoreError, match="generation file"):
        store.write([PlanCreated("a", "alice", 1, Submit(req_id=1, op="echo", args=None, plan_id="a"))])
    monkeypatch.setattr(integrity.os, "fdatasync", _real_fdatasync)
    store.close()
