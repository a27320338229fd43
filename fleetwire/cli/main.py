"""The ``fleetwire`` command line.

Commands: ``up`` (local coordinator + workers, zero config), ``coordinator``, ``worker``,
``submit``, ``watch``, ``workers``, ``cancel``, ``status``, ``plans``, ``drain``, ``undrain``,
``completion``, ``protocol schema`` (``status`` and ``cancel`` live in ``fleetwire/cli/ops.py``).
What client commands print (tables, live progress, ``--json``) lives in
``fleetwire/cli/console.py``. Client commands read ``FLEETWIRE_URL`` and ``FLEETWIRE_TOKEN``
(or ``--url``/``--token``). The daemons start in ``fleetwire/cli/serve.py`` (``coordinator``,
``worker``: their flags and settings) and ``fleetwire/cli/up.py``, which import the coordinator
and the worker agent only inside the functions that run them, so the SDK never depends on them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import msgspec

from fleetwire.cli import console
from fleetwire.cli.cluster import add_cluster_command
from fleetwire.cli.console import finish as _finish
from fleetwire.cli.lean import import_httpx
from fleetwire.cli.logs import LEVELS, configure_logging
from fleetwire.cli.ops import add_ops_commands, follow_submitted, tag_list
from fleetwire.cli.progress import transfer_progress
from fleetwire.cli.security import add_token_arguments, add_token_command
from fleetwire.cli.serve import add_server_arguments, fail, run_coordinator, run_worker_command, version
from fleetwire.cli.store import add_store_command
from fleetwire.cli.up import run_up
from fleetwire.cli.usage import add_usage_command
from fleetwire.errors import FleetwireConnectionError
from fleetwire.memtune import tune_allocator
from protocol import json_schema
from protocol.errors import FleetwireError
from protocol.messages import OutputRef

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CANCELLED = (
    console.EXIT_OK, console.EXIT_FAILED, console.EXIT_USAGE, console.EXIT_CANCELLED
)

DEFAULT_PORT = 8765


def _run(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        return asyncio.run(coro)
    return uvloop.run(coro)


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


# ---------------------------------------------------------------------------- client commands


def _client_target(ns: argparse.Namespace) -> tuple[str, str | None]:
    url = ns.url or os.environ.get("FLEETWIRE_URL")
    if not url:
        raise SystemExit(fail("no coordinator URL: pass --url or set FLEETWIRE_URL (`fleetwire up` prints it)"))
    from fleetwire.connection import resolve_urls

    try:  # one line and exit 2 for a URL that cannot be dialled (http(s):// is taken as ws(s)://)
        resolve_urls(url)
    except ValueError as exc:
        source = "--url" if ns.url else "FLEETWIRE_URL"
        raise SystemExit(fail(f"{source}: {exc}")) from None
    if getattr(ns, "ca_file", None):
        os.environ["FLEETWIRE_CA_FILE"] = ns.ca_file  # the SDK's default ca_file (wss:// with a private CA)
    return url, ns.token or os.environ.get("FLEETWIRE_TOKEN")


def _inputs(specs: list[str]) -> dict[str, Any]:
    """``--input name=@path`` / ``name=-`` (stdin) / ``name=plan:ID/OUTPUT`` (another plan's output) as the
    SDK's ``inputs``."""
    inputs: dict[str, Any] = {}
    for spec in specs:
        name, sep, source = spec.partition("=")
        if not sep or not name or not (source == "-" or source.startswith(("@", "plan:"))):
            raise ValueError(f"--input {spec!r}: expected NAME=@PATH, NAME=- (standard input) or "
                             "NAME=plan:PLAN_ID/OUTPUT (another plan's output)")
        if name in inputs:
            raise ValueError(f"--input {name!r} is given twice")
        if source.startswith("plan:"):
            plan_id, slash, output = source[len("plan:"):].rpartition("/")
            if not slash or not plan_id or not output:
                raise ValueError(f"--input {spec!r}: expected NAME=plan:PLAN_ID/OUTPUT, e.g. x=plan:a1b2/y")
            inputs[name] = OutputRef(plan_id, output)
        elif source == "-":
            inputs[name] = sys.stdin.buffer
        else:
            path = Path(source[1:]).expanduser()
            if not path.is_file():
                raise ValueError(f"--input {name}: {path} is not a readable file")
            inputs[name] = path
    return inputs


def _outputs(names: list[str], replicas: list[str]) -> list[str] | dict[str, dict[str, int]]:
    """``--output NAME`` and ``--output-replicas NAME=N`` as the SDK's ``outputs`` (a name given only to
    ``--output-replicas`` is an output too)."""
    if not replicas:
        return names
    outputs: dict[str, dict[str, int]] = {name: {} for name in names}
    for spec in replicas:
        name, sep, count = spec.partition("=")
        if not sep or not name or not count.isdigit():
            raise ValueError(f"--output-replicas {spec!r}: expected NAME=N, e.g. y=2 (copies of output y, its own "
                             "included)")
        outputs[name] = {"replicas": int(count)}
    return outputs


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
        outputs = _outputs(ns.output or [], ns.output_replicas or [])
    except ValueError as exc:
        return fail(str(exc))
    url, token = _client_target(ns)
    pool = ns.pool.strip()
    tags = tag_list([f"pool:{pool}", *(ns.tags or ())] if pool else ns.tags)  # as `fleetwire worker --pool` tags it
    async with console.connect(url, token, pool=pool) as client, transfer_progress(client, "upload", as_json=ns.json):
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
            outputs=outputs,
            relay=ns.relay,
            resources=_resources(ns),
            after=ns.after or (),
            deterministic=not ns.not_deterministic,
            preemptible=ns.preemptible,
            deadline_s=ns.deadline[0] if ns.deadline else None,
            deadline_at=ns.deadline[1] if ns.deadline else None,
            expected_run_s=ns.expected_run,
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
    async with console.connect(url, token) as client, transfer_progress(client, "download", as_json=ns.json):
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
    async with console.connect(url, token) as client:
        plan = await client.watch(ns.plan, from_seq=ns.from_seq)
        return await _finish(plan, follow=True, as_json=ns.json)


async def _workers(ns: argparse.Namespace) -> int:
    url, token = _client_target(ns)
    async with console.connect(url, token) as client:
        reply = await client.workers()
    console.print_workers(reply, as_json=ns.json)
    return EXIT_OK


async def _schema(ns: argparse.Namespace) -> int:
    print(json.dumps(json_schema(), indent=2))
    return EXIT_OK


# ---------------------------------------------------------------------------- parser


def _client_parent(token_help: str) -> argparse.ArgumentParser:
    """The flags of client commands; ``token_help`` says which token ``--token`` is."""
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument("--url", help="coordinator URL, e.g. ws://127.0.0.1:8765 (default $FLEETWIRE_URL)")
    client.add_argument("--token", help=token_help)
    client.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    client.add_argument("--ca-file", help="CA certificate to trust for wss:// (default $FLEETWIRE_CA_FILE)")
    return client


def build_parser(*, worker_flags: bool = True) -> argparse.ArgumentParser:
    """The whole ``fleetwire`` argument parser.

    ``worker_flags=False`` leaves ``fleetwire worker``'s own flags out, and with them the import of
    the worker agent (a third of a client command's start-up): :func:`main` does so when the
    command line does not name ``worker``.
    """
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
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("up", parents=[common], help="run a local coordinator and workers (zero config)",
                       description="Start a coordinator and N local worker processes with fresh tokens, "
                                   "and print the export lines another shell needs.")
    add_server_arguments(p, DEFAULT_PORT)
    p.add_argument("--workers", type=int, default=2, help="local worker processes (default 2)")
    p.add_argument("--max-concurrency", type=int, default=4, help="plans each local worker runs at once (default 4)")
    p.add_argument("--tags", default="local", help="tags of the local workers (default: local)")
    p.add_argument("--allow-shell", action="store_true", help="let local workers run the `shell` op")
    p.add_argument("--ca-file", help="with --tls-cert: the CA local workers trust (default: the certificate itself)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="keep the tokens (DIR/up-tokens.json, mode 0600) and the store in DIR, so a restarted `up` "
                        "has the same tokens and plans (default: fresh tokens and a temporary store per run)")
    p.set_defaults(func=run_up)

    p = sub.add_parser("coordinator", parents=[common], help="run the coordinator daemon",
                       description="Run the coordinator. Tokens come from --token-file (names and roles; "
                                   "SIGHUP re-reads it), --worker-token/--client-token/--admin-token or "
                                   "FLEETWIRE_WORKER_TOKEN/FLEETWIRE_CLIENT_TOKEN/FLEETWIRE_ADMIN_TOKEN.")
    add_server_arguments(p, DEFAULT_PORT)
    p.add_argument("--worker-token", help="token workers present (default $FLEETWIRE_WORKER_TOKEN)")
    p.add_argument("--client-token", help="token clients present (default $FLEETWIRE_CLIENT_TOKEN)")
    p.add_argument("--insecure", action="store_true", help="no tokens at all; only allowed on a loopback --host")
    add_token_arguments(p)
    p.set_defaults(func=run_coordinator)

    p = sub.add_parser("worker", parents=[common], help="run a worker agent on this host",
                       description="Run a worker agent that dials the coordinator and runs plans.")
    if worker_flags:
        import_httpx()  # before the agent imports it: without httpx's own CLI (fleetwire/cli/lean.py)
        from worker_agent.main import add_worker_arguments

        add_worker_arguments(p)
    p.set_defaults(func=run_worker_command)

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
                   help="an input uploaded to the worker: NAME=@PATH, or NAME=- for standard input; or another "
                        "plan's output, NAME=plan:PLAN_ID/OUTPUT: the plan waits for it, and its bytes go worker "
                        "to worker (repeatable)")
    p.add_argument("--after", action="append", metavar="PLAN_ID",
                   help="place the plan only once plan PLAN_ID succeeded; it fails upstream_failed if that one "
                        "does not (repeatable)")
    p.add_argument("--not-deterministic", action="store_true",
                   help="running the plan again may give other outputs: a lost output of it is not made again "
                        "for the plans that use it (they fail output_lost)")
    p.add_argument("--output", action="append", metavar="NAME",
                   help="an output name the plan will leave, for `fleetwire output` (repeatable)")
    p.add_argument("--output-replicas", action="append", metavar="NAME=N",
                   help="keep N copies of output NAME (its own included) on as many workers before the plan is "
                        "reported succeeded, so losing its worker costs no rebuild (repeatable)")
    p.add_argument("--relay", action="store_true",
                   help="carry the inputs through the coordinator even when the worker's data endpoint could be "
                        "dialled (without it: direct first, relayed when the worker cannot be reached)")
    p.add_argument("--gpus", type=float, default=None, metavar="N",
                   help="devices the plan holds while it runs (whole GPUs or MIG instances); it sees only those")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GB",
                   help="with --gpus: each device has at least GB of memory")
    p.add_argument("--accelerator", default=None, metavar="MODEL",
                   help="with --gpus: each device's model name contains MODEL, e.g. H100")
    p.add_argument("--preemptible", action="store_true",
                   help="the plan may be stopped so that another team's plan can run: its handler sees "
                        "ctx.preempted (its processes get SIGTERM), has the coordinator's --preemption-grace to "
                        "checkpoint, and is queued again without using an attempt")
    p.add_argument("--deadline", type=console.deadline, default=None, metavar="WHEN",
                   help="the plan may finish any time by WHEN, a duration (6h, 90m) or a time (2026-06-01T06:00, "
                        "local unless it has an offset): the coordinator may hold it for a greener hour "
                        "(docs/SEMANTICS.md §Deadlines)")
    p.add_argument("--expected-run", type=console.duration_s, default=None, metavar="DURATION",
                   help="with --deadline: how long the plan runs, e.g. 45m (default: its op's observed median)")
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
    add_usage_command(sub, common=common, admin_client=admin_client, target=_client_target)  # fleetwire/cli/usage.py
    console.add_operator_commands(sub, common=common, client=admin_client, target=_client_target, root=build_parser)
    return parser


