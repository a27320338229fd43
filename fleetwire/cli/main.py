"""The ``fleetwire`` command line.

Commands: ``up`` (local coordinator + workers, zero config), ``coordinator``, ``worker``,
``submit``, ``watch``, ``workers``, ``cancel``, ``status``, ``plans``, ``drain``, ``undrain``,
``completion``, ``protocol schema`` (``status`` and ``cancel`` live in ``fleetwire/cli/ops.py``).
What client commands print (tables, live progress, ``--json``) lives in
``fleetwire/cli/console.py``. Client commands read ``FLEETWIRE_URL`` and ``FLEETWIRE_TOKEN``
(or ``--url``/``--token``). The coordinator and the worker agent are imported only by the
commands that run them, so the SDK never depends on them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import msgspec

from fleetwire.cli import console
from fleetwire.cli.cluster import add_cluster_command
from fleetwire.cli.console import finish as _finish
from fleetwire.cli.logs import LEVELS, configure_logging
from fleetwire.cli.ops import add_ops_commands, follow_submitted, tag_list
from fleetwire.cli.progress import transfer_progress
from fleetwire.cli.safety import unsafe_tokens, up_state_tokens, warn_plaintext
from fleetwire.cli.security import (
    add_security_arguments,
    add_token_arguments,
    add_token_command,
    plan_limit_settings,
    security_settings,
)
from fleetwire.cli.store import add_store_command, add_store_loss_argument, store_exit_code
from fleetwire.client import Client
from fleetwire.connection import resolve_urls
from fleetwire.data import DataTransferError
from fleetwire.errors import FleetwireConnectionError
from fleetwire.memtune import tune_allocator
from protocol import json_schema
from protocol.errors import FleetwireError
from protocol.relay import DEFAULT_IDLE_S as DEFAULT_RELAY_IDLE_S
from protocol.relay import DEFAULT_MAX_BYTES as DEFAULT_RELAY_MAX_BYTES

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CANCELLED = (
    console.EXIT_OK, console.EXIT_FAILED, console.EXIT_USAGE, console.EXIT_CANCELLED
)

DEFAULT_PORT = 8765


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


def _run(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        return asyncio.run(coro)
    return uvloop.run(coro)


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"fleetwire: error: {message}", file=sys.stderr)
    return code


# ---------------------------------------------------------------------------- client commands


def _client_target(ns: argparse.Namespace) -> tuple[str, str | None]:
    url = ns.url or os.environ.get("FLEETWIRE_URL")
    if not url:
        raise SystemExit(_fail("no coordinator URL: pass --url or set FLEETWIRE_URL (`fleetwire up` prints it)"))
    try:  # one line and exit 2 for a URL that cannot be dialled (http(s):// is taken as ws(s)://)
        resolve_urls(url)
    except ValueError as exc:
        source = "--url" if ns.url else "FLEETWIRE_URL"
        raise SystemExit(_fail(f"{source}: {exc}")) from None
    if getattr(ns, "ca_file", None):
        os.environ["FLEETWIRE_CA_FILE"] = ns.ca_file  # the SDK's default ca_file (wss:// with a private CA)
    return url, ns.token or os.environ.get("FLEETWIRE_TOKEN")


def _inputs(specs: list[str]) -> dict[str, Any]:
    """``--input name=@path`` / ``name=-`` (stdin) as the SDK's ``inputs``."""
    inputs: dict[str, Any] = {}
    for spec in specs:
        name, sep, source = spec.partition("=")
        if not sep or not name or not (source == "-" or source.startswith("@")):
            raise ValueError(f"--input {spec!r}: expected NAME=@PATH or NAME=- (standard input)")
        if name in inputs:
            raise ValueError(f"--input {name!r} is given twice")
        if source == "-":
            inputs[name] = sys.stdin.buffer
        else:
            path = Path(source[1:]).expanduser()
            if not path.is_file():
                raise ValueError(f"--input {name}: {path} is not a readable file")
            inputs[name] = path
    return inputs


