"""Starting the daemons from the command line: ``fleetwire coordinator`` and ``fleetwire worker``.

The coordinator's flags (:func:`add_server_arguments`) and the settings built from them
(:func:`server_settings`: ``CoreConfig`` and ``ServerSettings``), the start and the serving until
a signal or a fail-stop (:func:`run_coordinator`; cluster mode in fleetwire/cli/shards.py), the
worker agent's start (:func:`run_worker_command`; its flags are worker_agent/main.py's), and what
both daemons share: the collector's thresholds (:func:`tune_gc_for_daemon`) and :func:`version`.
``fleetwire up`` (fleetwire/cli/up.py) builds on these. The coordinator and the worker agent are
imported only inside the functions that run them, so the SDK never depends on them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import os
import signal
import sys
from typing import Any

from fleetwire.cli.console import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from fleetwire.cli.safety import unsafe_tokens, warn_plaintext
from fleetwire.cli.security import add_security_arguments, plan_limit_settings, security_settings
from fleetwire.cli.store import add_store_loss_argument, store_exit_code
from protocol.relay import DEFAULT_IDLE_S as DEFAULT_RELAY_IDLE_S
from protocol.relay import DEFAULT_MAX_BYTES as DEFAULT_RELAY_MAX_BYTES
from wireio.spin import add_spin_argument, apply_spin_argument

__all__ = [
    "DAEMON_GC_THRESHOLDS", "add_server_arguments", "fail", "routing_settings", "run_coordinator",
    "run_worker_command", "server_settings", "tune_gc_for_daemon", "version", "wait_for_signal",
]

# Daemons allocate a few container objects per message and keep every plan they know: with
# CPython's default first threshold (700) the collector runs every few dozen messages and its
# older generations rescan the kept plans. A larger first threshold cut the coordinator's CPU
# per plan by about a fifth in bench/throughput.py (docs/PERFORMANCE.md); garbage cycles still
# go, just in larger batches.
DAEMON_GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc_for_daemon() -> None:
    """Raise the collector's thresholds for a long-running coordinator or worker process."""
    gc.freeze()  # what start-up built (modules, parsers) is never scanned again
    gc.set_threshold(*DAEMON_GC_THRESHOLDS)


def fail(message: str, code: int = EXIT_USAGE) -> int:
    """Print ``fleetwire: error: MESSAGE`` to stderr; the exit status ``code``."""
    print(f"fleetwire: error: {message}", file=sys.stderr)
    return code