def _data_transfer_error() -> tuple[type[Exception], ...]:
    """``DataTransferError``, for an ``except`` (evaluated only when an exception reaches it): its module
    is imported by the commands that move data, so when it is not loaded nothing raised one."""
    data = sys.modules.get("fleetwire.data")
    return (data.DataTransferError,) if data is not None else ()


class _VersionAction(argparse._VersionAction):
    """argparse's ``--version``, the version looked up only when asked (a search of installed distributions)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        self.version = f"fleetwire {version()}"
        super().__call__(parser, *args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fleetwire`` console script."""
    args = sys.argv[1:] if argv is None else argv
    ns = build_parser(worker_flags="worker" in args).parse_args(args)
    configure_logging(ns.log_format, ns.log_level)
    try:
        tune_allocator()  # big frames without a page fault per page (fleetwire/memtune.py)
    except ValueError as exc:
        return fail(str(exc), EXIT_USAGE)
    try:
        return _run(ns.func(ns))
    except KeyboardInterrupt:
        return 130
    except FleetwireConnectionError as exc:  # says which URL it tried and what to check
        return fail(console.explain_unreachable(exc, getattr(ns, "url", None) or os.environ.get("FLEETWIRE_URL")),
                     EXIT_FAILED)
    except FleetwireError as exc:
        return fail(f"{exc} [{exc.code}]", EXIT_FAILED)
    except _data_transfer_error() as exc:  # an input or output could not be moved (fleetwire/data.py)
        return fail(str(exc), EXIT_FAILED)
    except BrokenPipeError:  # stdout closed early (`| head`): nothing is wrong with the coordinator
        return EXIT_OK
    except (OSError, ConnectionError) as exc:
        return fail(f"cannot reach the coordinator: {exc}", EXIT_FAILED)