def _args(value: str | None, inputs: list[str]) -> Any:
    """``--args``: JSON inline, ``@PATH`` (a file of JSON) or ``-`` (JSON on stdin), decoded.

    Raises:
        ValueError: unreadable or not JSON, or stdin taken twice (saying which).
    """
    if value is None:
        return None
    where, text = "--args", value
    if value == "-":
        if any(spec.partition("=")[2] == "-" for spec in inputs):
            raise ValueError("--args - and --input NAME=- both read stdin: give one of them a file (@PATH)")
        where, text = "--args - (stdin)", sys.stdin.read()
    elif value.startswith("@"):
        path = Path(value[1:]).expanduser()
        where = f"--args {value}"
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{where}: cannot read {path}: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON: {exc}") from None


async def _submit(ns: argparse.Namespace) -> int:
    try:
        args = _args(ns.args, ns.input or [])
        inputs = _inputs(ns.input or [])
    except ValueError as exc:
        return _fail(str(exc))
    url, token = _client_target(ns)
    pool = ns.pool.strip()
    tags = tag_list([f"pool:{pool}", *(ns.tags or ())] if pool else ns.tags)  # as `fleetwire worker --pool` tags it
    async with Client(url, token=token, pool=pool) as client, transfer_progress(client, "upload", as_json=ns.json):
        plan = await client.submit(
            ns.op,
            args=args,
            tags=tags,
            priority=ns.priority,
            timeout_s=ns.timeout,
            max_attempts=ns.max_attempts,
            retries=ns.retries,
            plan_id=ns.id,
            session_key=ns.session,
            policy=ns.policy,
            inputs=inputs,
            outputs=ns.output or (),
            relay=ns.relay,
            resources=_resources(ns),
        )
        if ns.json:
            print(_json({"plan_id": plan.id, "state": "queued"}), flush=True)
        else:
            print(f"plan {plan.id} submitted", flush=True)
        if ns.detach:
            if plan.uploads is not None:  # the bytes come from this process: it stays until the worker has them
                await _inputs_delivered(plan, set(plan.uploads.sources))  # all (args past the frame limit too)
            return EXIT_OK
        return await follow_submitted(client, plan, ns)  # Ctrl-C and op hints (fleetwire/cli/ops.py)


def _resources(ns: argparse.Namespace) -> dict[str, Any] | None:
    """``--gpus``, ``--gpu-memory`` and ``--accelerator`` as a submit's ``resources`` (None: none given)."""
    found: dict[str, Any] = {}
    if ns.gpus is not None:
        found["gpus"] = int(ns.gpus) if ns.gpus.is_integer() else ns.gpus
    if ns.gpu_memory is not None:
        found["gpu_memory_gb"] = ns.gpu_memory
    if ns.accelerator:
        found["accelerator"] = ns.accelerator
    return found or None


async def _inputs_delivered(plan: Any, names: set[str]) -> None:
    """Wait until the plan's events say every input was received (or the plan ended)."""
    async for event in plan.events():
        if event.kind == "input_received" and isinstance(event.data, dict):
            names.discard(event.data.get("name"))
            if not names:
                return


async def _output(ns: argparse.Namespace) -> int:
    url, token = _client_target(ns)
    async with Client(url, token=token) as client, transfer_progress(client, "download", as_json=ns.json):
        plan = await client.watch(ns.plan)
        plan.relay = ns.relay
        if ns.out:
            path = await plan.output_to(ns.name, ns.out)
            print(f"output {ns.name!r} of plan {ns.plan} written to {path}", file=sys.stderr)
        else:
            async for chunk in plan.output_chunks(ns.name):
                sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
    return EXIT_OK


