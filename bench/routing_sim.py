#!/usr/bin/env python3
"""Replay real LLM request traces through the real coordinator core, in virtual time.

Each request of a trace becomes a ``submit`` (op ``generate``, with routing hints: prompt and
output tokens, and the Mooncake trace's 512-token prefix-block hashes) fed to
``coordinator.core.Coordinator`` at its timestamp. Simulated workers answer the core's
``assign``/``revoke`` with ``accept``/``reject``/``done`` and send ``heartbeat`` load reports,
all as protocol messages: the placement under test is the coordinator's own code path.
Nothing sleeps and no socket is opened; an hour of trace replays in seconds.

A worker (bench/fleets/*.toml) is modelled as:

* ``max_concurrency`` slots, plus the coordinator's prefetch queue;
* a prefix-block LRU cache of ``prefix_cache_tokens`` (hits skip prefill), filled at prefill
  start, deepest block evicted first;
* one prefill engine, first come first served, at ``prefill_tokens_per_s`` for the prompt
  tokens the cache does not hold;
* decode at ``decode_tokens_per_s`` per sequence, slowed by ``decode_slowdown`` per other
  sequence decoding when it starts;
* energy = ``uj_per_token`` per generated token + ``uj_per_prefill_token`` per computed
  prompt token (idle power is left out: no policy changes it unless workers are switched
  off); emissions = energy in kWh x the zone's ``intensity_g_per_kwh``.

Columns: hit = prefix blocks found in cache / prompt blocks (the Mooncake trace's definition);
max/mean = requests served by the busiest worker / the mean; TTFT = arrival to first token;
E2E = arrival to last token. Reference rows: ``infinite cache`` (one shared cache that never
evicts: the hit-rate ceiling) and ``shared LRU`` (one LRU as large as the whole fleet's caches).

Usage: ``python bench/routing_sim.py`` replays both traces in ../shared/traces with their
default fleets; ``--trace PATH`` (Mooncake JSONL or Azure CSV, told apart by content),
``--fleet PATH``, ``--policies a,b``, ``--limit N`` (the first N requests), ``--json``.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import itertools
import json
import math
import os
import sys
import time
import tomllib
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trace_gen import TraceSpec, generate, grid  # noqa: E402 - bench/trace_gen.py, beside this script

from coordinator.core import Coordinator, CoreConfig  # noqa: E402 - after the path tweak above
from coordinator.placement.placer import PlacementConfig  # noqa: E402
from coordinator.placement.policies import POLICY_NAMES, PolicyKnobs  # noqa: E402
from protocol import errors  # noqa: E402
from protocol.messages import (  # noqa: E402
    Accept,
    Assign,
    Capabilities,
    Done,
    Heartbeat,
    Hello,
    Load,
    Reject,
    Revoke,
    RoutingHints,
    Submit,
    Welcome,
)

TRACES = ROOT.parent / "shared" / "traces"
DEFAULT_TRACES = ("mooncake_conversation_trace.jsonl", "AzureLLMInferenceTrace_conv.csv")
FLEETS = Path(__file__).resolve().parent / "fleets"
DEFAULT_FLEET = {"mooncake": "homogeneous-h100x8.toml", "azure": "heterogeneous.toml"}
MOONCAKE_BLOCK_TOKENS = 512
UJ_PER_KWH = 3.6e12


# ---------------------------------------------------------------------------- traces


@dataclass(frozen=True, slots=True)
class Request:
    """One trace row."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hashes: tuple[int, ...] = ()


@dataclass
class Trace:
    kind: str  # "mooncake" or "azure"
    path: Path
    requests: list[Request]
    total: int  # rows in the file, before --limit