def version() -> str:
    """This fleetwire's version (told to workers; ``--version``)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("fleetwire")
    except PackageNotFoundError:
        return "0+unknown"




def server_settings(ns: argparse.Namespace, worker_tokens: tuple[str, ...], client_tokens: tuple[str, ...]) -> Any:
    from coordinator.core import CoreConfig
    from coordinator.data_plane import key_rotation_problem, publish_s
    from coordinator.io.frontdoor.server import ServerSettings

    overlap = publish_s(ns.worker_reconnect_grace_s)  # a key's life past the TTL (coordinator/data_plane.py)
    if (ns.store or os.environ.get("FLEETWIRE_STORE") or "").startswith("postgresql://"):
        from coordinator.io.cluster.shared_keys import overlap_s

        cluster = cluster_settings(ns)
        overlap = max(overlap, overlap_s(cluster.lease_ttl_s, cluster.scan_s, ns.worker_reconnect_grace_s))
    if (problem := key_rotation_problem(ns.data_ticket_ttl, ns.data_key_rotation, overlap)) is not None:
        raise ValueError(problem)
    core = CoreConfig(
        heartbeat_interval_s=ns.heartbeat_interval,
        heartbeat_timeout_s=ns.heartbeat_timeout,
        worker_reconnect_grace_s=ns.worker_reconnect_grace_s,
        preemption_grace_s=ns.preemption_grace,
        preemption_min_run_s=ns.preemption_min_run,
        breaker_fraction=ns.breaker_fraction,
        plan_retention_s=ns.plan_retention,
        plan_retention_bytes=ns.plan_retention_bytes,
        data_ticket_ttl_s=ns.data_ticket_ttl,
        data_key_rotation_s=ns.data_key_rotation,
        relay_max_bytes=ns.relay_max_bytes,
        relay_principal_bytes=ns.relay_principal_bytes,
        relay_session_bytes=ns.relay_session_bytes,
        relay_idle_s=ns.relay_idle,
        **routing_settings(ns),
        **plan_limit_settings(ns),
        **carbon_settings(ns),
    )
    return ServerSettings(
        host=ns.host,
        port=ns.port,
        worker_tokens=worker_tokens,
        client_tokens=client_tokens,
        insecure=getattr(ns, "insecure", False),
        core=core,
        reaper_interval_s=ns.reaper_interval,
        max_frame_bytes=ns.max_frame_bytes,
        store=ns.store or os.environ.get("FLEETWIRE_STORE") or "sqlite",
        cluster=cluster_settings(ns),
        data_dir=ns.data_dir,
        accept_store_loss=ns.accept_store_loss,
        store_writer=getattr(ns, "store_writer", "process"),
        autoscale_hook=ns.autoscale_hook,
        autoscale_provider=_autoscale_provider(ns),
        openai=not ns.no_openai,
        openai_queue_timeout_s=ns.openai_queue_timeout,
        openai_durable=ns.openai_durable == "on",
        openai_rate=ns.openai_rate,
        openai_burst=ns.openai_burst,
        otlp_endpoint=ns.otlp_endpoint,
        carbon_forecast=carbon_source(ns),
        carbon_forecast_max_age_s=ns.carbon_forecast_max_age,
        **security_settings(ns),
    )


def carbon_settings(ns: argparse.Namespace) -> dict[str, Any]:
    """The planner's knobs of ``CoreConfig`` (``--carbon-option``; coordinator/carbon_time/planner.py)."""
    from coordinator.carbon_time import ShiftConfig

    if not ns.carbon_option:
        return {}
    try:
        return {"carbon": ShiftConfig(**dict(ns.carbon_option))}
    except ValueError as exc:
        raise ValueError(f"--carbon-option: {exc}") from None


_CARBON_OPTIONS = ("quantum_s", "run_margin", "queue_margin_s", "min_gain", "hold_share")


def _carbon_option(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep or name.strip() not in _CARBON_OPTIONS:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME one of {', '.join(_CARBON_OPTIONS)}")
    try:
        return name.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} needs a number, got {value!r}") from None


def carbon_source(ns: argparse.Namespace) -> Any:
    """``--carbon-forecast`` and its zone and interval (coordinator/carbon_time/sources.py), or None."""
    from coordinator.carbon_time import parse_source

    if not ns.carbon_forecast:
        return None
    if not ns.carbon_forecast_max_age > 0:  # NaN too
        raise ValueError(f"--carbon-forecast-max-age must be > 0 seconds, got {ns.carbon_forecast_max_age}")
    return parse_source(ns.carbon_forecast, ns.carbon_forecast_zone, ns.carbon_forecast_interval)


def cluster_settings(ns: argparse.Namespace) -> Any:
    """Cluster mode's settings (docs/CLUSTER.md; used with a postgresql:// store only)."""
    from coordinator.shards import ClusterConfig

    partitions = tuple(item for given in ns.pool_partitions for item in given)
    return ClusterConfig(name=ns.cluster_name, shards=ns.shards, lease_ttl_s=ns.lease_ttl, lease_renew_s=ns.lease_renew,
                         partitions=tuple(sorted(dict(partitions).items())))