async def _watch(ns: argparse.Namespace) -> int:
    url, token = _client_target(ns)
    async with Client(url, token=token) as client:
        plan = await client.watch(ns.plan, from_seq=ns.from_seq)
        return await _finish(plan, follow=True, as_json=ns.json)


async def _workers(ns: argparse.Namespace) -> int:
    url, token = _client_target(ns)
    async with Client(url, token=token) as client:
        reply = await client.workers()
    console.print_workers(reply, as_json=ns.json)
    return EXIT_OK


# ---------------------------------------------------------------------------- daemons


def _server_settings(ns: argparse.Namespace, worker_tokens: tuple[str, ...], client_tokens: tuple[str, ...]) -> Any:
    from coordinator.core import CoreConfig
    from coordinator.io.frontdoor.server import ServerSettings

    core = CoreConfig(
        heartbeat_interval_s=ns.heartbeat_interval,
        heartbeat_timeout_s=ns.heartbeat_timeout,
        worker_reconnect_grace_s=ns.worker_reconnect_grace_s,
        breaker_fraction=ns.breaker_fraction,
        plan_retention_s=ns.plan_retention,
        plan_retention_bytes=ns.plan_retention_bytes,
        data_ticket_ttl_s=ns.data_ticket_ttl,
        data_key_rotation_s=ns.data_key_rotation,
        relay_max_bytes=ns.relay_max_bytes,
        relay_principal_bytes=ns.relay_principal_bytes,
        relay_session_bytes=ns.relay_session_bytes,
        relay_idle_s=ns.relay_idle,
        **_routing_settings(ns),
        **plan_limit_settings(ns),
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
        cluster=_cluster_settings(ns),
        data_dir=ns.data_dir,
        accept_store_loss=ns.accept_store_loss,
        autoscale_hook=ns.autoscale_hook,
        autoscale_provider=_autoscale_provider(ns),
        **security_settings(ns),
    )


def _cluster_settings(ns: argparse.Namespace) -> Any:
    """Cluster mode's settings (docs/CLUSTER.md; used with a postgresql:// store only)."""
    from coordinator.shards import ClusterConfig

    partitions = tuple(item for given in ns.pool_partitions for item in given)
    return ClusterConfig(name=ns.cluster_name, shards=ns.shards, lease_ttl_s=ns.lease_ttl, lease_renew_s=ns.lease_renew,
                         partitions=tuple(sorted(dict(partitions).items())))


