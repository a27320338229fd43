"""``fleetwire worker``: the command-line entry to the worker agent.

The CLI module (``fleetwire/cli/main.py``) builds the parser with ``add_worker_arguments`` and runs
``run_worker`` on its event loop. Exit status: 0 after a clean stop, 1 when the coordinator
refuses the token, 2 for a usage error (no URL, a bad handler spec, a bad flag value), 4
(``EXIT_REMOVED``) when an operator removed this worker's id (``fleetwire remove``).

The token is read once (``--token-file``, ``$FLEETWIRE_WORKER_TOKEN``; ``--token`` works but
shows in ``ps``, and is warned about), then every token variable is removed from the worker's
environment, and the worker's process is made non-dumpable (worker_agent/isolation.py
``lock_worker_process``), so plans running as the same user cannot read them back from
``/proc``. docs/OPERATIONS.md §Security says what a plan sees.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

from wireio.spin import add_spin_argument, apply_spin_argument
from wireio.tracing import SERVICE_WORKER, Tracing
from worker_agent.agent import Agent, AuthError, WorkerRemoved
from worker_agent.argtypes import non_negative_int, positive_float
from worker_agent.handlers import Handler, load_handler_spec
from worker_agent.isolation import lock_worker_process
from worker_agent.session import EXIT_REMOVED, forget_secrets, take_worker_token
from worker_agent.settings import AgentSettings
from worker_agent.telemetry import Telemetry, add_telemetry_arguments, telemetry_from_args


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``fleetwire worker`` flags to ``parser``."""
    parser.add_argument("--url", help="coordinator URL, ws://host:port; cluster mode: a comma-separated list "
                        "ws://a:8765,ws://b:8765 tried in turn, following `moved` (default: $FLEETWIRE_URL)")
    parser.add_argument("--pool", default="", metavar="NAME",
                        help="cluster mode: the worker pool (adds the tag pool:NAME first; default: the first tag)")
    parser.add_argument("--token", help="worker token (default: --token-file, $FLEETWIRE_WORKER_TOKEN, else "
                        "$FLEETWIRE_TOKEN); on the command line every user of the host sees it in ps")
    parser.add_argument("--token-file", metavar="PATH",
                        help="read the worker token from this file (one line; keep it 0600)")
    parser.add_argument("--ca-file", metavar="PEM", help="CA to trust for a wss:// URL (default: $FLEETWIRE_CA_FILE)")
    parser.add_argument("--tls-cert", metavar="PEM", help="client certificate, for a coordinator that requires mTLS")
    parser.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    parser.add_argument("--id", dest="worker_id", help="worker id (default: <hostname>-<pid>)")
    parser.add_argument(
        "--tags", action="append", default=[], metavar="A,B", help="comma-separated tags plans can require (repeatable)"
    )
    parser.add_argument("--max-concurrency", type=non_negative_int, default=4, metavar="N", help="plans run at once")
    parser.add_argument("--allow-shell", action="store_true",
                        help="offer the 'shell' op (runs any command, as the worker's user or --plan-user)")
    parser.add_argument(
        "--python-allow",
        action="append",
        default=[],
        metavar="PATTERN",
        help="fnmatch pattern of module:function the 'python' op may call: only plain functions "
        "defined in a module it matches (repeatable)",
    )
    parser.add_argument(
        "--plan-env", action="append", default=[], metavar="NAME",
        help="pass this variable (or fnmatch pattern) of the worker's environment to plans' processes, "
        "besides PATH, HOME, LANG, ... (repeatable; never FLEETWIRE_*)",
    )
    parser.add_argument(
        "--plan-user", metavar="USER",
        help="run plans' processes (shell, python) as this user, not the worker's (the worker runs as root)",
    )
    parser.add_argument(
        "--python-env",
        action="append",
        default=[],
        metavar="PATH",
        help="another interpreter to advertise (repeatable)",
    )
    parser.add_argument(
        "--handler",
        action="append",
        default=[],
        metavar="NAME=MODULE:FUNCTION",
        help="a user handler to offer as op NAME (repeatable)",
    )
    parser.add_argument(
        "--reconnect-base", type=positive_float, default=0.5, metavar="S", help="first backoff ceiling"
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=20.0,
        metavar="S",
        help="on SIGTERM/SIGINT, how long running plans may finish before they are handed back (a second signal: now)",
    )
    parser.add_argument("--reconnect-cap", type=positive_float, default=30.0, metavar="S", help="largest backoff")
    parser.add_argument(
        "--reconnect-dial-timeout", type=positive_float, default=3.0, metavar="S",
        help="cluster mode (several --url coordinators, or after a moved): how long a reconnect's dial to one may "
        "take before the next is tried (a frozen coordinator accepts the connection, then answers nothing; default 3)",
    )
    parser.add_argument(
        "--handshake-timeout", type=positive_float, default=10.0, metavar="S",
        help="how long the websocket upgrade may take, and how long to wait for the coordinator's welcome after "
        "hello, before the worker reconnects as its backoff says (default 10)",
    )
    parser.add_argument(
        "--preemption-grace", type=float, default=30.0, metavar="S",
        help="when this host is interrupted (--interruption-command, SIGUSR1): how long its plans have to "
        "checkpoint and end (ctx.preempted; their processes get SIGTERM) before they are cancelled",
    )
    parser.add_argument(
        "--interruption-command", default="", metavar="CMD",
        help="a shell command polled every --interruption-poll seconds; exit status 0 means this host will be "
        "interrupted (e.g. curl -sf of a cloud's spot notice): the worker drains, preempts its plans and leaves",
    )
    parser.add_argument(
        "--interruption-poll", type=positive_float, default=5.0, metavar="S",
        help="seconds between two runs of --interruption-command (default 5)",
    )
    parser.add_argument(
        "--model", action="append", default=[], metavar="NAME", help="a model this host serves (repeatable)"
    )
    parser.add_argument(
        "--accelerator", choices=("cpu", "gpu", "tpu", "npu", "mixed"), help="accelerator class (default: probed)"
    )
    parser.add_argument("--carbon-zone", default="", metavar="ZONE", help="grid zone of this host, e.g. FR")
    parser.add_argument(
        "--gpus", default="", metavar="LIST",
        help="declare devices NVML cannot see: 0,1,2,3 or 0:80GB:H100,1:80GB:H100 (default: NVML's); "
        "refused when it contradicts NVML",
    )
    parser.add_argument(
        "--gpu-share", type=non_negative_int, default=1, metavar="K",
        help="plans that may hold one device at once (default 1: never shared)",
    )
    parser.add_argument(
        "--gpu-health-interval", type=float, default=5.0, metavar="S",
        help="seconds between two readings of every device's health through NVML (XID, ECC, temperature, "
             "throttling; a faulty device is quarantined: docs/OPERATIONS.md §GPU health); 0: none (default 5)",
    )
    parser.add_argument(
        "--gpu-hot", type=float, default=90.0, metavar="C",
        help="temperature from which a device is reported degraded (default 90)",
    )
    parser.add_argument(
        "--on-quarantine", choices=("finish", "requeue"), default="finish",
        help="the plans running on a device when it is quarantined: finish (run on; default) or requeue "
             "(preempted with --preemption-grace, queued again elsewhere for free; docs/OPERATIONS.md §GPU health)",
    )
    parser.add_argument(
        "--otlp-endpoint", default="", metavar="URL",
        help="send traced plans' spans to this OpenTelemetry collector (OTLP/HTTP; default: "
             "$OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing; needs fleetwire[otel]; docs/OPERATIONS.md §Tracing)",
    )
    parser.add_argument("--kv-blocks", type=non_negative_int, default=0, metavar="N", help="KV-cache block budget")
    parser.add_argument(
        "--kv-block-tokens", type=non_negative_int, default=16, metavar="N", help="tokens per KV block (default 16)"
    )
    data = parser.add_argument_group("data plane (plans' inputs and outputs, worker_agent/dataplane.py)")
    data.add_argument(
        "--data-listen", metavar="HOST:PORT",
        help="serve plans' inputs and outputs over HTTP here (port 0: any free port); default: no data endpoint",
    )
    data.add_argument("--data-advertise", default="", metavar="URL", help="the URL clients dial for it, if different")
    data.add_argument("--data-tls-cert", metavar="PEM", help="serve the data endpoint over TLS with this certificate")
    data.add_argument("--data-tls-key", metavar="PEM", help="private key of --data-tls-cert")
    data.add_argument("--spool-dir", metavar="DIR", help="where inputs and outputs are kept (default: a temp dir)")
    data.add_argument(
        "--spool-capacity", type=non_negative_int, default=0, metavar="BYTES",
        help="the most bytes of inputs and outputs kept at once (0: the disk's free space)",
    )
    data.add_argument(
        "--output-retention", type=positive_float, default=3600.0, metavar="S",
        help="how long a plan's outputs are kept for the client to fetch (default 3600)",
    )
    data.add_argument(
        "--input-timeout", type=positive_float, default=600.0, metavar="S",
        help="how long a started plan waits with no byte of its inputs arriving (its client gone) before "
             "failing inputs_unavailable (default 600)",
    )
    add_telemetry_arguments(parser)  # energy, carbon and --inference-url (worker_agent/telemetry.py)
    add_spin_argument(parser)  # the lone round trip's busy-poll (wireio/spin.py)