def load_trace(path: Path, limit: int | None = None, speedup: float = 1.0) -> Trace:
    """Read a Mooncake JSONL or an Azure CSV trace, told apart by its first byte.

    ``speedup`` divides the timestamps: 2 replays the same requests at twice the rate.
    """
    with path.open("rb") as f:
        head = f.read(64).lstrip()
    if head.startswith(b"{"):
        kind, requests = "mooncake", list(_mooncake(path))
    elif head.upper().startswith(b"TIMESTAMP"):
        kind, requests = "azure", list(_azure(path))
    else:
        raise ValueError(f"{path}: neither a Mooncake JSONL trace nor an Azure CSV trace (starts with {head[:20]!r})")
    if speedup != 1.0:
        requests = [Request(r.arrival_s / speedup, r.prompt_tokens, r.output_tokens, r.hashes) for r in requests]
    requests.sort(key=lambda r: r.arrival_s)
    total = len(requests)
    if limit is not None:
        requests = requests[:limit]
    return Trace(kind, path, requests, total)


def _mooncake(path: Path) -> Iterator[Request]:
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                hashes = tuple(row["hash_ids"])
                yield Request(row["timestamp"] / 1000.0, row["input_length"], row["output_length"], hashes)
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a Mooncake trace row ({exc})") from None