def pool_partitions(text: str) -> Any:
    """``--pool-partitions gpu=4,llm=2`` (argparse type): ``((pool, K), ...)``."""
    from coordinator.shards import parse_partitions

    try:
        return parse_partitions(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--pool-partitions: ")) from None


def routing_settings(ns: argparse.Namespace) -> dict[str, Any]:
    """The placement and autoscaler parts of ``CoreConfig`` (docs/ROUTING.md)."""
    from coordinator.autoscaler import AutoscaleConfig
    from coordinator.placement.placer import PlacementConfig
    from coordinator.placement.policies import PolicyKnobs

    knobs = PolicyKnobs(**dict(ns.policy_option))
    autoscale = None
    if ns.autoscale:
        low, high = ns.autoscale_min, ns.autoscale_max
        if ns.autoscale != "on":
            low, high = _autoscale_range(ns.autoscale)
        autoscale = AutoscaleConfig(
            target_per_worker=ns.autoscale_target,
            min_workers=low,
            max_workers=high,
            upscale_delay_s=ns.autoscale_upscale_delay,
            downscale_delay_s=ns.autoscale_downscale_delay,
            cooldown_s=ns.autoscale_cooldown,
            max_step=ns.autoscale_max_step,
            drain_deadline_s=ns.autoscale_drain_deadline,
            worker_gpus=ns.autoscale_worker_gpus,
        )
    return {
        "placement": PlacementConfig(
            policy=ns.policy, prefetch=ns.prefetch, knobs=knobs, candidates=ns.placement_candidates
        ),
        "autoscale": autoscale,
    }


def _autoscale_range(text: str) -> tuple[int, int]:
    """``--autoscale MIN..MAX`` as (min, max); a ValueError names what was wrong."""
    low, sep, high = text.partition("..")
    try:
        if not sep:
            raise ValueError
        return int(low), int(high)
    except ValueError:
        raise ValueError(f"--autoscale takes MIN..MAX worker counts, e.g. 1..8 (got {text!r})") from None


def _autoscale_provider(ns: argparse.Namespace) -> Any:
    """The autoscaler's command provider from the flags (coordinator/io/ops/provision.py), or None.

    The local provider is made by `up` itself (fleetwire/cli/up.py), which knows the worker token and URL.
    """
    from coordinator.io.ops.provision import CommandProvider

    if ns.autoscale_provider is None:
        if ns.autoscale_start or ns.autoscale_stop:
            raise ValueError("--autoscale-start/--autoscale-stop need --autoscale-provider command")
        return None
    if not ns.autoscale:
        raise ValueError("--autoscale-provider needs the autoscaler: pass --autoscale too")
    if ns.autoscale_provider == "command":
        if not ns.autoscale_start:
            raise ValueError("--autoscale-provider command needs --autoscale-start CMD (and usually --autoscale-stop)")
        return CommandProvider(ns.autoscale_start, ns.autoscale_stop)
    if not hasattr(ns, "workers"):
        raise ValueError("--autoscale-provider local runs worker processes for `fleetwire up --autoscale MIN..MAX`; "
                         "a standalone coordinator uses --autoscale-provider command")
    return None


_POLICY_OPTIONS = {"energy_max_gap": float, "kv_min_match_blocks": int, "kv_balance_gap": float,
                   "kv_balance_ratio": float, "kv_load_bound": float, "kv_share_window": float}


def _policy_option(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    kind = _POLICY_OPTIONS.get(name.strip())
    if not sep or kind is None:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME one of {', '.join(_POLICY_OPTIONS)}")
    try:
        return name.strip(), kind(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} needs a {kind.__name__}, got {value!r}") from None


async def wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _serve_until_signal(server: Any) -> int:
    """Serve until SIGINT/SIGTERM (exit 0) or until the store fails (fail-stop: exit 1; a lost shard lease: 4)."""
    waiter = asyncio.ensure_future(wait_for_signal())
    try:
        await asyncio.wait((waiter, server.fatal), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if server.fatal.done():
        from coordinator.io.cluster.leases import EXIT_SHARD_FENCED, ShardFenced

        if isinstance(server.fatal.result(), ShardFenced):  # cluster mode: another coordinator owns the shards now
            print(f"fleetwire: error: shard lease lost (fenced): {server.fatal.result()}", file=sys.stderr, flush=True)
            return EXIT_SHARD_FENCED
        print(f"fleetwire: error: the store failed: {server.fatal.result()}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    return EXIT_OK


async def run_coordinator(ns: argparse.Namespace) -> int:
    """``fleetwire coordinator``: one coordinator (or, with a postgresql:// store, a cluster's: cli/shards.py)."""
    from coordinator.io.frontdoor.server import CoordinatorServer

    tune_gc_for_daemon()
    apply_spin_argument(ns)
    worker_token = ns.worker_token or os.environ.get("FLEETWIRE_WORKER_TOKEN")
    client_token = ns.client_token or os.environ.get("FLEETWIRE_CLIENT_TOKEN")
    admin_token = ns.admin_token or os.environ.get("FLEETWIRE_ADMIN_TOKEN")
    try:  # flags that cannot work together (e.g. --autoscale-start without the command provider)
        settings = server_settings(
            ns, (worker_token,) if worker_token else (), (client_token,) if client_token else ()
        )
    except ValueError as exc:
        return fail(str(exc))
    settings = dataclasses.replace(settings, admin_tokens=(admin_token,) if admin_token else ())
    unsafe = unsafe_tokens(settings.worker_tokens, settings.client_tokens, settings.admin_tokens)
    if unsafe:  # placeholders and short tokens (fleetwire/cli/safety.py): one line each, exit 2
        return fail("refusing to start: " + "; ".join(unsafe))
    warn_plaintext(ns.host, settings.tls_cert is not None)
    if settings.store.startswith("postgresql://"):  # cluster mode: one core per owned shard (docs/CLUSTER.md)
        from fleetwire.cli.shards import run_cluster_coordinator

        secret_file = getattr(ns, "cluster_secret_file", None) or os.environ.get("FLEETWIRE_CLUSTER_SECRET_FILE")
        return await run_cluster_coordinator(settings, version(), ns.shard_ports, secret_file)
    if ns.shard_ports is not None:
        return fail("--shard-ports is for cluster mode (--store postgresql://...): a single coordinator listens "
                     "on --port only")
    try:
        server = CoordinatorServer(settings, version=version())
    except ValueError as exc:
        return fail(str(exc), store_exit_code(exc))
    try:
        await server.start()
    except ValueError as exc:  # a damaged store found while loading: one line, exit 3 (fleetwire/cli/store.py)
        server.store.close()
        return fail(str(exc), store_exit_code(exc))
    except OSError as exc:
        return fail(f"cannot listen on {ns.host}:{ns.port}: {exc.strerror or exc}")
    # SIGHUP re-reads --token-file; sessions of revoked tokens are closed 4401, the rest stay.
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, server.reload_tokens)
    print(f"fleetwire coordinator listening on {server.url} (store {server.store.description})", flush=True)
    announce = asyncio.ensure_future(_announce_serving(server)) if server.cluster is not None else None
    try:
        status = await _serve_until_signal(server)
    finally:
        if announce is not None:
            announce.cancel()
        await server.stop()  # sessions closed with 1001; workers and clients reconnect to the next run
    return status


async def _announce_serving(server: Any) -> None:
    """Cluster mode: one stdout line when this coordinator serves (at once, or when a standby takes over)."""
    if not server.loaded.is_set():
        print(f"fleetwire coordinator is a standby of cluster {server.settings.cluster.name!r}: another "
              "coordinator holds the shards", flush=True)  # fmt: skip
    await server.loaded.wait()
    print(f"fleetwire coordinator serving cluster {server.settings.cluster.name!r} "
          f"({server.settings.cluster.shards} shards, owner {server.cluster.owner})", flush=True)  # fmt: skip


async def run_worker_command(ns: argparse.Namespace) -> int:
    from worker_agent.main import run_worker

    tune_gc_for_daemon()
    return await run_worker(ns, own_process=True)  # this process is the worker's alone: made non-dumpable


def add_server_arguments(p: argparse.ArgumentParser, default_port: int) -> None:
    """The flags of a coordinator (``fleetwire coordinator`` and ``fleetwire up``)."""
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=default_port, help=f"port; 0 picks a free one (default {default_port})")
    p.add_argument("--heartbeat-interval", type=float, default=10.0, metavar="S",
                   help="seconds between worker heartbeats (default 10)")
    p.add_argument("--heartbeat-timeout", type=float, default=30.0, metavar="S",
                   help="a worker silent this long is reaped and its plans requeued (default 30)")
    p.add_argument("--worker-reconnect-grace-s", type=float, default=5.0, metavar="S",
                   help="a worker whose connection closed keeps its plans this long for a reconnect with its "
                        "session secret (its id is refused to others meanwhile), then they are requeued; heartbeat "
                        "silence on an open connection waits for --heartbeat-timeout (default 5)")
    p.add_argument("--preemption-grace", type=float, default=30.0, metavar="S",
                   help="a preempted plan has this long to checkpoint and end (ctx.preempted; its processes get "
                        "SIGTERM) before its worker cancels it; it is then queued again without using an attempt "
                        "(default 30)")
    p.add_argument("--preemption-min-run", type=float, default=10.0, metavar="S",
                   help="a preemptible plan runs at least this long before it may be preempted (default 10)")
    p.add_argument("--reaper-interval", type=float, default=None, metavar="S",
                   help="how often the reaper runs (default: timeout/10, at most 1 s)")
    p.add_argument("--max-frame-bytes", type=int, default=1 << 20, metavar="N",
                   help="largest accepted websocket frame (default 1 MiB)")
    p.add_argument("--otlp-endpoint", default="", metavar="URL",
                   help="send traced plans' spans to this OpenTelemetry collector (OTLP/HTTP, e.g. "
                        "http://127.0.0.1:4318; default: $OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing; "
                        "needs fleetwire[otel]; docs/OPERATIONS.md §Tracing)")
    p.add_argument("--store", default=None, metavar="SPEC",
                   help="where plans are kept: sqlite (default; coordinator.sqlite3 in --data-dir), "
                        "sqlite:PATH, memory (lost on restart), or postgresql://USER@HOST:PORT/DB (cluster mode: "
                        "coordinators sharing the database fail over to each other, docs/CLUSTER.md); "
                        "default $FLEETWIRE_STORE, else sqlite")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="directory of the sqlite store (default: $FLEETWIRE_DATA_DIR, else "
                        "$XDG_STATE_HOME/fleetwire or ~/.local/state/fleetwire; `up`: a temporary directory)")
    p.add_argument("--store-writer", choices=("thread", "process"), default="process",
                   help="who commits to the sqlite store under load: a child process (default), whose Python runs "
                        "beside the event loop on another core, or a thread of the coordinator (better only when "
                        "every core is busy; docs/OPERATIONS.md §Store writer)")
    p.add_argument("--breaker-fraction", type=float, default=0.5, metavar="F",
                   help="reaper circuit breaker: when more than this share of >= 3 connected workers go "
                        "silent at once, suspect the coordinator and hold the reaping (default 0.5; 1 disables)")
    p.add_argument("--plan-retention", type=float, default=86400.0, metavar="S",
                   help="forget a finished plan (memory and store) this many seconds after it ended; a client "
                        "plan id is an idempotency key only that long (default 86400 = 24 h; 0 keeps every plan)")
    p.add_argument("--plan-retention-bytes", type=int, default=1 << 30, metavar="B",
                   help="also forget finished plans, oldest first, while they hold more than B bytes together "
                        "(args, result, held events, ~1 KB overhead each; default 1073741824 = 1 GiB; 0: no bound)")
    p.add_argument("--data-ticket-ttl", type=float, default=3600.0, metavar="S",
                   help="data-plane tickets (a client's pass to a worker's inputs and outputs) are valid this long "
                        "(default 3600)")
    p.add_argument("--data-key-rotation", type=float, default=86400.0, metavar="S",
                   help="rotate the key that signs data-plane tickets this often; a key stays valid as long as the "
                        "tickets it signed (--data-ticket-ttl) and a few seconds while the next one is "
                        "published, at most 8 keys at once, so S must be at least (the TTL + those seconds) / 7 "
                        "(docs/OPERATIONS.md §Data plane; default 86400; 0: never)")
    p.add_argument("--relay-max-bytes", type=int, default=DEFAULT_RELAY_MAX_BYTES, metavar="B",
                   help="the most bytes of plans' relayed inputs and outputs (workers a client cannot dial) in flight "
                        "through the coordinator at once; each stream gets up to 16 MiB of it (default 67108864 = "
                        "64 MiB; at least 262144)")
    p.add_argument("--relay-principal-bytes", type=int, default=0, metavar="B",
                   help="the most of --relay-max-bytes one principal's relayed streams may hold; more of its streams "
                        "wait in line (default 0: half of --relay-max-bytes)")
    p.add_argument("--relay-session-bytes", type=int, default=0, metavar="B",
                   help="the most of --relay-max-bytes one client session's relayed streams may hold; more of its "
                        "streams wait in line (default 0: a quarter of --relay-max-bytes)")
    p.add_argument("--relay-idle", type=float, default=DEFAULT_RELAY_IDLE_S, metavar="S",
                   help="a relayed stream on which no byte moved this long gives its window back and ends "
                        "relay_closed (the SDK opens it again when it goes on) (default 10)")
    add_store_loss_argument(p)  # fleetwire/cli/store.py
    add_spin_argument(p)  # the lone round trip's busy-poll (wireio/spin.py)
    g = p.add_argument_group("OpenAI-compatible front door (docs/OPENAI.md)")
    g.add_argument("--no-openai", action="store_true",
                   help="do not serve /v1/chat/completions, /v1/completions and /v1/models on the main port")
    g.add_argument("--openai-queue-timeout", type=float, default=30.0, metavar="S",
                   help="an OpenAI request no worker took this long is answered 503 and its plan cancelled "
                        "(default 30)")
    g.add_argument("--openai-durable", choices=("on", "off"), default="on",
                   help="off: the door's plans are never written to the store, so a request waits for no commit "
                        "before it is placed (a crash loses their records: docs/OPENAI.md §Durability) (default on)")
    g.add_argument("--openai-rate", type=float, default=0.0, metavar="R",
                   help="OpenAI requests per second each principal may make to this coordinator; past it 429 with "
                        "Retry-After (default 0: no limit)")
    g.add_argument("--openai-burst", type=int, default=0, metavar="N",
                   help="OpenAI requests a principal may make at once above --openai-rate (default 0: one second's "
                        "worth)")
    g = p.add_argument_group("cluster mode (--store postgresql://..., docs/CLUSTER.md)")
    g.add_argument("--cluster-name", default="fleetwire", metavar="NAME",
                   help="the cluster's name, kept in the database; a coordinator of another name is refused "
                        "(default fleetwire)")
    g.add_argument("--shards", type=int, default=16, metavar="N",
                   help="shard slots, fixed when the cluster's database is first used (default 16)")
    g.add_argument("--shard-ports", default=None, metavar="FIRST-LAST",
                   help="the ports this coordinator's shard cores listen on (a range to open in a firewall): at "
                        "least --shards of them, shard S on FIRST+S when free; FIRST alone: --shards ports from "
                        "FIRST (default: any free port)")
    g.add_argument("--lease-ttl", type=float, default=3.0, metavar="S",
                   help="a shard lease lasts this long after its last renewal (database clock); a dead owner's "
                        "shards are taken over after at most this plus half --lease-renew (default 3)")
    g.add_argument("--lease-renew", type=float, default=1.0, metavar="S",
                   help="how often the owner renews its leases; at most half --lease-ttl (default 1)")
    g.add_argument("--pool-partitions", type=pool_partitions, action="append", default=[], metavar="POOL=K",
                   help="split a pool larger than one coordinator into K partitions, each on its own shard: workers "
                        "by hash of their id, plans by hash of their session key (else plan id); comma-separated or "
                        "repeated; kept in the database: a coordinator given other partitions is refused "
                        "(default: none)")
    g.add_argument("--cluster-secret-file", default=None, metavar="FILE",
                   help="a secret file (at least 16 bytes, the same on every coordinator of the cluster, never in the "
                        "database) the shared data-plane ticket keys are derived from: without it whoever can read "
                        "the database can sign tickets (default: $FLEETWIRE_CLUSTER_SECRET_FILE, else none, with a "
                        "warning)")
    add_security_arguments(p)  # TLS and limits (fleetwire/cli/security.py)
    g = p.add_argument_group("carbon time shifting (docs/ROUTING.md §Carbon in time)")
    g.add_argument("--carbon-forecast", default=None, metavar="SOURCE",
                   help="grid carbon forecasts, rows zone,time,gco2_per_kwh: a CSV or JSON file (re-read when it "
                        "changes), cmd:COMMAND (its stdout) or an http(s):// URL (rows, Electricity Maps' forecast "
                        "or the GB Carbon Intensity API), fetched every --carbon-forecast-interval; plans with a "
                        "deadline wait for a greener hour (default: none, they are placed at once)")
    g.add_argument("--carbon-forecast-zone", default="", metavar="ZONE",
                   help="the zone of rows that name none (a time,gco2_per_kwh CSV, the GB API)")
    g.add_argument("--carbon-forecast-interval", type=float, default=900.0, metavar="S",
                   help="how often the source is fetched (a file: looked at) (default 900)")
    g.add_argument("--carbon-forecast-max-age", type=float, default=86_400.0, metavar="S",
                   help="a forecast not renewed for this long is stale: held plans are placed (default 86400)")
    g.add_argument("--carbon-option", type=_carbon_option, action="append", default=[], metavar="NAME=VALUE",
                   help="a knob of the decision (repeatable): quantum_s (the grid of start times, 900), run_margin "
                        "(0.2 of the expected run), queue_margin_s (300), min_gain (0.01), hold_share (0.8)")
    g = p.add_argument_group("placement and autoscaling (docs/ROUTING.md)")
    g.add_argument("--policy", default="joule_weighted", metavar="NAME",
                   help="default placement policy: round_robin, least_busy, latency_weighted, joule_weighted "
                        "(default), carbon_weighted or kv_aware; a plan's hints may override it")
    g.add_argument("--prefetch", type=int, default=0, metavar="N",
                   help="plans a busy worker may hold unstarted beyond its concurrency; idle workers steal them "
                        "(default 0)")
    g.add_argument("--policy-option", type=_policy_option, action="append", default=[], metavar="NAME=VALUE",
                   help=f"a policy knob (repeatable): {', '.join(_POLICY_OPTIONS)}")
    g.add_argument("--placement-candidates", type=int, default=16, metavar="K",
                   help="in a pool of more than K workers, the policy ranks only the K least loaded that can take "
                        "the plan (fewest leases, least recently assigned; kv_aware also the longest prefix "
                        "match); 0 ranks every worker (default 16)")
    g.add_argument("--autoscale", nargs="?", const="on", default=None, metavar="MIN..MAX",
                   help="run the autoscaler (decisions go to admins, the hook and the provider); MIN..MAX sets "
                        "--autoscale-min and --autoscale-max, e.g. 1..8")
    g.add_argument("--autoscale-target", type=float, default=4.0, metavar="N",
                   help="ongoing plans one worker should carry (default 4)")
    g.add_argument("--autoscale-min", type=int, default=0, metavar="N", help="fewest workers per pool (default 0)")
    g.add_argument("--autoscale-max", type=int, default=64, metavar="N", help="most workers per pool (default 64)")
    g.add_argument("--autoscale-upscale-delay", type=float, default=30.0, metavar="S",
                   help="how long a higher count must hold before scaling up (default 30)")
    g.add_argument("--autoscale-downscale-delay", type=float, default=600.0, metavar="S",
                   help="how long a lower count must hold before scaling down (default 600)")
    g.add_argument("--autoscale-cooldown", type=float, default=60.0, metavar="S",
                   help="no action within this long of the pool's previous one (default 60)")
    g.add_argument("--autoscale-hook", default=None, metavar="CMD",
                   help="shell command run per decision with the decision as JSON on stdin")
    g.add_argument("--autoscale-provider", choices=("local", "command"), default=None,
                   help="who starts and stops workers: local (worker processes on this host; `up` only, its "
                        "default with --autoscale) or command (--autoscale-start/--autoscale-stop); default none")
    g.add_argument("--autoscale-start", default=None, metavar="CMD",
                   help="command provider: shell command that starts $FLEETWIRE_COUNT workers with the ids "
                        "$FLEETWIRE_WORKER_IDS for pool $FLEETWIRE_POOL, with the tags $FLEETWIRE_TAGS (all it "
                        "needs: $FLEETWIRE_NEEDS, JSON); run detached, done when it exits (a worker it leaves "
                        "running in the background is fine)")
    g.add_argument("--autoscale-stop", default=None, metavar="CMD",
                   help="command provider: shell command that stops the drained workers $FLEETWIRE_WORKER_IDS")
    g.add_argument("--autoscale-max-step", type=int, default=0, metavar="N",
                   help="most workers one scale-up adds (default 0: up to --autoscale-max at once)")
    g.add_argument("--autoscale-drain-deadline", type=float, default=300.0, metavar="S",
                   help="a worker removed by scale-down has this long to finish its plans before they are taken "
                        "back and it is stopped (default 300)")
    g.add_argument("--autoscale-worker-gpus", type=int, default=None, metavar="N",
                   help="devices each provisioned worker has: plans needing more are never scaled for, a worker "
                        "carries at most N // G plans of G devices (`up`: local workers declare --gpus 0..N-1)")
