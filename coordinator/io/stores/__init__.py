"""The stores: where the coordinator keeps plans across restarts (docs/SEMANTICS.md §Durability).

* store: the ``Store`` interface, ``MemoryStore`` and ``open_store``; abilities: what a backend
  declares beyond load, write and close (``StoreAbilities``: nobody probes a store);
* sqlite: the SQLite store (the default);
* writer_process, writer_child, writer_wire, writer_pipes, child_process: the SQLite store's writes in a child
  process (``--store-writer process``): the parent's end, the child, the wire between them, the pipes' parent
  ends, and the child's start and end;
* postgres: cluster mode's PostgreSQL store (docs/CLUSTER.md); pg_schema: its tables and statements;
* schema, rows: the SQLite tables and migrations; rows read back with their checksums;
* integrity: how damage is noticed and salvaged (``--accept-store-loss``);
* commit, pg_commit, backlog: group commit off the event loop (SQLite) and on it (PostgreSQL),
  and the backpressure both keep;
* admin: ``fleetwire store check | backup | restore``.
"""