def _pool_partitions(text: str) -> Any:
    """``--pool-partitions gpu=4,llm=2`` (argparse type): ``((pool, K), ...)``."""
    from coordinator.shards import parse_partitions

    try:
        return parse_partitions(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--pool-partitions: ")) from None


def _routing_settings(ns: argparse.Namespace) -> dict[str, Any]:
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

    The local provider is made by `up` itself (:func:`_up`), which knows the worker token and URL.
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


async def _wait_for_signal() -> None:
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
    waiter = asyncio.ensure_future(_wait_for_signal())
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


async def _coordinator(ns: argparse.Namespace) -> int:
    from coordinator.io.frontdoor.server import CoordinatorServer

    tune_gc_for_daemon()
    worker_token = ns.worker_token or os.environ.get("FLEETWIRE_WORKER_TOKEN")
    client_token = ns.client_token or os.environ.get("FLEETWIRE_CLIENT_TOKEN")
    admin_token = ns.admin_token or os.environ.get("FLEETWIRE_ADMIN_TOKEN")
    try:  # flags that cannot work together (e.g. --autoscale-start without the command provider)
        settings = _server_settings(
            ns, (worker_token,) if worker_token else (), (client_token,) if client_token else ()
        )
    except ValueError as exc:
        return _fail(str(exc))
    settings = dataclasses.replace(settings, admin_tokens=(admin_token,) if admin_token else ())
    unsafe = unsafe_tokens(settings.worker_tokens, settings.client_tokens, settings.admin_tokens)
    if unsafe:  # placeholders and short tokens (fleetwire/cli/safety.py): one line each, exit 2
        return _fail("refusing to start: " + "; ".join(unsafe))
    warn_plaintext(ns.host, settings.tls_cert is not None)
    if settings.store.startswith("postgresql://"):  # cluster mode: one core per owned shard (docs/CLUSTER.md)
        from fleetwire.cli.shards import run_cluster_coordinator

        return await run_cluster_coordinator(settings, _version(), ns.shard_ports)
    if ns.shard_ports is not None:
        return _fail("--shard-ports is for cluster mode (--store postgresql://...): a single coordinator listens "
                     "on --port only")
    try:
        server = CoordinatorServer(settings, version=_version())
    except ValueError as exc:
        return _fail(str(exc), store_exit_code(exc))
    try:
        await server.start()
    except ValueError as exc:  # a damaged store found while loading: one line, exit 3 (fleetwire/cli/store.py)
        server.store.close()
        return _fail(str(exc), store_exit_code(exc))
    except OSError as exc:
        return _fail(f"cannot listen on {ns.host}:{ns.port}: {exc.strerror or exc}")
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


async def _worker(ns: argparse.Namespace) -> int:
    from worker_agent.main import run_worker

    tune_gc_for_daemon()
    return await run_worker(ns, own_process=True)  # this process is the worker's alone: made non-dumpable


async def _start_local_worker(
    url: str, token: str, worker_id: str, ns: argparse.Namespace
) -> asyncio.subprocess.Process:
    cmd = _local_worker_argv(url, worker_id, ns)
    env = {**os.environ, "FLEETWIRE_WORKER_TOKEN": token}
    return await asyncio.create_subprocess_exec(*cmd, env=env, stdout=asyncio.subprocess.PIPE)


def _local_worker_argv(url: str, worker_id: str, ns: argparse.Namespace, tags: Sequence[str] = ()) -> list[str]:
    """The command line of one `up` worker (the token goes in its environment); ``tags`` before `up`'s own."""
    cmd = [sys.executable, "-m", "fleetwire", "worker", "--url", url, "--id", worker_id,
           "--tags", ",".join(t for t in (*tags, ns.tags) if t), "--max-concurrency", str(ns.max_concurrency),
           "--log-format", ns.log_format, "--log-level", ns.log_level,
           "--data-listen", "127.0.0.1:0"]  # the data plane on a loopback port of its own
    if ns.allow_shell:
        cmd.append("--allow-shell")
    if getattr(ns, "autoscale", None) and ns.autoscale_worker_gpus:  # what the autoscaler was told they have
        cmd += ["--gpus", ",".join(str(i) for i in range(ns.autoscale_worker_gpus))]
    if url.startswith("wss://"):
        cmd += ["--ca-file", ns.ca_file or ns.tls_cert]
    return cmd


async def _await_registered(proc: asyncio.subprocess.Process, worker_id: str, timeout_s: float) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), max(0.1, deadline - time.monotonic()))
        if not line:
            raise RuntimeError(f"worker {worker_id} exited with status {await proc.wait()} before registering")
        if b"registered" in line:
            return


