"""A PostgreSQL group's row making alone: ``PgRows.encode_rows`` in callgrind instructions a plan (issue #29, §C29t).

``python bench/pg_encode_rows.py``: the groups of a busy committer (bench/cluster_throughput.py ``_grouped``: 2,400
plans' 4 steps, groups of ~2,700 records) gathered as the store gathers them (postgres.py ``PgStore._gather``),
then each encoded and applied as committed (``encode_rows``, ``apply_committed``), no database: this script re-runs
itself under callgrind with only ``encode_rows`` counted (``--toggle-collect`` on its C function), so the figure is
that method's inclusive instructions a plan (its msgpack encodes, CRC-32s, look-ups and the columns' lists), whatever
the host's load; run it with ``PYTHONPATH`` set to a compiled copy (tools/build_compiled.py), from the copy. Pure
Python has no C function to count from: there the figure is a whole run less one that gathers the same groups and
encodes none, so ``apply_committed`` is in it too. ``--dump FILE`` (no callgrind) pickles every group's rows, to check
that two trees make the same rows. ``--plans`` sets the count (a multiple of 300).
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import msgspec
from cluster_throughput import GROUP_BLOCK, _grouped

from coordinator.io.stores.pg_rows import PgRows, RowGroup
from coordinator.io.stores.rows import group_records
from coordinator.shards import ClusterConfig, SubmitShards


class _Rows(PgRows):
    """PgRows with what PgStore gives it (an encoder, the shard of a submit, the write-side keys), no database."""

    def __init__(self) -> None:
        config = ClusterConfig()
        self._encoder = msgspec.msgpack.Encoder()
        self._submit_shard = SubmitShards(config.shards, config.partitions)
        self._keys, self._shards, self._events_crc = {}, {}, {}

    def gather(self, records: list[Any]) -> RowGroup:
        """postgres.py ``PgStore._gather``'s group (no forgotten plans in these groups)."""
        created, latest, runs, forgotten = group_records(records, [])
        group = RowGroup(records, created, latest, runs, forgotten)
        group.fresh_ids = [p for p in created if p not in self._keys or p in forgotten]
        return group


def encode_all(plans: int, dump: str | None = None, encode: bool = True) -> None:
    """``plans`` plans' groups, each encoded and applied in turn (keys from 1, as a fresh sequence); ``encode``
    False: gathered only."""
    rows = _Rows()
    groups = [rows.gather(g) for g in _grouped(plans)]
    gc.freeze()
    if not encode:
        return
    made: list[Any] = []
    key = 1
    for group in groups:
        keys = list(range(key, key + len(group.fresh_ids)))
        key += len(keys)
        if rows.encode_rows(group, keys, {}):
            raise SystemExit("a group needed a stored checksum: not this bench's groups")
        rows.apply_committed(group)
        if dump is not None:
            made.append(group.rows)
    if dump is not None:
        Path(dump).write_bytes(pickle.dumps(made))


def _collected(*args: str) -> int:
    """The instructions callgrind counted in a run of this script with ``args``."""
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *args]
    run = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, "PYTHONHASHSEED": "0"})
    found = re.search(r"Collected : (\d+)", run.stderr)
    if found is None or run.returncode:
        raise SystemExit(f"callgrind gave no count (exit {run.returncode}): {run.stderr[-500:]}")
    return int(found.group(1))


def callgrind(plans: int, compiled: bool) -> float:
    """encode_rows' inclusive instructions a plan: compiled, counted only inside its C function; pure, a run less
    one that encodes nothing."""
    me = [sys.executable, __file__, "--plans", str(plans), "--inside"]
    if compiled:  # CPyDef_<module>___PgRows___encode_rows (its CPyPy_ wrapper would toggle it off again inside)
        return _collected("--toggle-collect=CPyDef_*PgRows___encode_rows", *me) / plans
    return (_collected(*me) - _collected(*me, "--gather-only")) / plans


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=8 * GROUP_BLOCK, help="plans (a multiple of 300; default 2400)")
    parser.add_argument("--dump", metavar="FILE", help="pickle the groups' rows to FILE (no callgrind)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # the run under callgrind
    parser.add_argument("--gather-only", action="store_true", help=argparse.SUPPRESS)  # pure: the run less encode_rows
    ns = parser.parse_args()
    if ns.inside or ns.dump:
        encode_all(ns.plans, ns.dump, not ns.gather_only)
        return 0
    from coordinator.io.stores import pg_rows

    compiled = not pg_rows.__file__.endswith(".py")
    figure = callgrind(ns.plans, compiled)
    build = "compiled, encode_rows alone" if compiled else "pure, encode_rows and apply_committed"
    print(f"encode_rows ({build}): {figure:,.0f} instructions a plan over {ns.plans:,} plans' groups")
    return 0


if __name__ == "__main__":
    sys.exit(main())