def _tags(values: list[str]) -> list[str]:
    return [tag.strip() for value in values for tag in value.split(",") if tag.strip()]


def _import_from_cwd() -> None:
    """Make modules in the worker's current directory importable by ``--handler`` and ``--python-allow``,
    as ``python -m`` does: the ``fleetwire`` console script's ``sys.path`` starts with its own bin
    directory instead. Appended, so a file there never shadows an installed module or fleetwire's own."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _error(message: str) -> None:
    print(f"fleetwire worker: error: {message}", file=sys.stderr, flush=True)


def _settings(ns: argparse.Namespace) -> AgentSettings:
    """The agent's settings from ``fleetwire worker`` flags.

    Raises:
        ValueError: a value out of range (worker_agent/settings.py).
    """
    return AgentSettings(
        worker_id=ns.worker_id,
        tags=([f"pool:{ns.pool}"] if ns.pool else []) + _tags(ns.tags),
        max_concurrency=ns.max_concurrency,
        allow_shell=ns.allow_shell,
        python_allow=ns.python_allow,
        plan_env=ns.plan_env,
        plan_user=ns.plan_user,
        python_envs=ns.python_env,
        models=ns.model,
        accelerator=ns.accelerator,
        carbon_zone=ns.carbon_zone,
        kv_blocks=ns.kv_blocks,
        kv_block_tokens=ns.kv_block_tokens,
        reconnect_base_s=ns.reconnect_base,
        reconnect_cap_s=max(ns.reconnect_cap, ns.reconnect_base),
        handshake_timeout_s=ns.handshake_timeout,
        reconnect_dial_timeout_s=ns.reconnect_dial_timeout,
        drain_timeout_s=ns.drain_timeout,
        ca_file=ns.ca_file or os.environ.get("FLEETWIRE_CA_FILE") or None,
        cert_file=ns.tls_cert,
        key_file=ns.tls_key,
        data_listen=ns.data_listen,
        data_advertise=ns.data_advertise,
        data_tls_cert=ns.data_tls_cert,
        data_tls_key=ns.data_tls_key,
        spool_dir=ns.spool_dir,
        spool_capacity_bytes=ns.spool_capacity,
        output_retention_s=ns.output_retention,
        input_timeout_s=ns.input_timeout,
        gpus=ns.gpus,
        gpu_share=ns.gpu_share,
        gpu_health_interval_s=ns.gpu_health_interval,
        gpu_hot_c=ns.gpu_hot,
        on_quarantine=ns.on_quarantine,
        preemption_grace_s=ns.preemption_grace,
        interruption_command=ns.interruption_command or None,
        interruption_poll_s=ns.interruption_poll,
    )


def _handlers(ns: argparse.Namespace) -> list[tuple[str, Handler]]:
    """The ``--handler`` specs, loaded (modules in the current directory too, after the installed ones).

    Raises:
        ValueError: a spec that does not load (worker_agent/handlers.py ``load_handler_spec``).
    """
    if ns.handler or ns.python_allow:
        _import_from_cwd()
    return [load_handler_spec(spec) for spec in ns.handler]


def _agent(ns: argparse.Namespace, url: str, token: str | None) -> Agent:
    """The agent the flags describe, with its telemetry and ``--handler`` ops.

    Raises:
        ValueError: a bad handler spec, a value out of range, TLS files that cannot be loaded.
    """
    handlers = _handlers(ns)
    telemetry: Telemetry = telemetry_from_args(ns)
    tracing = Tracing.from_env(SERVICE_WORKER, endpoint=ns.otlp_endpoint or None,
                               export_process=True)  # the SDK's encoder off this process: docs/OPERATIONS.md §Tracing
    agent = Agent(url, token, settings=_settings(ns), telemetry=telemetry, tracing=tracing)
    if telemetry.engine is not None:  # op "generate" streams from the OpenAI-compatible server
        agent.add_handler("generate", telemetry.engine.generate)
    for name, fn in handlers:
        agent.add_handler(name, fn)
    return agent


async def run_worker(ns: argparse.Namespace, *, own_process: bool = False) -> int:
    """Run a worker agent from parsed ``fleetwire worker`` flags until SIGTERM/SIGINT.

    ``own_process``: the process is the worker's alone (the CLI), so it is made non-dumpable
    (tests that run a worker in their own process leave it as it is).
    """
    url = ns.url or os.environ.get("FLEETWIRE_URL")
    if not url:
        _error("no coordinator URL: pass --url ws://host:port or set FLEETWIRE_URL")
        return 2
    try:
        token = take_worker_token(ns.token, ns.token_file, os.environ)
    except ValueError as exc:
        _error(str(exc))
        return 2
    if ns.token:
        print("fleetwire worker: warning: --token on the command line is shown to every user of this host (ps, "
              "/proc/PID/cmdline); pass it in $FLEETWIRE_WORKER_TOKEN or --token-file", file=sys.stderr, flush=True)
    try:
        agent = _agent(ns, url, token)
    except ValueError as exc:
        _error(str(exc))
        return 2
    forget_secrets(os.environ)  # read by now; the python op's in-process functions do not find them
    apply_spin_argument(ns)
    if own_process:
        lock_worker_process()  # same-user plans cannot read /proc/PID/environ (the start environment) or memory
    return await _serve(agent, url)


async def _serve(agent: Agent, url: str) -> int:
    """Run ``agent`` until it stops (SIGTERM/SIGINT); the exit status."""
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, agent.stop)
    # This host is going away (a spot reclaim's notice): drain, preempt its plans, leave (SEMANTICS.md §Preemption).
    loop.add_signal_handler(signal.SIGUSR1, agent.interrupt, "SIGUSR1")

    async def announce() -> None:
        await agent.registered.wait()
        print(f"worker {agent.worker_id} registered with {url}", flush=True)

    announcer = asyncio.ensure_future(announce())
    try:
        await agent.run()
    except AuthError as exc:
        _error(str(exc))
        return 1
    except WorkerRemoved as exc:
        _error(str(exc))
        return EXIT_REMOVED
    finally:
        announcer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await announcer
        for sig in (*signals, signal.SIGUSR1):
            loop.remove_signal_handler(sig)
    return 0
