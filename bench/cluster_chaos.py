"""Cluster chaos: 3 coordinators on PostgreSQL lose owners, stall and hand off while plans run; a checker proves it.

Real processes on 127.0.0.1 (docs/CLUSTER.md): a PostgreSQL server started here (tests/pg.py,
``fsync=on``), ``--coordinators`` coordinator processes on it (fixed main ports, so a restarted
one keeps its URL), ``--sims`` simulated workers in one child process (this file run with
``simulate``: the worker protocol over real websockets, following ``moved``, running ``sleep``
plans, re-attaching with their running plans after a failover), ``--agents`` real worker agents,
and this process as the clients: one SDK ``Client`` per pool, each given the list of the
coordinators' URLs, submitting plans with client-chosen ids at ``--rate`` per pool and following
every plan's stream across failovers (the SDK resumes by ``seq``).

There is one pool per shard slot, so every coordinator owns work. Faults, on a schedule:

* ``kill -9`` of a coordinator that owns shards (``--kills`` times); it is restarted once its
  shards accept submits again, and the cluster rebalances before the next fault;
* ``SIGSTOP`` of an owner for longer than the lease TTL, then ``SIGCONT``: its shards are taken
  over meanwhile, and when it runs again it must find itself fenced (``lost shard N``) and
  never commit under its old epoch;
* ``SIGTERM`` of an owner: it flushes and releases (hand-off), then is restarted;
* all along, a simulated worker's connection is cut (its plans dropped, as a killed process)
  every ``--worker-kill-every`` seconds, and a worker agent is ``kill -9``-ed and restarted now
  and then.

How the checker sees commits. Each shard's core connects with ``application_name``
``fw/<shard>/<epoch>/<owner>`` (coordinator/io/cluster/host.py). This bench installs, in its own
database only, statement-level triggers on ``fleetwire_plans`` and ``fleetwire_events`` that
log every committed write (shard, the writer's epoch, the lease row's epoch and owner as seen
inside that transaction) to ``chaos_commits``, and a trigger on ``shard_leases`` that logs every
change of owner or epoch to ``chaos_leases``. The triggers run inside the writers' transactions,
so only committed writes are logged. The checker then proves, from those rows, the plans and
events rows (decoded with their checksums) and the clients' streams:

* every acknowledged plan (the client got ``accepted``) ends (``lost``);
* exactly one accepted result per plan: one terminal event in the stored stream and in the
  client's, the same one, and one row per plan id (``duplicated``);
* no gap or duplicate in any stream the clients followed across failovers (by ``seq``);
* epochs only increase per shard, and every change of owner increases the epoch;
* no commit under a stale epoch: every logged write was made by a core whose epoch was the
  lease row's at that moment, for its own shard only (``stale_epoch_commits``);
* plan transitions legal (coordinator/plans.py ``TRANSITIONS``), in stored and client streams.

It prints, for every ``kill -9``, the time from the kill to the first submit sent after it being
accepted on each of the victim's shards (the kill's figure is its slowest shard; p50/p99 over the
kills), and the time until every simulated worker of those shards that was attached at the kill
was attached again. Targets (reported, not asserted): p99 <= 5 s, workers back within 10 s, 0 lost,
0 duplicated, 0 gaps, 0 stale-epoch commits.

**Reconnect that follows the cluster** (issue #25 part 3). For each fault kind (``kill -9``,
``SIGSTOP`` past the lease, ``SIGTERM``, and a ``--db-freeze`` of PostgreSQL: its postmaster and
children ``SIGSTOP``-ed for 20 s, then ``SIGCONT``), it prints the time from each affected shard
being served again (its new core's ``serving shard`` line) until the clients are back (the first
acknowledgement on that shard's pool after it) and until the worker agents and simulated workers
that were attached at the fault are attached again, and the acknowledged plans lost per fault kind
(each lost plan counted against the fault before it was sent). The clients and agents use the
SDK's and the agent's default reconnect settings (base 0.5 s, cap 30 s), as deployed; target:
back within 5 s of the shard being served again, 0 lost.

    python bench/cluster_chaos.py                       # defaults: <= 5 minutes on a 2-core machine
    python bench/cluster_chaos.py --kills 2 --sims 12 --rate 2 --json     # the smoke size
    python bench/cluster_chaos.py --logs DIR            # keep every process's output in DIR

``--db-failover`` adds a database failover in the middle of the faults: the PostgreSQL server
gets a streaming replica (``pg_basebackup -R``, tests/pg.py ``replica``) that the primary waits
for at every commit (``synchronous_standby_names = '*'``, ``synchronous_commit = on``); every
process is given a multi-host DSN (``...@127.0.0.1:P1,127.0.0.1:P2/db?target_session_attrs=
read-write``, which asyncpg follows as libpq does). The primary's postmaster and its children are
``kill -9``-ed, the standby is promoted (``pg_ctl promote``) ``--db-away`` seconds later, and the
coordinators must reconnect to it. The report says how long until every shard accepted submits
again, which coordinators stopped shards or exited, and the checker then runs on the promoted
server: 0 acknowledged plans lost means every acknowledged commit was on the standby.

    python bench/cluster_chaos.py --db-failover --kills 3     # the database failover, shorter
    python bench/cluster_chaos.py --kills 2 --db-freeze 20 --shards 3 --sims 12 --rate 2   # a short reconnect run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import random
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import _harness as h
import structlog
from scale import Sim
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from fleetwire import Client
from fleetwire.plan import Plan
from protocol.messages import (
    TERMINAL_STATES,
    Accept,
    Assign,
    Cancel,
    Capabilities,
    Done,
    Heartbeat,
    Hello,
    Load,
    Moved,
    Revoke,
    RunningPlan,
    Welcome,
)

sys.path.insert(0, str(h.ROOT))  # tests/pg.py starts the PostgreSQL server (shared with the test suite)
from coordinator.io.stores.postgres import PgStore
from coordinator.io.stores.rows import decode_plans
from coordinator.plans import TRANSITIONS
from coordinator.shards import ClusterConfig, pool_shard
from tests.pg import PostgresServer, missing_reason, postgres_server, standby_dsn

ME = str(Path(__file__).resolve())

# ---------------------------------------------------------------------------- the checker's triggers

INSTRUMENT = """
CREATE TABLE chaos_commits (
    id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp(), xid bigint NOT NULL,
    app text NOT NULL, tbl text NOT NULL, op text NOT NULL, shard int NOT NULL, nrows int NOT NULL,
    writer_shard int, writer_epoch bigint, lease_epoch bigint, lease_owner text, lease_live boolean
);
CREATE TABLE chaos_leases (
    id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp(), shard int NOT NULL,
    old_owner text, new_owner text, old_epoch bigint, new_epoch bigint
);
CREATE FUNCTION chaos_log_commit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    app text := current_setting('application_name');
    ws int;
    we bigint;
BEGIN
    IF app LIKE 'fw/%' THEN
        ws := split_part(app, '/', 2)::int;
        we := split_part(app, '/', 3)::bigint;
    END IF;
    INSERT INTO chaos_commits (xid, app, tbl, op, shard, nrows, writer_shard, writer_epoch, lease_epoch,
                               lease_owner, lease_live)
    SELECT txid_current(), app, TG_TABLE_NAME, TG_OP, r.shard, r.n, ws, we, l.epoch, l.owner, l.expires_at > now()
    FROM (SELECT shard, count(*)::int AS n FROM changed GROUP BY shard) r
    LEFT JOIN shard_leases l ON l.shard = r.shard;
    RETURN NULL;
END $$;
CREATE FUNCTION chaos_log_lease() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos_leases (shard, old_owner, new_owner, old_epoch, new_epoch)
    VALUES (NEW.shard, OLD.owner, NEW.owner, OLD.epoch, NEW.epoch);
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_leases_log AFTER UPDATE ON shard_leases FOR EACH ROW
    WHEN (OLD.epoch IS DISTINCT FROM NEW.epoch OR OLD.owner IS DISTINCT FROM NEW.owner)
    EXECUTE FUNCTION chaos_log_lease();