async def _stop_processes(procs: list[asyncio.subprocess.Process], grace_s: float = 10.0) -> None:
    for proc in procs:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
    for proc in procs:
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def _up(ns: argparse.Namespace) -> int:
    from coordinator.io.frontdoor.server import CoordinatorServer

    tune_gc_for_daemon()
    if ns.workers < 0:
        return _fail("--workers must be 0 or more")
    if ns.state_dir is not None:  # tokens and the store kept in DIR across runs (fleetwire/cli/safety.py)
        if ns.data_dir is not None:
            return _fail("--state-dir keeps the store in DIR: give --state-dir or --data-dir, not both")
        try:
            tokens = up_state_tokens(Path(ns.state_dir))
        except (OSError, ValueError) as exc:
            return _fail(f"--state-dir {ns.state_dir}: {exc}")
        ns.data_dir = ns.state_dir
    elif ns.store is None and ns.data_dir is None:  # a throwaway store per `up` run
        with tempfile.TemporaryDirectory(prefix="fleetwire-up-") as data_dir:
            ns.data_dir = data_dir
            return await _up(ns)
    else:
        tokens = {role: secrets.token_urlsafe(24) for role in ("worker", "client", "admin")}
    worker_token, client_token = tokens["worker"], tokens["client"]
    admin_token = tokens["admin"]  # operator actions (drain/undrain) and the all-plans dashboard
    try:
        settings = _server_settings(ns, (worker_token,), (client_token,))
        if settings.core.autoscale is not None and settings.autoscale_provider is None and (
            ns.autoscale_provider in (None, "local")
        ):  # `up --autoscale MIN..MAX`: worker processes on this host, started and stopped by the autoscaler
            from coordinator.io.ops.provision import LocalProvider

            settings = dataclasses.replace(settings, autoscale_provider=LocalProvider(
                # --drain-timeout 0: the coordinator's drain (--autoscale-drain-deadline) already ran
                # before the provider stops a worker; SIGTERM then hands back whatever is left at once.
                # Each carries the tags the plans it is started for require (the pool's needs).
                lambda worker_id, needs: [*_local_worker_argv(server.url, worker_id, ns, needs.tags),
                                          "--drain-timeout", "0"],
                {**os.environ, "FLEETWIRE_WORKER_TOKEN": worker_token},
            ))
            ns.workers = 0  # the autoscaler keeps --autoscale-min..max workers instead
        server = CoordinatorServer(dataclasses.replace(settings, admin_tokens=(admin_token,)), version=_version())
        await server.start()
    except ValueError as exc:
        return _fail(str(exc), store_exit_code(exc))
    except OSError as exc:
        return _fail(f"cannot listen on {ns.host}:{ns.port}: {exc.strerror or exc} (try --port 0 for a free port)")
    ids = [f"local-{i + 1}" for i in range(ns.workers)]
    procs: list[asyncio.subprocess.Process] = []
    try:
        for worker_id in ids:
            procs.append(await _start_local_worker(server.url, worker_token, worker_id, ns))
        try:
            await asyncio.gather(*(_await_registered(p, w, 60.0) for p, w in zip(procs, ids, strict=True)))
        except (RuntimeError, TimeoutError) as exc:
            return _fail(f"local workers did not start: {exc or 'timed out'}", EXIT_FAILED)
        print(
            f"fleetwire is up: coordinator {server.url} with "
            + (f"{len(ids)} workers ({', '.join(ids) or 'none'})\n" if server.provisioner is None else
               f"{server.provisioner.min_workers}..{server.provisioner.max_workers} autoscaled local workers "
               "(auto-1, auto-2, ...)\n")
            + "In another shell:\n"
            f"  export FLEETWIRE_URL={server.url}\n"
            f"  export FLEETWIRE_TOKEN={client_token}\n"
            + (f"  export FLEETWIRE_CA_FILE={ns.ca_file or ns.tls_cert}\n" if server.url.startswith("wss://") else "")
            + "  fleetwire submit echo --args '{\"hello\": 1}' --follow\n"
            "  fleetwire workers\n"
            "Operator commands (`fleetwire drain`/`undrain`, and `plans` of every client) and the dashboard\n"
            "take the admin token (they use it when it is exported):\n"
            f"  export FLEETWIRE_ADMIN_TOKEN={admin_token}\n"
            "  fleetwire plans\n"
            "Workers join this coordinator with:\n"
            f"  FLEETWIRE_WORKER_TOKEN={worker_token} fleetwire worker --url {server.url}\n"
            # The token is typed into the page's login form, never put in a URL (browser history).
            f"Dashboard: {server.url.replace('ws', 'http', 1)}/  (log in with the admin token above)\n"
            "Press Ctrl-C to stop.",
            flush=True,
        )
        await _wait_for_signal()
        print("stopping fleetwire", flush=True)
    finally:
        await _stop_processes(procs)
        await server.stop()
    return EXIT_OK


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fleetwire")
    except PackageNotFoundError:
        return "0+unknown"