def _azure(path: Path) -> Iterator[Request]:
    start: datetime | None = None
    with path.open(newline="") as f:
        for number, row in enumerate(csv.DictReader(f), 2):
            try:
                stamp = row["TIMESTAMP"].strip()
                day, _, fraction = stamp.partition(".")
                when = datetime.strptime(day, "%Y-%m-%d %H:%M:%S")
                start = start or when
                seconds = (when - start).total_seconds() + (float("0." + fraction) if fraction else 0.0)
                yield Request(seconds, int(row["ContextTokens"]), int(row["GeneratedTokens"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not an Azure trace row ({exc})") from None


# ---------------------------------------------------------------------------- fleets


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    max_concurrency: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    decode_slowdown: float
    uj_per_token: float
    uj_per_prefill_token: float
    intensity_g_per_kwh: float
    zone: str = ""
    kv_blocks: int = 0
    kv_block_tokens: int = 16
    prefix_cache_tokens: int = 0


@dataclass(frozen=True)
class Fleet:
    name: str
    path: Path
    workers: tuple[WorkerSpec, ...]

    @property
    def cache_tokens(self) -> int:
        return sum(w.prefix_cache_tokens for w in self.workers)


_REQUIRED = ("max_concurrency", "prefill_tokens_per_s", "decode_tokens_per_s", "uj_per_token", "intensity_g_per_kwh")


def load_fleet(path: Path) -> Fleet:
    """A fleet TOML: ``name`` and ``[[workers]]`` groups with a ``count`` each."""
    with path.open("rb") as f:
        data = tomllib.load(f)
    groups = data.get("workers")
    if not isinstance(groups, list) or not groups:
        raise ValueError(f"{path}: a fleet needs at least one [[workers]] table")
    workers: list[WorkerSpec] = []
    for index, group in enumerate(groups, 1):
        missing = [key for key in _REQUIRED if key not in group]
        if missing:
            raise ValueError(f"{path}: [[workers]] #{index} lacks {', '.join(missing)}")
        name = str(group.get("name", f"w{index}"))
        count = int(group.get("count", 1))
        for n in range(1, count + 1):
            workers.append(
                WorkerSpec(
                    name=f"{name}-{n}" if count > 1 else name,
                    max_concurrency=int(group["max_concurrency"]),
                    prefill_tokens_per_s=float(group["prefill_tokens_per_s"]),
                    decode_tokens_per_s=float(group["decode_tokens_per_s"]),
                    decode_slowdown=float(group.get("decode_slowdown", 0.0)),
                    uj_per_token=float(group["uj_per_token"]),
                    uj_per_prefill_token=float(group.get("uj_per_prefill_token", 0.0)),
                    intensity_g_per_kwh=float(group["intensity_g_per_kwh"]),
                    zone=str(group.get("zone", "")),
                    kv_blocks=int(group.get("kv_blocks", 0)),
                    kv_block_tokens=int(group.get("kv_block_tokens", 16)),
                    prefix_cache_tokens=int(group.get("prefix_cache_tokens", 0)),
                )
            )
    return Fleet(str(data.get("name", path.stem)), path, tuple(workers))


# ---------------------------------------------------------------------------- simulated workers


@dataclass(slots=True)
class _Job:
    index: int  # the request's row
    plan_id: str
    attempt: int
    prompt_tokens: int
    uncached: int = 0


@dataclass
class SimWorker:
    """One worker: slots, a prefetch queue, a prefix LRU, one prefill engine, decode slots."""

    spec: WorkerSpec
    conn_id: int
    cache_blocks: int
    prefetch: int = 0
    running: int = 0  # accepted and not done
    decoding: int = 0
    waiting: deque[_Job] = field(default_factory=deque)
    prefill_free_s: float = 0.0
    queued_tokens: int = 0  # prompt tokens accepted, not yet prefilled
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    served: int = 0
    energy_uj: float = 0.0
    latencies_ms: deque[float] = field(default_factory=lambda: deque(maxlen=200))

    def lookup(self, hashes: Sequence[int]) -> int:
        """Leading blocks held; touches them and inserts the rest (deepest evicted first)."""
        cache = self.cache
        hit = 0
        for h in hashes:
            if h not in cache:
                break
            hit += 1
        for h in reversed(hashes):
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
        while len(cache) > self.cache_blocks:
            cache.popitem(last=False)
        return hit

    def load(self) -> Load:
        waiting_tokens = sum(job.prompt_tokens for job in self.waiting)
        lat = sorted(self.latencies_ms)
        p50 = lat[len(lat) // 2] if lat else 0.0
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0
        return Load(
            in_flight=self.running,
            queued=len(self.waiting),
            queued_tokens=self.queued_tokens + waiting_tokens,
            latency_p50_ms=p50,
            latency_p99_ms=p99,
            uj_per_token=self.spec.uj_per_token,
            zone_intensity_g_per_kwh=self.spec.intensity_g_per_kwh,
        )


@dataclass
class RowResult:
    trace: str
    fleet: str
    policy: str
    requests: int
    hit_rate: float | None
    max_over_mean: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    energy_kwh: float | None
    emissions_g: float | None
    revokes: int = 0
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Replay:
    """One policy over one trace on one fleet, through a real ``Coordinator``."""

    PREFILL, DECODE, BEAT = 0, 1, 2

    def __init__(
        self,
        trace: Trace,
        fleet: Fleet,
        policy: str,
        *,
        prefetch: int = 0,
        heartbeat_s: float = 10.0,
        knobs: PolicyKnobs | None = None,
    ) -> None:
        self.trace = trace
        self.fleet = fleet
        self.policy = policy
        self.heartbeat_s = heartbeat_s
        placement = PlacementConfig(policy=policy, prefetch=prefetch, knobs=knobs or PolicyKnobs())
        ids = (f"x{n}" for n in itertools.count())
        # The heartbeat timeout is out of reach: this replay is about placement, not reaping; one
        # client submits the whole trace, so no plan quota.
        config = CoreConfig(
            heartbeat_interval_s=heartbeat_s, heartbeat_timeout_s=1e9, placement=placement, max_plans_per_client=0
        )
        self.core = Coordinator(config, new_id=lambda: next(ids))
        self.client = 1
        self.workers: dict[str, SimWorker] = {}
        self.by_conn: dict[int, SimWorker] = {}
        self.events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self.jobs: dict[str, _Job] = {}
        n = len(trace.requests)
        self.worker_of = [""] * n
        self.hit_blocks = [0] * n
        self.ttft = [math.nan] * n
        self.e2e = [math.nan] * n
        self.revokes = 0
        self._arrivals_over = False

    # ---- core I/O

    def _deliver(self, now: float) -> None:
        """Carry out the core's effects: assign/revoke reach the simulated workers at once."""
        while True:
            effects = self.core.take_effects()
            if not effects.sends:
                return
            for conn_id, msgs in effects.sends.items():
                worker = self.by_conn.get(conn_id)
                if worker is None:
                    continue  # the client's replies: not needed
                for msg in msgs:
                    if isinstance(msg, Assign):
                        self._on_assign(worker, msg, now)
                    elif isinstance(msg, Revoke):
                        self._on_revoke(worker, msg, now)
                    elif isinstance(msg, Welcome):
                        worker.prefetch = msg.prefetch

    def _send(self, worker: SimWorker, msg: Any, now: float) -> None:
        self.core.receive(worker.conn_id, msg, now)

    def _push(self, when: float, kind: int, payload: Any) -> None:
        heapq.heappush(self.events, (when, next(self._seq), kind, payload))

    # ---- worker behaviour

    def _on_assign(self, worker: SimWorker, msg: Assign, now: float) -> None:
        index = int(msg.plan_id[1:])
        job = _Job(index, msg.plan_id, msg.attempt, self.trace.requests[index].prompt_tokens)
        if worker.running < worker.spec.max_concurrency:
            self._start(worker, job, now)
        elif len(worker.waiting) < worker.prefetch:
            worker.waiting.append(job)
        else:
            self._send(worker, Reject(plan_id=msg.plan_id, attempt=msg.attempt, reason="full"), now)

    def _on_revoke(self, worker: SimWorker, msg: Revoke, now: float) -> None:
        for job in worker.waiting:
            if job.plan_id == msg.plan_id and job.attempt == msg.attempt:
                worker.waiting.remove(job)
                self.revokes += 1
                self._send(worker, Reject(plan_id=msg.plan_id, attempt=msg.attempt, code=errors.REVOKED), now)
                return

    def _start(self, worker: SimWorker, job: _Job, now: float) -> None:
        request = self.trace.requests[job.index]
        worker.running += 1
        hit = worker.lookup(request.hashes) if request.hashes else 0
        job.uncached = max(0, request.prompt_tokens - hit * MOONCAKE_BLOCK_TOKENS)
        self.hit_blocks[job.index] = hit
        self.worker_of[job.index] = worker.spec.name
        start = max(now, worker.prefill_free_s)
        worker.prefill_free_s = start + job.uncached / worker.spec.prefill_tokens_per_s
        worker.queued_tokens += job.uncached
        self._push(worker.prefill_free_s, self.PREFILL, (worker, job))
        self._send(worker, Accept(plan_id=job.plan_id, attempt=job.attempt), now)

    def _prefilled(self, worker: SimWorker, job: _Job, now: float) -> None:
        request = self.trace.requests[job.index]
        worker.queued_tokens -= job.uncached
        self.ttft[job.index] = now - request.arrival_s
        worker.decoding += 1
        spec = worker.spec
        rate = spec.decode_tokens_per_s / (1.0 + spec.decode_slowdown * (worker.decoding - 1))
        self._push(now + request.output_tokens / rate, self.DECODE, (worker, job))

    def _decoded(self, worker: SimWorker, job: _Job, now: float) -> None:
        request = self.trace.requests[job.index]
        spec = worker.spec
        worker.decoding -= 1
        worker.running -= 1
        worker.served += 1
        worker.energy_uj += spec.uj_per_token * request.output_tokens + spec.uj_per_prefill_token * job.uncached
        e2e = now - request.arrival_s
        self.e2e[job.index] = e2e
        worker.latencies_ms.append(e2e * 1000.0)
        if worker.waiting:
            self._start(worker, worker.waiting.popleft(), now)
        self._send(worker, Done(plan_id=job.plan_id, attempt=job.attempt, outcome="succeeded"), now)

    # ---- the replay

    def run(self) -> RowResult:
        began = time.perf_counter()
        core = self.core
        core.open_session(self.client, "client", 0.0, principal="sim")
        for number, spec in enumerate(self.fleet.workers):
            conn_id = 100 + number
            cache_blocks = spec.prefix_cache_tokens // MOONCAKE_BLOCK_TOKENS
            worker = SimWorker(spec, conn_id, cache_blocks)
            self.workers[spec.name] = self.by_conn[conn_id] = worker
            core.open_session(conn_id, "worker", 0.0, principal="worker")
            caps = Capabilities(
                accelerator="gpu",
                ops=["generate"],
                max_concurrency=spec.max_concurrency,
                kv_blocks=spec.kv_blocks,
                kv_block_tokens=spec.kv_block_tokens,
                prefix_cache_tokens=spec.prefix_cache_tokens,
                carbon_zone=spec.zone,
            )
            core.receive(conn_id, Hello(worker_id=spec.name, capabilities=caps), 0.0)
            self._deliver(0.0)
            # Beats are staggered over one interval, as jittered real workers would be.
            self._push(self.heartbeat_s * number / len(self.fleet.workers), self.BEAT, worker)
        events = self.events
        requests = self.trace.requests
        for index, request in enumerate(requests):
            now = request.arrival_s
            while events and events[0][0] <= now:
                self._step(heapq.heappop(events))
            hints = RoutingHints(
                prefix_hashes=list(request.hashes),
                prompt_tokens=request.prompt_tokens,
                max_output_tokens=request.output_tokens,
                prefix_block_tokens=MOONCAKE_BLOCK_TOKENS if request.hashes else 0,
            )
            submit = Submit(req_id=index + 1, op="generate", plan_id=f"r{index}", subscribe=False, hints=hints)
            core.receive(self.client, submit, now)
            self._deliver(now)
        self._arrivals_over = True
        while events:
            self._step(heapq.heappop(events))
        return self._result(time.perf_counter() - began)

    def _busy(self) -> bool:
        return not self._arrivals_over or len(self.core.queue) > 0 or any(w.running for w in self.workers.values())

    def _step(self, event: tuple[float, int, int, Any]) -> None:
        now, _, kind, payload = event
        if kind == self.PREFILL:
            self._prefilled(payload[0], payload[1], now)
        elif kind == self.DECODE:
            self._decoded(payload[0], payload[1], now)
            self._deliver(now)
        else:
            worker = payload
            self._send(worker, Heartbeat(load=worker.load()), now)
            self._deliver(now)
            if self._busy():
                self._push(now + self.heartbeat_s, self.BEAT, worker)

    def _result(self, wall_s: float) -> RowResult:
        requests = self.trace.requests
        served = [w.served for w in self.workers.values()]
        blocks = sum(len(r.hashes) for r in requests)
        energy_uj = sum(w.energy_uj for w in self.workers.values())
        grams = sum(w.energy_uj / UJ_PER_KWH * w.spec.intensity_g_per_kwh for w in self.workers.values())
        ttft = [x for x in self.ttft if not math.isnan(x)]
        e2e = [x for x in self.e2e if not math.isnan(x)]
        return RowResult(
            trace=self.trace.kind,
            fleet=self.fleet.name,
            policy=self.policy,
            requests=len(e2e),
            hit_rate=sum(self.hit_blocks) / blocks if blocks else None,
            max_over_mean=max(served) / (sum(served) / len(served)) if sum(served) else None,
            ttft_p50_s=_pct(ttft, 0.50),
            ttft_p99_s=_pct(ttft, 0.99),
            e2e_p50_s=_pct(e2e, 0.50),
            e2e_p99_s=_pct(e2e, 0.99),
            energy_kwh=energy_uj / UJ_PER_KWH,
            emissions_g=grams,
            revokes=self.revokes,
            wall_s=wall_s,
        )


# ---------------------------------------------------------------------------- reference rows


def infinite_cache_row(trace: Trace, fleet: Fleet) -> RowResult:
    """One shared cache that never evicts: the hit-rate ceiling of any routing."""
    seen: set[int] = set()
    hit = total = 0
    for request in trace.requests:
        for h in request.hashes:
            if h not in seen:
                break
            hit += 1
        total += len(request.hashes)
        seen.update(request.hashes)
    return _reference(trace, fleet, "infinite cache (ceiling)", hit / total if total else None)


def shared_lru_row(trace: Trace, fleet: Fleet) -> RowResult:
    """One LRU as large as all the fleet's caches together: what LRU caches of this size can hold."""
    blocks = fleet.cache_tokens // MOONCAKE_BLOCK_TOKENS
    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for request in trace.requests:
        hashes = request.hashes
        for h in hashes:
            if h not in cache:
                break
            hit += 1
        total += len(hashes)
        for h in reversed(hashes):
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
        while len(cache) > blocks:
            cache.popitem(last=False)
    return _reference(trace, fleet, "one shared LRU, fleet-sized", hit / total if total else None)


def _reference(trace: Trace, fleet: Fleet, name: str, hit: float | None) -> RowResult:
    return RowResult(trace.kind, fleet.name, name, len(trace.requests), hit, None, None, None, None, None, None, None)


# ---------------------------------------------------------------------------- output


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


HEADER = ("policy", "requests", "hit", "max/mean", "TTFT p50", "TTFT p99", "E2E p50", "E2E p99", "kWh", "gCO2e")


def table(rows: Sequence[RowResult]) -> str:
    """A Markdown table of the rows."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        cells = (
            r.policy,
            str(r.requests),
            _fmt(None if r.hit_rate is None else 100 * r.hit_rate, ".1f") + ("%" if r.hit_rate is not None else ""),
            _fmt(r.max_over_mean, ".3f"),
            _fmt(r.ttft_p50_s, ".2f") + ("s" if r.ttft_p50_s is not None else ""),
            _fmt(r.ttft_p99_s, ".2f") + ("s" if r.ttft_p99_s is not None else ""),
            _fmt(r.e2e_p50_s, ".2f") + ("s" if r.e2e_p50_s is not None else ""),
            _fmt(r.e2e_p99_s, ".2f") + ("s" if r.e2e_p99_s is not None else ""),
            _fmt(r.energy_kwh, ".2f"),
            _fmt(r.emissions_g, ".0f"),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- synthetic grids


HIT_FLOOR = 0.98  # the grid's goal: hit rate >= 98 % of the fleet-sized shared LRU's ...
BALANCE_CEILING = 1.10  # ... at max/mean <= 1.10 (docs/ROUTING.md §Synthetic grid)


def synthetic_trace(spec: TraceSpec) -> Trace:
    """A generated trace (bench/trace_gen.py), read as the Mooncake rows it mimics."""
    requests = [
        Request(row["timestamp"] / 1000.0, row["input_length"], row["output_length"], tuple(row["hash_ids"]))
        for row in generate(spec)
    ]
    return Trace(spec.name, Path(f"synthetic:{spec.name}"), requests, len(requests))


GRID_HEADER = ("trace", "policy", "requests", "hit", "LRU ceiling", "hit / ceiling", "max/mean", "TTFT p99", "goal")


def grid_table(rows: Sequence[RowResult], ceilings: dict[str, float | None]) -> str:
    """One line per (trace, policy): hit against the fleet-sized shared LRU, balance, and whether both goals hold."""
    lines = ["| " + " | ".join(GRID_HEADER) + " |", "|" + "---|" * len(GRID_HEADER)]
    for r in rows:
        ceiling = ceilings.get(r.trace)
        share = r.hit_rate / ceiling if r.hit_rate is not None and ceiling else None
        ok = share is not None and share >= HIT_FLOOR and (r.max_over_mean or math.inf) <= BALANCE_CEILING
        cells = (
            r.trace,
            r.policy,
            str(r.requests),
            _fmt(None if r.hit_rate is None else 100 * r.hit_rate, ".1f") + "%",
            _fmt(None if ceiling is None else 100 * ceiling, ".1f") + "%",
            _fmt(None if share is None else 100 * share, ".2f") + "%",
            _fmt(r.max_over_mean, ".3f"),
            _fmt(r.ttft_p99_s, ".2f") + "s",
            "yes" if ok else "**no**",
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def synthetic_main(ns: argparse.Namespace, policies: list[str], knobs: PolicyKnobs) -> int:
    """``--synthetic GRID``: every policy on every trace of the grid, as one table (or JSON rows)."""
    try:
        specs = grid(ns.synthetic, ns.seed, ns.scale)
        fleet = load_fleet(ns.fleet or FLEETS / DEFAULT_FLEET["mooncake"])
    except (OSError, ValueError, tomllib.TOMLDecodeError) as exc:
        print(f"routing_sim: error: {exc}", file=sys.stderr)
        return 2
    if ns.prefix_cache_tokens is not None:
        specs_ = tuple(replace(w, prefix_cache_tokens=ns.prefix_cache_tokens) for w in fleet.workers)
        fleet = Fleet(f"{fleet.name}, {ns.prefix_cache_tokens:,}-token prefix caches", fleet.path, specs_)
    began = time.perf_counter()
    traces = [synthetic_trace(spec) for spec in specs]
    if ns.limit is not None:
        traces = [Trace(t.kind, t.path, t.requests[: ns.limit], t.total) for t in traces]
    jobs = [(trace, fleet, policy, ns.prefetch, knobs) for trace in traces for policy in policies]
    if ns.jobs > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(ns.jobs) as pool:
            results = list(pool.map(_replay, jobs))
    else:
        results = [_replay(job) for job in jobs]
    lru = {trace.kind: shared_lru_row(trace, fleet) for trace in traces}
    if ns.json:
        for trace in traces:
            for row in [r for r in results if r.trace == trace.kind] + [lru[trace.kind]]:
                print(json.dumps(row.as_dict()))
        return 0
    print(f"\n## synthetic grid {ns.synthetic!r} (seed {ns.seed}, scale {ns.scale:g}): {len(traces)} traces on "
          f"{fleet.name} ({len(fleet.workers)} workers, prefetch {ns.prefetch})\n")
    print(grid_table(results, {kind: row.hit_rate for kind, row in lru.items()}))
    met = sum(
        1 for r in results
        if r.hit_rate is not None and (c := lru[r.trace].hit_rate) and r.hit_rate >= HIT_FLOOR * c
        and (r.max_over_mean or math.inf) <= BALANCE_CEILING
    )
    print(f"\ngoal (hit >= {HIT_FLOOR:.0%} of the shared LRU, max/mean <= {BALANCE_CEILING}): "
          f"{met} of {len(results)} runs; replayed in {time.perf_counter() - began:.1f} s")
    return 0


# ---------------------------------------------------------------------------- main


def _replay(args: tuple[Trace, Fleet, str, int, PolicyKnobs]) -> RowResult:
    trace, fleet, policy, prefetch, knobs = args
    _quiet()
    return Replay(trace, fleet, policy, prefetch=prefetch, knobs=knobs).run()


def _knob(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep or name not in PolicyKnobs.__dataclass_fields__:
        names = ", ".join(PolicyKnobs.__dataclass_fields__)
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, NAME one of {names}")
    return name, float(value)


def _quiet() -> None:
    """Only warnings from the core: its info lines (a worker registered...) would bury the tables."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--trace", action="append", type=Path, metavar="PATH",
                        help="a Mooncake JSONL or Azure CSV trace (repeatable; default: both in ../shared/traces)")
    parser.add_argument("--fleet", type=Path, metavar="PATH",
                        help="fleet TOML (default: bench/fleets/homogeneous-h100x8.toml for Mooncake, "
                             "heterogeneous.toml for Azure)")
    parser.add_argument("--policies", default=None,
                        help="comma-separated (default: all; kv_aware with --synthetic)")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="replay only the first N requests")
    parser.add_argument("--speedup", type=float, default=1.0, metavar="F",
                        help="replay F times faster than recorded (more load on the same fleet)")
    parser.add_argument("--prefix-cache-tokens", type=int, default=None, metavar="N",
                        help="give every worker a prefix cache of N tokens instead of the fleet file's")
    parser.add_argument("--prefetch", type=int, default=0, metavar="N", help="the coordinator's --prefetch")
    parser.add_argument("--knob", type=_knob, action="append", default=[], metavar="NAME=VALUE",
                        help="a policy knob, e.g. kv_balance_gap=5000 (repeatable)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes (default 2)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row instead of tables")
    parser.add_argument("--synthetic", metavar="GRID",
                        help="replay a grid of generated traces (bench/trace_gen.py: default, tiny) instead of files")
    parser.add_argument("--seed", type=int, default=1, help="the synthetic grid's seed (default 1)")
    parser.add_argument("--scale", type=float, default=1.0, metavar="F",
                        help="multiply every synthetic trace's duration by F (default 1)")
    ns = parser.parse_args(argv)
    default_policies = "kv_aware" if ns.synthetic else ",".join(POLICY_NAMES)
    policies = [p.strip() for p in (ns.policies or default_policies).split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(POLICY_NAMES)}")
    knobs = PolicyKnobs(**{name: (int(v) if name == "kv_min_match_blocks" else v) for name, v in ns.knob})
    if ns.synthetic:
        return synthetic_main(ns, policies, knobs)
    paths = ns.trace or [TRACES / name for name in DEFAULT_TRACES]
    present = [p for p in paths if p.is_file()]
    for missing in sorted(set(paths) - set(present)):
        print(f"routing_sim: trace {missing} is absent; skipping it (see docs/ROUTING.md §Measured on real traces)",
              flush=True)
    if not present:
        print("routing_sim: no trace to replay; nothing measured.", flush=True)
        return 0
    jobs: list[tuple[Trace, Fleet, str, int, PolicyKnobs]] = []
    setups: list[tuple[Trace, Fleet]] = []
    for path in present:
        try:
            trace = load_trace(path, ns.limit, ns.speedup)
            fleet = load_fleet(ns.fleet or FLEETS / DEFAULT_FLEET[trace.kind])
            if ns.prefix_cache_tokens is not None:
                specs = tuple(replace(w, prefix_cache_tokens=ns.prefix_cache_tokens) for w in fleet.workers)
                fleet = Fleet(f"{fleet.name}, {ns.prefix_cache_tokens:,}-token prefix caches", fleet.path, specs)
        except (OSError, ValueError, tomllib.TOMLDecodeError) as exc:
            print(f"routing_sim: error: {exc}", file=sys.stderr)
            return 2
        setups.append((trace, fleet))
        jobs += [(trace, fleet, policy, ns.prefetch, knobs) for policy in policies]
    began = time.perf_counter()
    if ns.jobs > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(ns.jobs) as pool:
            results = list(pool.map(_replay, jobs))
    else:
        results = [_replay(job) for job in jobs]
    for trace, fleet in setups:
        rows = [r for r in results if r.trace == trace.kind]
        if trace.kind == "mooncake":
            rows += [shared_lru_row(trace, fleet), infinite_cache_row(trace, fleet)]
        if ns.json:
            for row in rows:
                print(json.dumps(row.as_dict()))
            continue
        span = trace.requests[-1].arrival_s - trace.requests[0].arrival_s if trace.requests else 0.0
        print(f"\n## {trace.path.name}: {len(trace.requests)} of {trace.total} requests replayed "
              f"({span / 60:.1f} min of trace{'' if ns.speedup == 1 else f', {ns.speedup:g}x faster'}) on "
              f"{fleet.name} ({len(fleet.workers)} workers, prefetch {ns.prefetch})\n")
        print(table(rows))
        revokes = {r.policy: r.revokes for r in rows if r.revokes}
        if revokes:
            print(f"\nrevoked (stolen) leases: {revokes}")
    if not ns.json:
        print(f"\nreplayed {len(jobs)} runs in {time.perf_counter() - began:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