""" + "".join(
    f"CREATE TRIGGER chaos_{table}_{op.lower()} AFTER {op} ON fleetwire_{table} "
    f"REFERENCING {'OLD' if op == 'DELETE' else 'NEW'} TABLE AS changed FOR EACH STATEMENT "
    "EXECUTE FUNCTION chaos_log_commit();\n"
    for table in ("plans", "events") for op in ("INSERT", "UPDATE", "DELETE")
)

SELECT_PLANS = ("SELECT key, id, ord, state, spec, status, events, nevents, spec_crc, status_crc, events_crc "
                "FROM fleetwire_plans ORDER BY key")  # fmt: skip
SELECT_EVENTS = "SELECT plan, seq, body, crc FROM fleetwire_events ORDER BY plan, seq"

# ---------------------------------------------------------------------------- simulated workers


class ChaosSim(Sim):
    """Simulated workers that run plans (scale.py's :class:`Sim` registers and beats only).

    Each session dials the coordinators' list with ``?pool=NAME``, follows ``moved`` to the
    shard's core, accepts every ``assign``, sleeps the plan's ``seconds`` and sends ``done``.
    A lost connection keeps its plans running: the next ``hello`` lists them (and those whose
    ``done`` may not have arrived), as the agent does, so a failover continues them. A ``kill``
    (a line ``kill ID`` on stdin) cuts the connection and drops everything, as a killed process.
    Every registration prints one JSON line (``registered``) with the monotonic time.
    """

    def __init__(self, urls: list[str], pools: list[str], prefix: str, count: int) -> None:
        super().__init__(urls[0], prefix, count, connect_concurrency=16)
        self.urls = urls
        self.pools = pools
        self.conns: dict[str, ClientConnection] = {}
        self.killed: dict[str, asyncio.Event] = {}
        self.dones = 0

    def hello_for(self, worker_id: str, pool: str, running: list[RunningPlan], secret: str) -> bytes:
        caps = Capabilities(cpu_cores=2, ram_bytes=4 * 10**9, ops=["sleep"], tags=[f"pool:{pool}"],
                            max_concurrency=4, hostname=worker_id)  # fmt: skip
        return self.codec.encode([Hello(worker_id=worker_id, capabilities=caps, version="chaos-sim",
                                        running=running, session_secret=secret)])  # fmt: skip

    def kill(self, worker_id: str) -> None:
        event = self.killed.get(worker_id)
        if event is not None:
            event.set()
        ws = self.conns.get(worker_id)
        if ws is not None:
            ws.transport.abort()

    async def session(self, index: int) -> None:
        worker_id = f"{self.prefix}{index}"
        pool = self.pools[index % len(self.pools)]
        killed = self.killed[worker_id] = asyncio.Event()
        running: dict[str, tuple[int, asyncio.Task[None]]] = {}  # plan -> (attempt, its task)
        unsent: dict[str, tuple[int, bytes]] = {}  # plan -> (attempt, its done) not known to have arrived
        secret = ""
        target = ""  # a shard core's URL from ``moved``
        ring = itertools.cycle(range(len(self.urls)))
        for _ in range(index % len(self.urls)):
            next(ring)
        failures = 0
        current: list[ClientConnection | None] = [None]

        async def run(plan_id: str, attempt: int, seconds: float) -> None:
            await asyncio.sleep(seconds)
            done = self.codec.encode([Done(plan_id=plan_id, attempt=attempt, outcome="succeeded",
                                           result={"worker": worker_id, "attempt": attempt})])  # fmt: skip
            running.pop(plan_id, None)
            unsent[plan_id] = (attempt, done)
            ws = current[0]
            if ws is not None:
                with contextlib.suppress(ConnectionClosed):
                    await ws.send(done)
                    self.dones += 1

        while True:
            if killed.is_set():  # a killed process: its plans are gone, its next life is new
                killed.clear()
                for _attempt, task in running.values():
                    task.cancel()
                running.clear()
                unsent.clear()
                secret = target = ""
                await asyncio.sleep(self.rng.uniform(0.2, 1.0))
            url = f"{target}/v1/worker" if target else f"{self.urls[next(ring)]}/v1/worker?pool={quote(pool)}"
            registered = moved = False
            self.attempts += 1
            try:
                ws = await connect(url, compression=None, open_timeout=2, proxy=None, ping_interval=1,
                                   ping_timeout=2, close_timeout=1)  # fmt: skip
                self.conns[worker_id] = ws
                async with ws:
                    said = [RunningPlan(plan_id=p, attempt=a) for p, (a, _t) in running.items()]
                    said += [RunningPlan(plan_id=p, attempt=a) for p, (a, _d) in unsent.items() if p not in running]
                    await ws.send(self.hello_for(worker_id, pool, said, secret))
                    next_beat = time.monotonic() + 0.5
                    interval = 0.5
                    beat = self.codec.encode([Heartbeat(load=Load(in_flight=len(running)))])
                    while True:
                        try:
                            async with asyncio.timeout(max(0.0, next_beat - time.monotonic())):
                                frame = await ws.recv()
                        except TimeoutError:
                            if registered:
                                await ws.send(beat)
                            next_beat = time.monotonic() + interval * self.rng.uniform(0.9, 1.1)
                            continue
                        for msg in self.codec.decode(frame):
                            kind = type(msg)
                            if kind is Assign:
                                seconds = float((msg.args or {}).get("seconds", 0.0))
                                await ws.send(self.codec.encode([Accept(plan_id=msg.plan_id, attempt=msg.attempt)]))
                                old = running.pop(msg.plan_id, None)
                                if old is not None:
                                    old[1].cancel()
                                unsent.pop(msg.plan_id, None)
                                task = asyncio.create_task(run(msg.plan_id, msg.attempt, seconds))
                                running[msg.plan_id] = (msg.attempt, task)
                            elif kind is Welcome:
                                registered = True
                                failures = 0
                                secret = msg.session_secret
                                interval = msg.heartbeat_interval_s
                                current[0] = ws
                                self.registered += 1
                                print(json.dumps({"ev": "registered", "w": worker_id, "pool": pool,
                                                  "t": time.monotonic()}), flush=True)  # fmt: skip
                                for plan_id in msg.abandon_plans:
                                    entry = running.pop(plan_id, None)
                                    if entry is not None:
                                        entry[1].cancel()
                                    unsent.pop(plan_id, None)
                                for plan_id in msg.continue_plans:
                                    if plan_id in unsent and plan_id not in running:
                                        await ws.send(unsent[plan_id][1])
                                keep = set(msg.continue_plans)
                                for plan_id in [p for p in unsent if p not in keep]:
                                    del unsent[plan_id]
                            elif kind is Moved:
                                target, moved = msg.url.rstrip("/"), True
                            elif kind is Revoke or kind is Cancel:
                                entry = running.pop(msg.plan_id, None)
                                if entry is not None:
                                    entry[1].cancel()
                        if len(unsent) > 64:  # dones long since committed: forget the oldest
                            for plan_id in list(unsent)[:32]:
                                del unsent[plan_id]
            except (OSError, ConnectionClosed, InvalidHandshake, InvalidURI, TimeoutError):
                pass
            finally:
                current[0] = None
                self.conns.pop(worker_id, None)
            if registered:
                self.registered -= 1
                print(json.dumps({"ev": "lost", "w": worker_id, "pool": pool, "t": time.monotonic()}), flush=True)
            elif not moved:
                self.failures += 1
                failures += 1
                target = ""  # a core that does not answer: back to the list
            if killed.is_set() or moved:
                continue
            await asyncio.sleep(self.rng.uniform(0, min(0.5, 0.05 * 2 ** min(failures, 10))))


async def simulate(urls: list[str], pools: list[str], prefix: str, count: int) -> None:
    sim = ChaosSim(urls, pools, prefix, count)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def commands() -> None:
        while line := await reader.readline():
            parts = line.decode().split()
            if len(parts) == 2 and parts[0] == "kill":
                sim.kill(parts[1])
        stop.set()

    tasks = [asyncio.create_task(sim.session(i)) for i in range(count)]
    listener = asyncio.create_task(commands())
    await stop.wait()
    for task in [*tasks, listener]:
        task.cancel()
    await asyncio.gather(*tasks, listener, return_exceptions=True)
    print(json.dumps({"ev": "final", "attempts": sim.attempts, "failures": sim.failures, "dones": sim.dones}),
          flush=True)  # fmt: skip


# ---------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind((h.HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class Logged:
    """A child process whose output goes, time-stamped, to a log file and to :attr:`lines`."""

    name: str
    proc: asyncio.subprocess.Process
    log: Any
    lines: list[tuple[float, str]] = field(default_factory=list)
    reader: asyncio.Task[None] | None = None
    new: asyncio.Event = field(default_factory=asyncio.Event)

    async def read(self) -> None:
        assert self.proc.stdout is not None
        while raw := await self.proc.stdout.readline():
            line = raw.decode(errors="replace").rstrip("\n")
            now = time.monotonic()
            self.lines.append((now, line))
            self.log.write(f"{now:.3f} {line}\n")
            self.new.set()
        self.log.flush()
        self.new.set()

    async def wait_for(self, pattern: str, timeout_s: float, since: float = 0.0) -> tuple[float, str] | None:
        deadline = time.monotonic() + timeout_s
        seen = 0
        while True:
            for t, line in self.lines[seen:]:
                if t >= since and pattern in line:
                    return t, line
            seen = len(self.lines)
            if self.reader is not None and self.reader.done():
                return None
            self.new.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.new.wait(), left)

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    async def stop(self, grace_s: float = 10.0) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), grace_s)
        except TimeoutError:
            self.signal(signal.SIGKILL)
            await self.proc.wait()
        if self.reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.reader, 5)


async def start_logged(name: str, argv: list[str], logs: Path, stdin: bool = False) -> Logged:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=h.ROOT, env=h.bench_env(),
        stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    p = Logged(name, proc, (logs / f"{name}.log").open("a", buffering=1))
    p.reader = asyncio.create_task(p.read())
    return p


@dataclass
class Coordinator:
    """One coordinator slot: a fixed main port, restarted in place (each run has a new owner id)."""

    index: int
    port: int
    proc: Logged | None = None
    owner: str = ""
    runs: int = 0

    @property
    def url(self) -> str:
        return f"ws://{h.HOST}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.proc.returncode is None


# ---------------------------------------------------------------------------- the run


@dataclass
class Tracked:
    """One plan as its client saw it."""

    plan_id: str
    pool: str
    sent_at: float
    acked_at: float | None = None
    duplicate: bool = False
    plan: Plan | None = None
    events: list[Any] = field(default_factory=list)
    error: str = ""


class Run:
    def __init__(self, ns: argparse.Namespace, dsn: str, logs: Path,
                 primary: PostgresServer | None = None, standby: PostgresServer | None = None) -> None:  # fmt: skip
        self.ns = ns
        self.dsn = dsn
        self.primary, self.standby = primary, standby  # --db-failover
        self.logs = logs
        self.rng = random.Random(ns.seed)
        self.config = ClusterConfig(shards=ns.shards, lease_ttl_s=ns.lease_ttl, lease_renew_s=ns.lease_renew)
        self.coords = [Coordinator(i, free_port()) for i in range(ns.coordinators)]
        self.pools = [next(f"pool{s}-{i}" for i in range(10_000) if pool_shard(f"pool{s}-{i}", ns.shards) == s)
                      for s in range(ns.shards)]  # fmt: skip
        self.plans: list[Tracked] = []
        self.sim: Logged | None = None
        self.agents: dict[str, Logged] = {}
        self.faults: list[dict[str, Any]] = []
        self.actions: Counter[str] = Counter()
        self.registered: dict[str, float | None] = {}  # sim worker -> since when attached (None: not)
        self.sim_events: list[tuple[float, str, str, str]] = []  # (t, event, worker, pool)
        self.submitting = True
        self.db_record: dict[str, Any] = {}
        self.all_attached = asyncio.Event()  # every sim worker attached (set once)
        self.windows: list[tuple[float, str]] = []  # (when, fault kind): a lost plan counts against the one before it
        self.freezes: list[dict[str, Any]] = []
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.coords]

    # ------------------------------------------------------------------ processes

    async def start_coordinator(self, c: Coordinator) -> None:
        c.runs += 1
        args = [sys.executable, "-m", "fleetwire", "coordinator", "--host", h.HOST, "--port", str(c.port),
                "--insecure", "--store", self.dsn, "--shards", str(self.ns.shards),
                "--lease-ttl", str(self.ns.lease_ttl), "--lease-renew", str(self.ns.lease_renew),
                "--heartbeat-interval", "0.5", "--heartbeat-timeout", "3", "--reaper-interval", "0.1",
                "--log-level", "warning"]  # fmt: skip
        for flag, value in h.BENCH_LIMITS.items():
            if h.coordinator_has_flag(flag):
                args += [flag, value]
        c.proc = await start_logged(f"coordinator-{c.index}", args, self.logs)
        found = await c.proc.wait_for("listening on", 60)
        if found is None:
            raise RuntimeError(f"coordinator {c.index} did not start: {[line for _t, line in c.proc.lines[-10:]]}")
        c.owner = found[1].rsplit("owner ", 1)[1].rstrip(")")

    async def start_agent(self, name: str, pool: str) -> None:
        # The agent's default reconnect (base 0.5 s, cap 30 s), as deployed: the figures are its own.
        args = [sys.executable, "-m", "fleetwire", "worker", "--url", ",".join(self.urls), "--pool", pool,
                "--id", name, "--max-concurrency", "4", "--drain-timeout", "0.5", "--log-level", "info",
                "--log-format", "json"]  # fmt: skip
        self.agents[name] = await start_logged(name, args, self.logs)

    async def read_sims(self) -> None:
        assert self.sim is not None
        seen = 0
        while True:
            await self.sim.new.wait()
            self.sim.new.clear()
            for t, line in self.sim.lines[seen:]:
                if line.startswith('{"ev": "registered"') or line.startswith('{"ev": "lost"'):
                    msg = json.loads(line)
                    self.sim_events.append((msg["t"], msg["ev"], msg["w"], msg["pool"]))
                    self.registered[msg["w"]] = msg["t"] if msg["ev"] == "registered" else None
                    if sum(t is not None for t in self.registered.values()) >= self.ns.sims:
                        self.all_attached.set()
                del t
            seen = len(self.sim.lines)
            if self.sim.reader is not None and self.sim.reader.done():
                return

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------------ topology

    async def topology(self) -> list[dict[str, Any]]:
        for c in self.coords:
            if not c.alive:
                continue
            url = f"http://{h.HOST}:{c.port}/v1/topology"
            try:
                body = await asyncio.to_thread(lambda u=url: urllib.request.urlopen(u, timeout=1).read())
            except OSError:
                continue
            return list(json.loads(body)["topology"])
        return []

    async def owned(self) -> dict[str, list[int]]:
        """owner id -> the shards it serves now (live lease with a URL)."""
        out: dict[str, list[int]] = defaultdict(list)
        for row in await self.topology():
            if row["live"] and row["url"]:
                out[row["owner"]].append(row["shard"])
        return out

    async def wait_balanced(self, timeout_s: float) -> bool:
        """Every shard served and every live coordinator serving at least one."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            owned = await self.owned()
            alive = [c for c in self.coords if c.alive]
            if sum(map(len, owned.values())) == self.ns.shards and all(owned.get(c.owner) for c in alive):
                return True
            await asyncio.sleep(0.2)
        return False

    # ------------------------------------------------------------------ clients

    async def submitter(self, pool: str, client: Client, counter: itertools.count[int]) -> None:
        period = 1.0 / self.ns.rate
        next_at = time.monotonic()
        while self.submitting:
            n = next(counter)
            tracked = Tracked(f"{pool}-{n}", pool, time.monotonic())
            self.plans.append(tracked)
            self.spawn(self.submit_one(client, tracked))
            next_at += period * self.rng.uniform(0.5, 1.5)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def submit_one(self, client: Client, tracked: Tracked) -> None:
        seconds = round(self.rng.uniform(0.0, self.ns.plan_s), 3)
        try:
            plan = await client.submit("sleep", {"seconds": seconds}, tags=[f"pool:{tracked.pool}"],
                                       plan_id=tracked.plan_id, max_attempts=50)  # fmt: skip
        except Exception as exc:
            tracked.error = f"{type(exc).__name__}: {exc}"
            return
        tracked.acked_at = time.monotonic()
        tracked.duplicate = plan.duplicate
        tracked.plan = plan
        try:
            async for event in plan.events():
                tracked.events.append(event)
        except Exception as exc:
            tracked.error = f"{type(exc).__name__}: {exc}"

    # ------------------------------------------------------------------ chaos

    async def worker_chaos(self, stop: asyncio.Event) -> None:
        assert self.sim is not None and self.sim.proc.stdin is not None
        agent_every = max(1, int(self.ns.agent_kill_every / self.ns.worker_kill_every))
        for round_ in itertools.count(1):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.ns.worker_kill_every)
            if stop.is_set():
                return
            if self.agents and round_ % agent_every == 0:
                name = self.rng.choice(sorted(self.agents))
                agent = self.agents[name]
                agent.signal(signal.SIGKILL)
                await agent.proc.wait()
                self.actions["agent kill -9"] += 1
                await asyncio.sleep(0.3)
                pool = self.pools[int(name.rsplit("-", 1)[1]) % len(self.pools)]
                await self.start_agent(name, pool)
            else:
                victim = f"sim-{self.rng.randrange(self.ns.sims)}"
                self.sim.proc.stdin.write(f"kill {victim}\n".encode())
                self.actions["sim worker killed"] += 1

    def attached_at(self, since: float) -> dict[str, float]:
        """Sim worker -> when it was first attached after ``since`` (absent: not yet)."""
        back: dict[str, float] = {}
        for t, ev, w, _pool in self.sim_events:
            if ev == "registered" and t > since and w not in back:
                back[w] = t
        return back

    def sims_of(self, shards: list[int]) -> set[str]:
        pools = {self.pools[s] for s in shards}
        return {f"sim-{i}" for i in range(self.ns.sims) if self.pools[i % len(self.pools)] in pools}

    async def recovery(self, at: float, shards: list[int], timeout_s: float) -> dict[int, float | None]:
        """Per shard: seconds from ``at`` to the first accepted submit sent after ``at`` (None: none in time)."""
        pool_shards = {self.pools[s]: s for s in shards}
        deadline = time.monotonic() + timeout_s
        got: dict[int, float | None] = dict.fromkeys(shards)
        while time.monotonic() < deadline:
            for tracked in reversed(self.plans):
                if tracked.sent_at < at:
                    break
                shard = pool_shards.get(tracked.pool)
                if shard is not None and tracked.acked_at is not None:
                    took = tracked.acked_at - at
                    if got[shard] is None or took < got[shard]:  # type: ignore[operator]
                        got[shard] = took
            if all(v is not None for v in got.values()):
                return got
            await asyncio.sleep(0.1)
        return got

    async def reattached(self, at: float, shards: list[int], timeout_s: float) -> float | None:
        """Seconds until every sim worker of ``shards`` attached at ``at`` was attached again (None: not in time)."""
        ours = self.sims_of(shards)
        state: dict[str, str] = {}
        for t, ev, w, _pool in self.sim_events:
            if t < at and w in ours:
                state[w] = ev
        was = {w for w, ev in state.items() if ev == "registered"}
        if not was:
            return None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            back = self.attached_at(at)
            if was <= back.keys():
                return max((back[w] - at for w in was), default=0.0)
            await asyncio.sleep(0.1)
        return None

    def served_at(self, at: float, shards: list[int]) -> dict[int, float]:
        """Shard -> when a coordinator first announced serving it after ``at`` (its ``serving shard`` line)."""
        got: dict[int, float] = {}
        for c in self.coords:
            for t, line in c.proc.lines if c.proc is not None else ():
                if t < at or "serving shard " not in line:
                    continue
                for shard in shards:
                    if f"serving shard {shard} (" in line and (shard not in got or t < got[shard]):
                        got[shard] = t
        return got

    def _agent_sessions(self, name: str) -> list[tuple[float, str]]:
        """(time, "registered" | "lost") of one worker agent, from its JSON log lines."""
        proc = self.agents.get(name)
        out: list[tuple[float, str]] = []
        for t, line in proc.lines if proc is not None else ():
            if '"event": "registered"' in line:
                out.append((t, "registered"))
            elif '"event": "disconnected"' in line:
                out.append((t, "lost"))
        return out

    async def back_after_served(self, at: float, shards: list[int], timeout_s: float,
                                served_floor: float | None = None) -> dict[str, Any]:  # fmt: skip
        """Per shard: seconds from it being served again until its clients and its workers are back.

        Clients: the first acknowledgement on the shard's pool after it was served (a session of that
        client resumed). Workers: every agent and simulated worker of the pool that was attached at ``at``
        attached again. ``served_floor``: a shard whose lease outlived the fault (no new ``serving shard``
        line) counts as served again at this time (a database freeze that ended before the lease did).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            served = self.served_at(at, shards)
            if served_floor is not None and time.monotonic() > served_floor + 10:
                for shard in shards:
                    served.setdefault(shard, served_floor)
            clients: dict[int, float | None] = {}
            agents: dict[int, float | None] = {}
            sims: dict[int, float | None] = {}
            for shard in shards:
                t_s = served.get(shard)
                if t_s is None:
                    clients[shard] = agents[shard] = sims[shard] = None
                    continue
                pool = self.pools[shard]
                acks = [t.acked_at for t in self.plans if t.pool == pool and t.acked_at is not None
                        and t.acked_at >= t_s]  # fmt: skip
                clients[shard] = round(min(acks) - t_s, 3) if acks else None
                backs = [back_s(self._agent_sessions(name), at, t_s) for name in sorted(self.agents)
                         if self.pools[int(name.rsplit("-", 1)[1]) % len(self.pools)] == pool]  # fmt: skip
                agents[shard] = _slowest(backs)
                sim_backs = []
                for w in self.sims_of([shard]):
                    events = [(t, "registered" if ev == "registered" else "lost") for t, ev, ww, _p in self.sim_events
                              if ww == w]  # fmt: skip
                    sim_backs.append(back_s(events, at, t_s))
                sims[shard] = _slowest(sim_backs)
            pending = [v for d in (clients, agents, sims) for v in d.values() if v is None]
            if not pending or time.monotonic() >= deadline:
                return {"served_after_s": {s: round(t - at, 3) for s, t in sorted(served.items())},
                        "clients_back_s": clients, "agents_back_s": agents, "sims_back_s": sims}  # fmt: skip
            await asyncio.sleep(0.2)

    async def victim(self) -> tuple[Coordinator, list[int]]:
        owned = await self.owned()
        alive = [c for c in self.coords if c.alive and owned.get(c.owner)]
        alive.sort(key=lambda c: (-len(owned[c.owner]), self.rng.random()))
        return alive[0], sorted(owned[alive[0].owner])

    async def fault(self, kind: str) -> None:
        c, shards = await self.victim()
        assert c.proc is not None
        record: dict[str, Any] = {"kind": kind, "coordinator": c.index, "owner": c.owner, "shards": shards}
        at = time.monotonic()
        pools = [self.pools[s] for s in shards]
        logging.getLogger("fleetwire.chaos").info("fault: %s of coordinator %d (shards %s, pools %s)", kind, c.index,
                                                  shards, pools)  # fmt: skip
        if kind == "kill -9":
            c.proc.signal(signal.SIGKILL)
            await c.proc.proc.wait()
        elif kind == "SIGTERM":
            c.proc.signal(signal.SIGTERM)
        elif kind == "SIGSTOP":
            c.proc.signal(signal.SIGSTOP)
        self.actions[f"coordinator {kind}"] += 1
        rec_task = asyncio.create_task(self.recovery(at, shards, 30))
        back_task = asyncio.create_task(self.reattached(at, shards, 30))
        follow_task = asyncio.create_task(self.back_after_served(at, shards, 45))
        if kind == "SIGSTOP":
            stalled = self.ns.lease_ttl + self.ns.stall_extra
            record["stopped_s"] = stalled
            record["taken_over_s"] = None  # until the topology shows every shard of it served by another
            while (left := at + stalled - time.monotonic()) > 0:
                served = {s for owner, held in (await self.owned()).items() if owner != c.owner for s in held}
                if record["taken_over_s"] is None and set(shards) <= served:
                    record["taken_over_s"] = round(time.monotonic() - at, 3)
                await asyncio.sleep(min(0.1, max(0.0, left)))
            taken = await self.owned()
            record["taken_over_while_stopped"] = sorted(s for s in shards if s not in taken.get(c.owner, []))
            resumed = time.monotonic()
            c.proc.signal(signal.SIGCONT)
            fenced = []
            for shard in shards:
                line = await c.proc.wait_for(f"lost shard {shard}:", 15, since=resumed)
                if line is not None:
                    fenced.append(shard)
            record["found_itself_fenced"] = fenced
            record["still_running"] = c.alive
        recovered = await rec_task
        record["recovery_s"] = {s: None if v is None else round(v, 3) for s, v in recovered.items()}
        times = [v for v in recovered.values() if v is not None]
        record["recovered_s"] = round(max(times), 3) if len(times) == len(shards) else None
        reattached = await back_task
        record["workers_reattached_s"] = None if reattached is None else round(reattached, 3)
        record.update(await follow_task)
        if kind == "SIGTERM":
            record["exit"] = await asyncio.wait_for(c.proc.proc.wait(), 30)
        if kind in ("kill -9", "SIGTERM"):
            await c.proc.stop(1)
            await self.start_coordinator(c)
        t_balance = time.monotonic()
        record["rebalanced_s"] = round(time.monotonic() - t_balance, 3) if await self.wait_balanced(30) else None
        self.faults.append(record)
        line = (f"  {kind:<8} coordinator {c.index} (shards {shards}): submits accepted again after "
                f"{record['recovered_s']} s, sim workers re-attached after {record['workers_reattached_s']} s")
        if kind == "SIGSTOP":
            line += (f" (stopped {record['stopped_s']} s; taken over after {record['taken_over_s']} s); fenced on "
                     f"SIGCONT: {record['found_itself_fenced']}")
        line += f"; rebalanced {record['rebalanced_s']} s after"
        print(line, file=sys.stderr, flush=True)
        print(f"    after the shard was served again: clients back {_slowest(record['clients_back_s'].values())} s, "
              f"agents {_slowest(record['agents_back_s'].values())} s, sim workers "
              f"{_slowest(record['sims_back_s'].values())} s", file=sys.stderr, flush=True)  # fmt: skip

    # ------------------------------------------------------------------ the whole run

    async def main(self) -> dict[str, Any]:
        ns = self.ns
        t_start = time.monotonic()
        await asyncio.to_thread(lambda: PgStore(self.dsn, self.config).close())  # the schema, before the triggers
        await self.sql(INSTRUMENT)
        for c in self.coords:
            await self.start_coordinator(c)
        if not await self.wait_balanced(60):
            raise RuntimeError(f"the coordinators did not split the shards: {await self.owned()}")
        self.sim = await start_logged("sims", [sys.executable, ME, "simulate", "--urls", ",".join(self.urls),
                                               "--pools", ",".join(self.pools), "--count", str(ns.sims)],
                                      self.logs, stdin=True)  # fmt: skip
        self.spawn(self.read_sims())
        for i in range(ns.agents):
            await self.start_agent(f"agent-{i}", self.pools[i % len(self.pools)])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.all_attached.wait(), 60)
        clients = []
        for pool in self.pools:
            # The SDK's default reconnect (base 0.5 s, cap 30 s), as deployed: the figures are its own.
            client = Client(self.urls, pool=pool, token="", reconnect_give_up_s=None)
            await client.connect()
            clients.append(client)
        counter = itertools.count(1)
        submitters = [asyncio.create_task(self.submitter(pool, client, counter))
                      for pool, client in zip(self.pools, clients, strict=True)]  # fmt: skip
        stop_chaos = asyncio.Event()
        chaos = asyncio.create_task(self.worker_chaos(stop_chaos))
        t_faults = time.monotonic()
        await asyncio.sleep(ns.settle)
        schedule = ["kill -9"] * ns.kills
        if ns.stall:
            schedule.insert(min(len(schedule), 3), "SIGSTOP")
        if ns.handoff:
            schedule.insert(min(len(schedule), 6), "SIGTERM")
        if ns.db_failover:
            schedule.insert(len(schedule) // 2, "db failover")
        if ns.db_freeze > 0:  # before a database failover: it freezes the first server
            at = schedule.index("db failover") if ns.db_failover else min(len(schedule), 2)
            schedule.insert(at, "db freeze")
        print(f"cluster chaos: {len(schedule)} faults: {', '.join(schedule)}", file=sys.stderr, flush=True)
        for kind in schedule:
            fault_at = time.monotonic()
            if kind == "db failover":
                await self.db_failover()
            elif kind == "db freeze":
                await self.db_freeze()
            else:
                await self.fault(kind)
            self.windows.append((fault_at, kind))
            await asyncio.sleep(ns.settle)
        faults_s = time.monotonic() - t_faults
        self.submitting = False
        for task in submitters:
            await task
        stop_chaos.set()
        await chaos
        # Every plan that was acknowledged must end: wait for them (bounded).
        drain_deadline = time.monotonic() + ns.drain
        while time.monotonic() < drain_deadline:
            open_ = [t for t in self.plans if t.plan is not None and not t.plan.done()]
            pending = [t for t in self.plans if t.plan is None and not t.error]
            if not open_ and not pending:
                break
            await asyncio.sleep(0.2)
        drained_s = time.monotonic() - t_faults - faults_s
        for client in clients:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 5)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.stop_all()
        checked = await self.check()
        return {
            "bench": "cluster_chaos",
            "coordinators": ns.coordinators, "shards": ns.shards, "sims": ns.sims, "agents": ns.agents,
            "lease_ttl_s": ns.lease_ttl, "lease_renew_s": ns.lease_renew, "rate_per_pool": ns.rate,
            "faults": self.faults, "actions": dict(self.actions),
            "faults_phase_s": round(faults_s, 1), "drain_s": round(drained_s, 1),
            "elapsed_s": round(time.monotonic() - t_start, 1),
            "db_failover": self.db_record or "not run (--db-failover)",
            "logs": str(self.logs), "seed": ns.seed, "machine": h.machine(),
            **checked,
        }  # fmt: skip

    async def db_freeze(self) -> None:
        """SIGSTOP PostgreSQL (postmaster and children) for ``--db-freeze`` seconds, SIGCONT; how the cluster comes
        back: each shard served again, then its clients and workers."""
        assert self.primary is not None
        shards = list(range(self.ns.shards))
        record: dict[str, Any] = {"kind": "db freeze", "frozen_s": self.ns.db_freeze}
        at = time.monotonic()
        pids = await asyncio.to_thread(postgres_pids, self.primary)
        signal_all(pids, signal.SIGSTOP)
        self.actions["postgresql SIGSTOP"] += 1
        try:
            await asyncio.sleep(self.ns.db_freeze)
        finally:
            signal_all(pids, signal.SIGCONT)
        resumed = time.monotonic()
        record.update(await self.back_after_served(at, shards, 60, served_floor=resumed))
        acks = {s: [t.acked_at for t in self.plans if t.pool == self.pools[s] and t.acked_at is not None
                    and t.acked_at >= resumed] for s in shards}  # fmt: skip
        record["clients_back_after_thaw_s"] = {s: round(min(a) - resumed, 3) if a else None for s, a in acks.items()}
        exited = [(c.index, c.proc.proc.returncode) for c in self.coords if c.proc and not c.alive]
        record["coordinators_exited"] = exited
        for c in self.coords:
            if not c.alive:
                await self.start_coordinator(c)
        t_balance = time.monotonic()
        record["rebalanced_s"] = round(time.monotonic() - t_balance, 3) if await self.wait_balanced(60) else None
        self.freezes.append(record)
        served = _slowest(record["served_after_s"].values())
        record["served_after_thaw_s"] = None if served is None else round(served - (resumed - at), 3)
        print(f"  db freeze: PostgreSQL SIGSTOP {self.ns.db_freeze:g} s, then SIGCONT: shards served again "
              f"{record['served_after_thaw_s']} s after the thaw; after that clients back "
              f"{_slowest(record['clients_back_s'].values())} s, agents {_slowest(record['agents_back_s'].values())} s,"
              f" sim workers {_slowest(record['sims_back_s'].values())} s (clients back "
              f"{_slowest(record['clients_back_after_thaw_s'].values())} s after the thaw); coordinators exited "
              f"{exited}", file=sys.stderr, flush=True)  # fmt: skip

    async def db_failover(self) -> None:
        """kill -9 the PostgreSQL primary, promote the synchronous standby; how the cluster comes back."""
        assert self.primary is not None and self.standby is not None
        shards = list(range(self.ns.shards))
        sync = await asyncio.to_thread(self.primary.sql_value,
                                       "SELECT string_agg(sync_state, ',') FROM pg_stat_replication")  # fmt: skip
        record: dict[str, Any] = {"kind": "db failover", "standby_sync_state": sync, "away_s": self.ns.db_away}
        at = time.monotonic()
        await asyncio.to_thread(self.primary.kill)
        self.actions["postgresql primary kill -9"] += 1
        rec_task = asyncio.create_task(self.recovery(at, shards, 60))
        back_task = asyncio.create_task(self.reattached(at, shards, 60))
        await asyncio.sleep(self.ns.db_away)
        await asyncio.to_thread(self.standby.promote)
        promoted = time.monotonic()
        record["promoted_after_s"] = round(promoted - at, 3)
        recovered = await rec_task
        times = [v for v in recovered.values() if v is not None]
        record["recovered_s"] = round(max(times), 3) if len(times) == len(shards) else None
        record["recovered_after_promotion_s"] = (None if record["recovered_s"] is None
                                                 else round(record["recovered_s"] - (promoted - at), 3))  # fmt: skip
        reattached = await back_task
        record["workers_reattached_s"] = None if reattached is None else round(reattached, 3)
        # What the coordinators did: shards stopped (fail-stop) and won again, processes that exited.
        lost = sum(1 for c in self.coords if c.proc for t, line in c.proc.lines
                   if t >= at and ("lost shard" in line or "released shard" in line))  # fmt: skip
        won = sum(1 for c in self.coords if c.proc for t, line in c.proc.lines if t >= at and "serving shard" in line)
        record["shards_stopped"], record["shards_served_again"] = lost, won
        exited = [(c.index, c.proc.proc.returncode) for c in self.coords if c.proc and not c.alive]
        record["coordinators_exited"] = exited
        for c in self.coords:
            if not c.alive:
                await self.start_coordinator(c)
        during = [t for t in self.plans if at <= t.sent_at < promoted]
        waits = [t.acked_at - t.sent_at for t in during if t.acked_at is not None]
        record["submits_while_away"] = len(during)
        record["their_errors"] = sum(1 for t in during if t.error and t.acked_at is None)
        record["their_max_ack_wait_s"] = round(max(waits), 3) if waits else None
        t_balance = time.monotonic()
        record["rebalanced_s"] = round(time.monotonic() - t_balance, 3) if await self.wait_balanced(60) else None
        self.db_record = record
        print(f"  db failover: primary kill -9, standby ({sync}) promoted after {record['promoted_after_s']} s; "
              f"every shard accepted submits again after {record['recovered_s']} s "
              f"({record['recovered_after_promotion_s']} s after the promotion); sim workers re-attached after "
              f"{record['workers_reattached_s']} s; shards stopped {lost}, served again {won}; coordinators "
              f"exited {exited}; submits sent while away {len(during)} (errors {record['their_errors']}, "
              f"slowest ack {record['their_max_ack_wait_s']} s); rebalanced {record['rebalanced_s']} s after",
              file=sys.stderr, flush=True)  # fmt: skip

    async def stop_all(self) -> None:
        if self.sim is not None and self.sim.proc.stdin is not None:
            self.sim.proc.stdin.close()
        procs = [p for p in [self.sim, *self.agents.values()] if p is not None]
        await asyncio.gather(*(p.stop(5) for p in procs), return_exceptions=True)
        await asyncio.gather(*(c.proc.stop(10) for c in self.coords if c.proc is not None), return_exceptions=True)

    async def sql(self, text: str) -> None:
        import asyncpg  # type: ignore[import-untyped]

        conn = await asyncpg.connect(self.dsn)
        try:
            await conn.execute(text)
        finally:
            await conn.close()

    # ------------------------------------------------------------------ the checker

    async def check(self) -> dict[str, Any]:
        import asyncpg

        conn = await asyncpg.connect(self.dsn)
        try:
            plan_rows = [tuple(r) for r in await conn.fetch(SELECT_PLANS)]
            event_rows = [tuple(r) for r in await conn.fetch(SELECT_EVENTS)]
            ids = await conn.fetch("SELECT id, count(*) AS n FROM fleetwire_plans GROUP BY id HAVING count(*) > 1")
            commits = await conn.fetch("SELECT * FROM chaos_commits ORDER BY id")
            leases = await conn.fetch("SELECT * FROM chaos_leases ORDER BY id")
        finally:
            await conn.close()
        return check(self.plans, plan_rows, event_rows, [r["id"] for r in ids], commits, leases,
                     [*self.faults, *self.freezes], self.windows)  # fmt: skip


def postgres_pids(server: PostgresServer) -> list[int]:
    """The postmaster's pid and its children's (tests/pg.py ``kill`` finds them the same way)."""
    pid = int((server.data / "postmaster.pid").read_text().split()[0])
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
    return [pid, *children]


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def back_s(events: list[tuple[float, str]], at: float, served: float) -> float | None:
    """Seconds after ``served`` until a worker attached at ``at`` was attached again (0: never lost, or back by then;
    None: not yet).

    ``events``: its (time, "registered" | "lost") in order. A worker not attached at ``at`` is not counted (``nan``).
    It is back at its first registration after it was lost that held until ``served``: the shard's core listens and
    publishes its URL before its ``serving shard`` line is written and read here, so a worker can register with it
    just before ``served`` (a registration that another loss ended before ``served`` was with a core that then lost
    the shard). Counting only registrations after ``served`` took such a worker's next life, after the next
    simulated kill of it, as its return: 25-32 s where it was back in under 1 s.
    """
    attached = False
    for t, ev in events:
        if t >= at:
            break
        attached = ev == "registered"
    if not attached:
        return float("nan")
    lost = next((i for i, (t, ev) in enumerate(events) if t >= at and ev == "lost"), None)
    if lost is None:
        return 0.0
    after = events[lost:]
    for i, (t, ev) in enumerate(after):
        if ev != "registered":
            continue
        ended = next((t2 for t2, ev2 in after[i + 1 :] if ev2 == "lost"), None)
        if t >= served or ended is None or ended >= served:
            return max(0.0, t - served)
    return None


def _slowest(values: Any) -> float | None:
    """The largest of the measured values (nan: not concerned, skipped); None when one is missing."""
    got = [v for v in values if v is None or v == v]
    if any(v is None for v in got):
        return None
    return round(max(got), 3) if got else 0.0


# ---------------------------------------------------------------------------- the checker (pure)

_STATE_KINDS = {"queued", "leased", "running", "succeeded", "failed", "cancelled"}
_LEGAL = {(state, new) for (state, _event), new in TRANSITIONS.items()}


def stream_problems(events: list[Any], *, contiguous: bool) -> list[str]:
    """What is wrong with one plan's stream: seq gaps or duplicates, illegal transitions, terminal count."""
    problems: list[str] = []
    seqs = [e.seq for e in events]
    if len(set(seqs)) != len(seqs):
        problems.append(f"duplicate seqs {sorted(s for s, n in Counter(seqs).items() if n > 1)[:5]}")
    if seqs != sorted(seqs):
        problems.append("seqs out of order")
    if contiguous:
        expected = 1
        for e in events:  # a resync marker (seq = its last_seq) stands for the run first_seq..last_seq
            if e.kind == "resync" and isinstance(e.data, dict) and "first_seq" in e.data:
                if int(e.data["first_seq"]) != expected or e.seq < expected:
                    problems.append(f"gap: resync from {e.data['first_seq']} after {expected - 1}")
                    break
                expected = e.seq + 1
                continue
            if e.seq != expected:
                problems.append(f"gap: seq {e.seq} after {expected - 1}")
                break
            expected += 1
    terminal = [e for e in events if e.kind in TERMINAL_STATES]
    if len(terminal) != 1:
        problems.append(f"{len(terminal)} terminal events")
    elif events and events[-1] is not terminal[0]:
        problems.append("events after the terminal one")
    state = None
    for e in events:
        kind = "queued" if e.kind == "requeued" else e.kind
        if kind not in _STATE_KINDS:
            continue
        if state is None:
            if kind != "queued":
                problems.append(f"first state {kind}, not queued")
            state = kind
            continue
        if kind == state == "queued":
            continue  # a requeue of a plan already queued says it again
        if (state, kind) not in _LEGAL:
            problems.append(f"illegal transition {state} -> {kind} at seq {e.seq}")
        state = kind
    return problems