async def _schema(ns: argparse.Namespace) -> int:
    print(json.dumps(json_schema(), indent=2))
    return EXIT_OK


# ---------------------------------------------------------------------------- parser


def _add_server_arguments(p: argparse.ArgumentParser, default_port: int) -> None:
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
    p.add_argument("--reaper-interval", type=float, default=None, metavar="S",
                   help="how often the reaper runs (default: timeout/10, at most 1 s)")
    p.add_argument("--max-frame-bytes", type=int, default=1 << 20, metavar="N",
                   help="largest accepted websocket frame (default 1 MiB)")
    p.add_argument("--store", default=None, metavar="SPEC",
                   help="where plans are kept: sqlite (default; coordinator.sqlite3 in --data-dir), "
                        "sqlite:PATH, memory (lost on restart), or postgresql://USER@HOST:PORT/DB (cluster mode: "
                        "coordinators sharing the database fail over to each other, docs/CLUSTER.md); "
                        "default $FLEETWIRE_STORE, else sqlite")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="directory of the sqlite store (default: $FLEETWIRE_DATA_DIR, else "
                        "$XDG_STATE_HOME/fleetwire or ~/.local/state/fleetwire; `up`: a temporary directory)")
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
                   help="rotate the key that signs data-plane tickets this often; the previous key stays valid "
                        "until the next rotation (default 86400; 0: never)")
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
    g.add_argument("--pool-partitions", type=_pool_partitions, action="append", default=[], metavar="POOL=K",
                   help="split a pool larger than one coordinator into K partitions, each on its own shard: workers "
                        "by hash of their id, plans by hash of their session key (else plan id); comma-separated or "
                        "repeated; kept in the database: a coordinator given other partitions is refused "
                        "(default: none)")
    add_security_arguments(p)  # TLS and limits (fleetwire/cli/security.py)
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


def _client_parent(token_help: str) -> argparse.ArgumentParser:
    """The flags of client commands; ``token_help`` says which token ``--token`` is."""
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument("--url", help="coordinator URL, e.g. ws://127.0.0.1:8765 (default $FLEETWIRE_URL)")
    client.add_argument("--token", help=token_help)
    client.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    client.add_argument("--ca-file", help="CA certificate to trust for wss:// (default $FLEETWIRE_CA_FILE)")
    return client


