"""bench/compare.py's durable floor writes as many WAL frames as a lone plan's commit appends."""

from __future__ import annotations

import importlib
import os

import pytest

from tests.bench_scripts import load


def test_the_floor_writes_the_frames_a_lone_commit_appends() -> None:
    """WAL_FRAMES_PER_COMMIT is what bench/store_writer.py --lone counts (1.18 at schema 6: the row's page, a split's
    now and then), rounded; it was 2 while the generation took store_meta's page too."""
    compare = load("compare.py", "bench_compare")
    store_writer = load("store_writer.py", "bench_store_writer")
    assert round(store_writer.wal_frames_per_commit(60)) == compare.WAL_FRAMES_PER_COMMIT


def test_store_writer_times_the_floor_that_compare_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/store_writer.py --lone's bare fdatasync writes compare.py's frames a commit (imported, not a copy of
    them): it wrote two frames after the floor went to one."""
    store_writer = load("store_writer.py", "bench_store_writer")
    compare = importlib.import_module("compare")  # the name store_writer imports it by (bench/ is on sys.path)
    monkeypatch.setattr(compare, "WAL_FRAMES_PER_COMMIT", 3)
    written: list[int] = []
    pwrite = os.pwrite

    def counting(fd: int, data: bytes, offset: int) -> int:
        written.append(len(data))
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", counting)
    store_writer.fdatasync_commit(2)
    assert written == [3 * compare.WAL_FRAME] * 2