def check(
    tracked: list[Tracked],
    plan_rows: list[tuple[Any, ...]],
    event_rows: list[tuple[Any, ...]],
    duplicate_ids: list[str],
    commits: list[Any],
    leases: list[Any],
    faults: list[dict[str, Any]],
    windows: list[tuple[float, str]] | None = None,
) -> dict[str, Any]:
    """The checker's figures; ``windows``: (start, fault kind) of each fault, to count lost plans per kind."""
    stored, damaged = decode_plans(plan_rows, event_rows)
    by_id = {p.created.plan_id: p for p in stored}
    acked = [t for t in tracked if t.acked_at is not None]
    lost: list[str] = []
    duplicated: list[str] = list(duplicate_ids)
    gaps: list[str] = []
    illegal: list[str] = []
    outcomes: Counter[str] = Counter()
    reran = 0
    for t in acked:
        p = by_id.get(t.plan_id)
        final = p.status.state if p is not None and p.status is not None else None
        if p is None or final not in TERMINAL_STATES:
            lost.append(t.plan_id)
            continue
        outcomes[final] += 1
        assert p.status is not None
        reran += p.status.attempt > 1
        stored_problems = stream_problems(list(p.events), contiguous=False)
        client_problems = stream_problems(t.events, contiguous=True)
        for where, problems in (("stored", stored_problems), ("client", client_problems)):
            for problem in problems:
                target = illegal if "transition" in problem or "first state" in problem else gaps
                if "terminal" in problem:
                    target = duplicated
                target.append(f"{t.plan_id} ({where}): {problem}")
        s_term = [e for e in p.events if e.kind in TERMINAL_STATES]
        c_term = [e for e in t.events if e.kind in TERMINAL_STATES]
        if s_term and c_term and (s_term[-1].seq, s_term[-1].kind) != (c_term[-1].seq, c_term[-1].kind):
            duplicated.append(f"{t.plan_id}: the client saw {c_term[-1].kind}@{c_term[-1].seq}, the store holds "
                              f"{s_term[-1].kind}@{s_term[-1].seq}")  # fmt: skip
    unacked_stored = sum(1 for t in tracked if t.acked_at is None and t.plan_id in by_id)
    stale = [dict(r) for r in commits if r["writer_epoch"] is None or r["writer_epoch"] != r["lease_epoch"]
             or r["writer_shard"] != r["shard"] or not r["lease_live"]]  # fmt: skip
    epoch_bad = [dict(r) for r in leases if r["new_epoch"] < r["old_epoch"]
                 or (r["new_owner"] != r["old_owner"] and r["new_epoch"] <= r["old_epoch"])]  # fmt: skip
    kills = [f for f in faults if f["kind"] == "kill -9"]
    kill_times = [f["recovered_s"] for f in kills if f["recovered_s"] is not None]
    reattach = [f["workers_reattached_s"] for f in kills if f["workers_reattached_s"] is not None]
    stalls = [f for f in faults if f["kind"] == "SIGSTOP"]
    handoffs = [f for f in faults if f["kind"] == "SIGTERM"]

    def pct(xs: list[float], p: float) -> float | None:
        return round(h.percentile(xs, p), 3) if xs else None

    sent_at = {t.plan_id: t.sent_at for t in acked}
    lost_by_kind: Counter[str] = Counter()
    for plan_id in lost:  # against the last fault that began before it was sent
        kind = "before the faults"
        for start, fault_kind in windows or []:
            if start <= sent_at[plan_id]:
                kind = fault_kind
        lost_by_kind[kind] += 1
    follow: dict[str, dict[str, Any]] = {}  # per fault kind: back after the shard was served again
    for kind in ("kill -9", "SIGSTOP", "SIGTERM", "db freeze"):
        of_kind = [f for f in faults if f["kind"] == kind and "clients_back_s" in f]
        if not of_kind:
            continue
        row: dict[str, Any] = {"faults": len(of_kind), "lost": lost_by_kind.get(kind, 0)}
        for what in ("clients_back_s", "agents_back_s", "sims_back_s"):
            values = [v for f in of_kind for v in f[what].values()]
            measured = [v for v in values if v is not None and v == v]
            row[what.replace("_s", "_max_s")] = round(max(measured), 3) if measured else None
            row[what.replace("_s", "_p50_s")] = pct(measured, 50)
            row[what.replace("_back_s", "_not_back")] = sum(v is None for v in values)
        follow[kind] = row

    return {
        "submitted": len(tracked),
        "acknowledged": len(acked),
        "duplicate_acks": sum(t.duplicate for t in acked),
        "unacknowledged": len(tracked) - len(acked),
        "unacknowledged_but_stored": unacked_stored,
        "client_errors": Counter(t.error.split(":")[0] for t in tracked if t.error).most_common(5),
        "outcomes": dict(outcomes),
        "plans_rerun": reran,
        "lost": len(lost), "lost_ids": lost[:10],
        "duplicated": len(duplicated), "duplicated_ids": duplicated[:10],
        "gaps": len(gaps), "gap_details": gaps[:10],
        "illegal_transitions": len(illegal), "illegal_details": illegal[:10],
        "damaged_rows": len(damaged),
        "commits_logged": len(commits),
        "stale_epoch_commits": len(stale), "stale_details": [str(r) for r in stale[:5]],
        "lease_changes_logged": len(leases),
        "epoch_regressions": len(epoch_bad), "epoch_details": [str(r) for r in epoch_bad[:5]],
        "kills": len(kills),
        "failover_p50_s": pct(kill_times, 50), "failover_p99_s": pct(kill_times, 99),
        "failover_max_s": max(kill_times) if kill_times else None,
        "failovers_not_recovered": len(kills) - len(kill_times),
        "reattach_p50_s": pct(reattach, 50), "reattach_max_s": max(reattach) if reattach else None,
        "stall_fenced": [f"shards {f['shards']}: taken over after {f['taken_over_s']} s, fenced on SIGCONT "
                         f"{f['found_itself_fenced']}" for f in stalls],
        "stall_all_fenced": all(sorted(f["found_itself_fenced"]) == sorted(f["taken_over_while_stopped"])
                                and f["taken_over_while_stopped"] for f in stalls) if stalls else None,
        "handoff_s": [f["recovered_s"] for f in handoffs],
        "lost_by_fault_kind": dict(lost_by_kind),
        "back_after_served": follow,
    }  # fmt: skip


