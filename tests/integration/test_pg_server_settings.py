"""The settings the bench's and tests' PostgreSQL server (tests/pg.py) claims to run with are the server's.

bench/cluster_throughput.py says its figures are of a durable server (``fsync=on``, ``synchronous_commit=on``, full
page writes left on) and reads pg_stat_wal's write and sync times, which need ``track_wal_io_timing``; ``--pg-settings``
adds server settings for an A/B (docs/PERFORMANCE.md §C29q). Each is checked with SHOW on a started server.
"""

from __future__ import annotations

import argparse

import pytest

from tests import bench_scripts
from tests.pg import missing_reason, postgres_server

pytestmark = pytest.mark.timeout(120)


def test_the_bench_server_is_durable_times_its_wal_and_takes_more_settings() -> None:
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    bench = bench_scripts.load("cluster_throughput.py", "cluster_throughput")
    settings = bench._pg_settings(argparse.Namespace(pg_settings="wal_compression=lz4 max_wal_size=2GB"))
    with postgres_server(settings=settings) as server:
        shown = {name: server.sql_value(f"SHOW {name}") for name in
                 ("fsync", "synchronous_commit", "full_page_writes", "track_wal_io_timing", "wal_compression",
                  "max_wal_size")}  # fmt: skip
    assert shown == {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on", "track_wal_io_timing": "on",
                     "wal_compression": "lz4", "max_wal_size": "2GB"}  # fmt: skip


def test_each_bench_column_starts_with_wal_segments_ahead_unless_cold() -> None:
    """bench/cluster_throughput.py's fresh database for a PostgreSQL column comes with the server's WAL segments ahead
    recycled (tests/pg.py ``recycle_wal``), as a server in service has them, so no new 16 MiB segment is zero-filled
    inside the window (docs/PERFORMANCE.md §C29p); ``--cold-wal`` leaves the fresh server's none."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    bench = bench_scripts.load("cluster_throughput.py", "cluster_throughput")
    ahead_now = ("SELECT count(*) FROM pg_ls_waldir() WHERE name ~ '^[0-9A-F]{24}$' "
                 "AND name > pg_walfile_name(pg_current_wal_lsn())")  # fmt: skip
    with postgres_server() as server:
        cold: dict[str, object] = {}
        bench._database(server, argparse.Namespace(cold_wal=True), cold)
        assert "wal_segments_ahead" not in cold
        assert server.sql_value(ahead_now) == "0"  # a fresh server: the next segment is made when it is reached
        warm: dict[str, object] = {}
        dsn = bench._database(server, argparse.Namespace(cold_wal=False), warm)
        assert dsn.startswith("postgresql://")
        assert warm["wal_segments_ahead"] == int(server.sql_value(ahead_now)) >= 3  # min_wal_size's 80 MB: 4