def build_parser() -> argparse.ArgumentParser:
    """The whole ``fleetwire`` argument parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-format", choices=("auto", "console", "json"), default="auto",
                        help="log lines on stderr: console, json, or auto (console on a terminal)")
    common.add_argument("--log-level", choices=LEVELS, default="info")
    client = _client_parent("client token (default $FLEETWIRE_TOKEN)")
    # drain, undrain, plans and status use the admin token (fleetwire/cli/console.py, fleetwire/cli/ops.py)
    admin_client = _client_parent("admin token (default $FLEETWIRE_ADMIN_TOKEN, else $FLEETWIRE_TOKEN)")

    parser = argparse.ArgumentParser(
        prog="fleetwire",
        description="fleetwire: a control plane for fleets of GPU and CPU hosts.",
        epilog="Start with `fleetwire up`, then follow what it prints.",
    )
    parser.add_argument("--version", action="version", version=f"fleetwire {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("up", parents=[common], help="run a local coordinator and workers (zero config)",
                       description="Start a coordinator and N local worker processes with fresh tokens, "
                                   "and print the export lines another shell needs.")
    _add_server_arguments(p, DEFAULT_PORT)
    p.add_argument("--workers", type=int, default=2, help="local worker processes (default 2)")
    p.add_argument("--max-concurrency", type=int, default=4, help="plans each local worker runs at once (default 4)")
    p.add_argument("--tags", default="local", help="tags of the local workers (default: local)")
    p.add_argument("--allow-shell", action="store_true", help="let local workers run the `shell` op")
    p.add_argument("--ca-file", help="with --tls-cert: the CA local workers trust (default: the certificate itself)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="keep the tokens (DIR/up-tokens.json, mode 0600) and the store in DIR, so a restarted `up` "
                        "has the same tokens and plans (default: fresh tokens and a temporary store per run)")
    p.set_defaults(func=_up)

    p = sub.add_parser("coordinator", parents=[common], help="run the coordinator daemon",
                       description="Run the coordinator. Tokens come from --token-file (names and roles; "
                                   "SIGHUP re-reads it), --worker-token/--client-token/--admin-token or "
                                   "FLEETWIRE_WORKER_TOKEN/FLEETWIRE_CLIENT_TOKEN/FLEETWIRE_ADMIN_TOKEN.")
    _add_server_arguments(p, DEFAULT_PORT)
    p.add_argument("--worker-token", help="token workers present (default $FLEETWIRE_WORKER_TOKEN)")
    p.add_argument("--client-token", help="token clients present (default $FLEETWIRE_CLIENT_TOKEN)")
    p.add_argument("--insecure", action="store_true", help="no tokens at all; only allowed on a loopback --host")
    add_token_arguments(p)
    p.set_defaults(func=_coordinator)

    from worker_agent.main import add_worker_arguments

    p = sub.add_parser("worker", parents=[common], help="run a worker agent on this host",
                       description="Run a worker agent that dials the coordinator and runs plans.")
    add_worker_arguments(p)
    p.set_defaults(func=_worker)

    p = sub.add_parser("submit", parents=[common, client], help="submit a plan and wait for its outcome",
                       description="Submit a plan. Prints its id, waits for the outcome and prints the result. "
                                   "Exit status: 0 succeeded, 1 failed, 3 cancelled, 2 usage error.")
    p.add_argument("op", help="handler name on the worker, e.g. echo, sleep, shell, python")
    p.add_argument("--args", help="plan arguments as JSON, e.g. '{\"seconds\": 2}'; @PATH reads them from a file, "
                   "- from stdin (big args, past the frame limit, travel by the data plane)")
    p.add_argument("--tags", action="append", metavar="A,B",
                   help="comma-separated worker tags the plan requires (repeatable), as `fleetwire worker --tags`")
    p.add_argument("--tag", action="append", dest="tags", help=argparse.SUPPRESS)  # the old spelling, kept
    p.add_argument("--pool", default="", metavar="NAME",
                   help="run on the workers of pool NAME (`fleetwire worker --pool NAME`): requires their tag "
                        "pool:NAME, which in cluster mode also sends the plan to that pool's shard")
    p.add_argument("--priority", type=int, default=0, help="higher runs first (default 0)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="fail the plan after S seconds")
    p.add_argument("--max-attempts", type=int, default=3, help="attempts lost to dead workers before failing")
    p.add_argument("--retries", type=int, default=0, help="times a handler failure is retried before failing")
    p.add_argument("--id", help="plan id; submitting the same id again returns the same plan")
    p.add_argument("--session", metavar="KEY",
                   help="session key: plans with the same key go to the same worker while it has room")
    p.add_argument("--policy", metavar="NAME",
                   help="placement policy for this plan, e.g. least_busy (default: the coordinator's)")
    p.add_argument("--input", action="append", metavar="NAME=@PATH",
                   help="an input uploaded to the worker: NAME=@PATH, or NAME=- for standard input (repeatable)")
    p.add_argument("--output", action="append", metavar="NAME",
                   help="an output name the plan will leave, for `fleetwire output` (repeatable)")
    p.add_argument("--relay", action="store_true",
                   help="carry the inputs through the coordinator even when the worker's data endpoint could be "
                        "dialled (without it: direct first, relayed when the worker cannot be reached)")
    p.add_argument("--gpus", type=float, default=None, metavar="N",
                   help="devices the plan holds while it runs (whole GPUs or MIG instances); it sees only those")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GB",
                   help="with --gpus: each device has at least GB of memory")
    p.add_argument("--accelerator", default=None, metavar="MODEL",
                   help="with --gpus: each device's model name contains MODEL, e.g. H100")
    p.add_argument("--follow", "-f", action="store_true", help="print every event as it arrives")
    p.add_argument("--detach", "-d", action="store_true",
                   help="print the plan id and exit at once (with --input or big --args: once the worker has them)")
    p.add_argument("--cancel-on-interrupt", action="store_true",
                   help="Ctrl-C cancels the plan (default: it keeps running; the commands to watch or cancel it "
                        "are printed)")
    p.set_defaults(func=_submit)

    p = sub.add_parser("output", parents=[common, client], help="fetch an output of a plan from its worker",
                       description="Wait for the plan to succeed, then download output NAME from its worker "
                                   "to -o PATH (default: standard output).")
    p.add_argument("plan", help="plan id")
    p.add_argument("name", help="output name")
    p.add_argument("-o", "--out", metavar="PATH", help="write it here (default: standard output)")
    p.add_argument("--relay", action="store_true",
                   help="fetch it through the coordinator even when the worker's data endpoint could be dialled")
    p.set_defaults(func=_output)

    p = sub.add_parser("watch", parents=[common, client], help="stream a plan's events until it ends",
                       description="Stream a plan's events from --from-seq until it ends. "
                                   "Exit status as for submit.")
    p.add_argument("plan", help="plan id")
    p.add_argument("--from-seq", type=int, default=0, help="replay events after this seq (default 0: all)")
    p.set_defaults(func=_watch)

    p = sub.add_parser("workers", parents=[common, client], help="list workers",
                       description="Table of workers: id, tags, CPUs, GPUs, RAM, in-flight, last beat, state.")
    p.set_defaults(func=_workers)

    p = sub.add_parser("protocol", parents=[common], help="protocol tools")
    psub = p.add_subparsers(dest="protocol_command", required=True, metavar="SUBCOMMAND")
    ps = psub.add_parser("schema", help="print the JSON Schema of every message")
    ps.set_defaults(func=_schema)

    add_token_command(sub, [common])
    add_store_command(sub, [common])
    add_cluster_command(sub, [common])  # fleetwire/cli/cluster.py
    add_ops_commands(sub, common=common, client=client, admin_client=admin_client, target=_client_target)
    console.add_operator_commands(sub, common=common, client=admin_client, target=_client_target, root=build_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fleetwire`` console script."""
    ns = build_parser().parse_args(argv)
    configure_logging(ns.log_format, ns.log_level)
    try:
        tune_allocator()  # big frames without a page fault per page (fleetwire/memtune.py)
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)
    try:
        return _run(ns.func(ns))
    except KeyboardInterrupt:
        return 130
    except FleetwireConnectionError as exc:  # says which URL it tried and what to check
        return _fail(console.explain_unreachable(exc, getattr(ns, "url", None) or os.environ.get("FLEETWIRE_URL")),
                     EXIT_FAILED)
    except FleetwireError as exc:
        return _fail(f"{exc} [{exc.code}]", EXIT_FAILED)
    except DataTransferError as exc:  # an input or output could not be moved (fleetwire/data.py)
        return _fail(str(exc), EXIT_FAILED)
    except BrokenPipeError:  # stdout closed early (`| head`): nothing is wrong with the coordinator
        return EXIT_OK
    except (OSError, ConnectionError) as exc:
        return _fail(f"cannot reach the coordinator: {exc}", EXIT_FAILED)