# ---------------------------------------------------------------------------- main


def report_lines(r: dict[str, Any]) -> list[str]:
    ok = lambda n: "ok" if n == 0 else "FAIL"  # noqa: E731
    return [
        f"fleetwire cluster chaos: {r['coordinators']} coordinators, {r['shards']} shards, {r['sims']} simulated "
        f"workers + {r['agents']} agents, PostgreSQL (fsync=on); {r['elapsed_s']} s "
        f"(faults {r['faults_phase_s']} s, drain {r['drain_s']} s)",
        f"  plans: submitted {r['submitted']}, acknowledged {r['acknowledged']} "
        f"({r['duplicate_acks']} answered duplicate=true after a re-send), outcomes {r['outcomes']}, "
        f"re-run after a lost lease {r['plans_rerun']}; not acknowledged {r['unacknowledged']} "
        f"({r['unacknowledged_but_stored']} of them stored) {r['client_errors'] or ''}",
        f"  faults: {r['actions']}",
        f"  kill -9 failover (kill -> first submit sent after it accepted, slowest shard of the victim), "
        f"{r['kills']} kills: p50 {r['failover_p50_s']} s, p99 {r['failover_p99_s']} s, max {r['failover_max_s']} s "
        f"(target p99 <= 5 s); not recovered within 30 s: {r['failovers_not_recovered']}",
        f"  sim workers re-attached after a kill -9: p50 {r['reattach_p50_s']} s, max {r['reattach_max_s']} s "
        f"(target <= 10 s)",
        f"  SIGSTOP past the lease, then SIGCONT: {r['stall_fenced']} (all fenced: {r['stall_all_fenced']})",
        f"  SIGTERM hand-off: submits accepted again after {r['handoff_s']} s",
        "  back after the shard is served again (slowest shard, s; target <= 5; default reconnect settings):",
        f"    {'fault':<10} {'n':>2} {'clients p50/max':>16} {'agents p50/max':>16} {'sims p50/max':>14} "
        f"{'not back':>9} {'acked lost':>10}",
        *(f"    {kind:<10} {row['faults']:>2} {_pair(row, 'clients'):>16} {_pair(row, 'agents'):>16} "
          f"{_pair(row, 'sims'):>14} {row['clients_not_back'] + row['agents_not_back'] + row['sims_not_back']:>9} "
          f"{row['lost']:>10}" for kind, row in r["back_after_served"].items()),
        f"  acknowledged plans lost, by the fault before their submit: {r['lost_by_fault_kind'] or 'none'}",
        "  checker:",
        f"    every acknowledged plan ends        lost {r['lost']:>4}  {ok(r['lost'])} {r['lost_ids'] or ''}",
        f"    exactly one accepted result         duplicated {r['duplicated']:>4}  {ok(r['duplicated'])} "
        f"{r['duplicated_ids'] or ''}",
        f"    no gap/duplicate in any stream      gaps {r['gaps']:>4}  {ok(r['gaps'])} {r['gap_details'] or ''}",
        f"    plan transitions legal              illegal {r['illegal_transitions']:>4}  "
        f"{ok(r['illegal_transitions'])} {r['illegal_details'] or ''}",
        f"    epochs only increase per shard      regressions {r['epoch_regressions']:>4}  "
        f"{ok(r['epoch_regressions'])} ({r['lease_changes_logged']} owner changes logged)",
        f"    no commit under a stale epoch       stale {r['stale_epoch_commits']:>4}  {ok(r['stale_epoch_commits'])} "
        f"({r['commits_logged']} committed writes logged) {r['stale_details'] or ''}",
        f"    rows failing their checksums        damaged {r['damaged_rows']:>4}  {ok(r['damaged_rows'])}",
        f"  database failover: {r['db_failover']}",
        f"  logs: {r['logs']}",
    ]


