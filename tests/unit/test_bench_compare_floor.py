"""bench/compare.py's durable floor writes as many WAL frames as a lone plan's commit appends."""

from __future__ import annotations

from tests.bench_scripts import load


def test_the_floor_writes_the_frames_a_lone_commit_appends() -> None:
    """WAL_FRAMES_PER_COMMIT is what bench/store_writer.py --lone counts (1.18 at schema 6: the row's page, a split's
    now and then), rounded; it was 2 while the generation took store_meta's page too."""
    compare = load("compare.py", "bench_compare")
    store_writer = load("store_writer.py", "bench_store_writer")
    assert round(store_writer.wal_frames_per_commit(60)) == compare.WAL_FRAMES_PER_COMMIT
