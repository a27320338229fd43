"""The usage ledger's parts of the commit statement (0836534: pg_usage.py ``usage_params``, pg_schema.py
``commit_statement``'s ``usage_gone``/``usage_kept``) against the transaction they replaced, on a real PostgreSQL
server (tests/pg.py, skipped without one): for ticks of deletes only, upserts only, a key deleted then written again,
a key written then deleted, a key written twice with rows of other widths, in the one-shard and the many-shard fence
forms, the table ends as the old ``write_usage`` left it (a shorter row padded with zeros reads the same), and so do
its readers, ``load_usage`` and ``cluster_totals``. And the shards whose rows a tick deletes are fenced too: a core that
lost one of them (another coordinator took it over) deletes none of the new owner's rows."""

from __future__ import annotations

import pytest

from coordinator.io.cluster.leases import ShardFenced
from coordinator.io.stores.pg_usage import cluster_totals, load_usage
from coordinator.io.stores.postgres import PgStore
from coordinator.ledger import FIELDS
from coordinator.records import UsageRows
from tests.integration.test_pg_store import CLUSTER, hold, steal

pytestmark = pytest.mark.timeout(120)

Key = tuple[int, str, str]
_USAGE = "SELECT shard, hour, principal, team, totals FROM fleetwire_usage"
_SEED = "INSERT INTO fleetwire_usage VALUES ($1, $2, $3, $4, $5)"
# Every key on every shard: a key's rows on the core's other shards (summed into its own at the load) and beyond.
_KEYS: list[Key] = [(3600, "alice", "ml"), (7200, "bob", "web"), (0, "carol", "ops"), (10800, "dave", "ml")]

# Ticks (each a group's UsageRows, in order), by what they test.
_TICKS: dict[str, list[UsageRows]] = {
    "deletes only": [UsageRows([], [(3600, "alice", "ml"), (0, "carol", "ops")])],
    "upserts only": [UsageRows([(3600, "alice", "ml", [1.0, 2.0]), (99, "erin", "new", [4.0])], [])],
    "deleted then written": [UsageRows([], [(7200, "bob", "web")]), UsageRows([(7200, "bob", "web", [5.0, 6.0])], [])],
    "written then deleted": [UsageRows([(7200, "bob", "web", [5.0, 6.0])], []), UsageRows([], [(7200, "bob", "web")])],
    "deleted and written in one record": [UsageRows([(0, "carol", "ops", [7.0])], [(0, "carol", "ops")])],
    "written twice, other widths": [
        UsageRows([(3600, "alice", "ml", [1.0]), (10800, "dave", "ml", [1.0, 2.0, 3.0])], []),
        UsageRows([(3600, "alice", "ml", [8.0, 9.0])], [(10800, "dave", "ml")]),
        UsageRows([(10800, "dave", "ml", [2.0])], []),
    ],
}


def _old_write(table: dict[tuple[int, Key], list[float]], shards: list[int], ticks: list[UsageRows]) -> None:
    """The transaction of before (write_usage, e57f522), on a model of the table: the kept keys' rows deleted from
    the other shards, the deleted keys' from every shard, then each kept row upserted under the lowest shard."""
    deleted: list[Key] = []
    kept: dict[Key, list[float]] = {}
    for tick in ticks:
        for key in tick.deleted:
            deleted.append(key)
            kept.pop(key, None)
        for hour, principal, team, values in tick.rows:
            kept[hour, principal, team] = list(values)
    for key in kept:
        for shard in shards[1:]:
            table.pop((shard, key), None)
    for key in deleted:
        for shard in shards:
            table.pop((shard, key), None)
    for key, values in kept.items():
        table[shards[0], key] = values


def _padded(values: list[float]) -> list[float]:
    return [float(v) for v in values] + [0.0] * (len(FIELDS) - len(values))


@pytest.mark.parametrize("case", list(_TICKS))
@pytest.mark.parametrize("held", [[0], [0, 1, 2, 3]], ids=["one shard", "many shards"])
def test_a_ticks_rows_end_as_the_old_transaction_left_them(pg_dsn: str, case: str, held: list[int]) -> None:
    store = hold(PgStore(pg_dsn, CLUSTER))
    store.fence = {s: store.fence[s] for s in held}
    try:
        seed = {(s, k): [float(s + 1), 1.0] for s in range(CLUSTER.shards) for k in _KEYS}
        store.execute(lambda c: c.executemany(_SEED, [(s, *k, v) for (s, k), v in seed.items()]))
        expected = dict(seed)
        _old_write(expected, held, _TICKS[case])
        store.write(list(_TICKS[case]))  # the ledger's rows alone: the group's fence over the lowest shard
        got = {(r[0], (r[1], r[2], r[3])): _padded(r[4]) for r in store.execute(lambda c: c.fetch(_USAGE))}
        assert got == {k: _padded(v) for k, v in expected.items()}
        # The readers: a shard's load (summed per key) and the cluster's sums, as from the old transaction's rows.
        loaded = store.execute(lambda c: load_usage(c, held))
        want: dict[Key, list[float]] = {}
        for (shard, key), values in expected.items():
            if shard in held:
                want[key] = [a + b for a, b in zip(want.get(key, [0.0] * len(FIELDS)), _padded(values), strict=True)]
        assert {(r.hour_s, r.principal, r.team): _padded(r.values()) for r in loaded} == want
        totals, _ = store.execute(lambda c: cluster_totals(c))
        sums: dict[str, float] = {}
        for (_, (_, principal, _)), values in expected.items():
            sums[principal] = sums.get(principal, 0.0) + sum(values)
        assert {name: sum(float(getattr(t, f)) for f in FIELDS) for name, t in totals.items()} == pytest.approx(sums)
    finally:
        store.close()


def test_a_stale_owner_of_another_shard_deletes_none_of_its_rows(pg_dsn: str) -> None:
    """A core holding every shard writes a tick (alice's row, and carol's key deleted) after another coordinator took
    shard 2 over, whose owner now keeps alice's and carol's rows there. The tick's group touches no plan of shard 2,
    but its usage parts delete alice's and carol's rows from the core's other shards, 2 among them: the group is
    fenced on shard 2 too, so it fails with ShardFenced naming it and deletes nothing (before: the ledger's shard 0
    only was fenced, and the stale core deleted the new owner's rows of shard 2: its usage lost)."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        rows = [(2, 3600, "alice", "ml", [3.0]), (2, 0, "carol", "ops", [4.0]), (1, 0, "carol", "ops", [5.0])]
        store.execute(lambda c: c.executemany(_SEED, rows))
        steal(store, 2)  # the store's fence still names shard 2 at the old epoch: stale until its keeper sees it
        with pytest.raises(ShardFenced, match=r"shard\(s\) \[2\] is no longer"):
            store.write([UsageRows([(3600, "alice", "ml", [1.0])], [(0, "carol", "ops")])])
        got = sorted(tuple(r) for r in store.execute(lambda c: c.fetch(_USAGE)))
        assert got == sorted(rows)  # nothing deleted, nothing written
    finally:
        store.close()