def _pair(row: dict[str, Any], what: str) -> str:
    return f"{row[f'{what}_back_p50_s']}/{row[f'{what}_back_max_s']}"


def passed(r: dict[str, Any]) -> bool:
    return (r["lost"] == r["duplicated"] == r["gaps"] == r["illegal_transitions"] == r["stale_epoch_commits"]
            == r["epoch_regressions"] == r["damaged_rows"] == 0 and r["stall_all_fenced"] is not False)  # fmt: skip


def _monotonic(record: logging.LogRecord) -> bool:
    record.monotonic = time.monotonic()
    return True


async def bench(ns: argparse.Namespace) -> dict[str, Any]:
    logs = Path(ns.logs) if ns.logs else Path(tempfile.mkdtemp(prefix="fleetwire-cluster-chaos-"))
    logs.mkdir(parents=True, exist_ok=True)
    # The clients' reconnect lines and each fault's start (fleetwire.chaos) go to the log dir, not the report.
    sdk_log = logging.getLogger("fleetwire")
    sdk_file = logging.FileHandler(logs / "clients.log")
    sdk_file.addFilter(_monotonic)  # stamped on the clock of the other processes' lines (Proc.lines)
    sdk_file.setFormatter(logging.Formatter("%(monotonic).3f %(message)s"))
    sdk_log.addHandler(sdk_file)
    sdk_log.setLevel(logging.DEBUG)  # DEBUG: the moves it followed and the sessions resumed after them
    sdk_log.propagate = False
    server: PostgresServer
    with postgres_server() as server:
        dsn = server.new_database()
        standby = None
        if ns.db_failover:
            standby = await asyncio.to_thread(server.replica)
            dsn = standby_dsn(server, standby, dsn.rsplit("/", 1)[1])
        run = Run(ns, dsn, logs, server, standby)
        try:
            return await run.main()
        finally:
            await run.stop_all()
            with contextlib.suppress(OSError):
                (logs / "postgresql.log").write_text(server.log_tail(2000))
            if standby is not None:
                with contextlib.suppress(OSError):
                    (logs / "postgresql-standby.log").write_text(standby.log_tail(2000))
                standby.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="bench", choices=("bench", "simulate"))
    parser.add_argument("--coordinators", type=int, default=3, help="coordinator processes (default 3)")
    parser.add_argument("--shards", type=int, default=6, help="shard slots, one pool each (default 6)")
    parser.add_argument("--sims", type=int, default=120, help="simulated workers, in one process (default 120)")
    parser.add_argument("--agents", type=int, default=None,
                        help="real worker agents, agent-i in pool i (default: one per shard)")
    parser.add_argument("--kills", type=int, default=10, help="kill -9 of a shard owner, each restarted (default 10)")
    parser.add_argument("--no-stall", dest="stall", action="store_false", help="skip the SIGSTOP past the lease")
    parser.add_argument("--no-handoff", dest="handoff", action="store_false", help="skip the SIGTERM hand-off")
    parser.add_argument("--rate", type=float, default=4.0, help="plans submitted per second per pool (default 4)")
    parser.add_argument("--plan-s", type=float, default=0.3, help="a plan sleeps U(0, this) seconds (default 0.3)")
    parser.add_argument("--lease-ttl", type=float, default=3.0, help="coordinators' --lease-ttl (default 3)")
    parser.add_argument("--lease-renew", type=float, default=1.0, help="coordinators' --lease-renew (default 1)")
    parser.add_argument("--stall-extra", type=float, default=2.0,
                        help="a SIGSTOP lasts the lease TTL plus this (default 2 s)")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of calm after each fault (default 3)")
    parser.add_argument("--worker-kill-every", type=float, default=1.5,
                        help="a simulated worker is killed every this many seconds (default 1.5)")
    parser.add_argument("--agent-kill-every", type=float, default=20.0,
                        help="a worker agent is kill -9-ed every this many seconds instead (default 20)")
    parser.add_argument("--drain", type=float, default=90.0, help="seconds for open plans to end after the faults")
    parser.add_argument("--db-failover", action="store_true",
                        help="also kill -9 the PostgreSQL primary and promote its synchronous standby")
    parser.add_argument("--db-freeze", type=float, default=20.0,
                        help="freeze PostgreSQL (SIGSTOP of the postmaster and its children) this many seconds, "
                             "once, among the faults; 0: no freeze (default 20)")
    parser.add_argument("--db-away", type=float, default=2.0,
                        help="--db-failover: seconds between the primary's kill and the promotion (default 2)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--logs", help="directory for every process's output (default: a new temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--urls", help=argparse.SUPPRESS)
    parser.add_argument("--pools", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.agents is None:
        ns.agents = ns.shards
    if ns.mode == "simulate":
        h.run_loop(simulate(ns.urls.split(","), ns.pools.split(","), "sim-", ns.count))
        return 0
    reason = missing_reason()
    if reason:
        print(f"cluster chaos: not run: {reason}", file=sys.stderr)
        return 2
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    r = h.run_loop(bench(ns))
    h.emit(r, ns.json, report_lines(r))
    return 0 if passed(r) else 1


if __name__ == "__main__":
    raise SystemExit(main())
