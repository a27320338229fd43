"""``fleetwire up``: a local coordinator and workers with zero configuration (docs/OPERATIONS.md).

One coordinator in this process (settings from fleetwire/cli/serve.py) and ``--workers`` worker
processes (``python -m fleetwire worker`` on a loopback data port each), with new tokens (or the
ones ``--state-dir`` keeps), a throwaway store unless one is named, and a banner with what to
export and run. With ``--autoscale MIN..MAX`` the autoscaler starts and stops local workers
itself (coordinator/io/ops/provision.py ``LocalProvider``). Ctrl-C stops the workers, then the
coordinator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import secrets
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fleetwire.cli.console import EXIT_FAILED, EXIT_OK
from fleetwire.cli.safety import up_state_tokens
from fleetwire.cli.serve import fail, server_settings, tune_gc_for_daemon, version, wait_for_signal
from fleetwire.cli.store import store_exit_code
from wireio.spin import apply_spin_argument

__all__ = ["run_up"]

DRAIN_CHUNK_BYTES = 1 << 16  # a local worker's stdout read at a time after its registration (_drop_output)


async def run_up(ns: argparse.Namespace) -> int:
    """``fleetwire up``: a coordinator and ``--workers`` local workers on this host, until a signal."""
    from coordinator.io.frontdoor.server import CoordinatorServer

    tune_gc_for_daemon()
    apply_spin_argument(ns)
    if ns.workers < 0:
        return fail("--workers must be 0 or more")
    if ns.state_dir is None and ns.store is None and ns.data_dir is None:  # a throwaway store per `up` run
        with tempfile.TemporaryDirectory(prefix="fleetwire-up-") as data_dir:
            ns.data_dir = data_dir
            return await run_up(ns)
    tokens = _tokens(ns)
    if isinstance(tokens, int):
        return tokens
    try:
        settings = _settings(ns, tokens, url=lambda: server.url)
        server = CoordinatorServer(settings, version=version())
        await server.start()
    except ValueError as exc:
        return fail(str(exc), store_exit_code(exc))
    except OSError as exc:
        return fail(f"cannot listen on {ns.host}:{ns.port}: {exc.strerror or exc} (try --port 0 for a free port)")
    ids = [f"local-{i + 1}" for i in range(ns.workers)]
    procs: list[asyncio.subprocess.Process] = []
    drains: list[asyncio.Future[None]] = []
    try:
        for worker_id in ids:
            procs.append(await _start_local_worker(server.url, tokens["worker"], worker_id, ns))
        try:
            await asyncio.gather(*(_await_registered(p, w, 60.0) for p, w in zip(procs, ids, strict=True)))
        except (RuntimeError, TimeoutError) as exc:
            return fail(f"local workers did not start: {exc or 'timed out'}", EXIT_FAILED)
        drains = [asyncio.ensure_future(_drop_output(proc)) for proc in procs]
        print(_banner(server, ids, tokens, ns), flush=True)
        await wait_for_signal()
        print("stopping fleetwire", flush=True)
    finally:
        await _stop_processes(procs)  # read until they end: one blocked on a full pipe would not stop
        for drain in drains:
            drain.cancel()  # a pipe a grandchild still holds open
        await asyncio.gather(*drains, return_exceptions=True)
        await server.stop()
    return EXIT_OK


def _tokens(ns: argparse.Namespace) -> dict[str, str] | int:
    """The worker, client and admin tokens of this run: kept in ``--state-dir`` across runs, else new ones.

    An int: the exit status of a refusal (printed).
    """
    if ns.state_dir is None:
        return {role: secrets.token_urlsafe(24) for role in ("worker", "client", "admin")}
    # tokens and the store kept in DIR across runs (fleetwire/cli/safety.py)
    if ns.data_dir is not None:
        return fail("--state-dir keeps the store in DIR: give --state-dir or --data-dir, not both")
    try:
        tokens = up_state_tokens(Path(ns.state_dir))
    except (OSError, ValueError) as exc:
        return fail(f"--state-dir {ns.state_dir}: {exc}")
    ns.data_dir = ns.state_dir
    return tokens


def _settings(ns: argparse.Namespace, tokens: dict[str, str], *, url: Callable[[], str]) -> Any:
    """The coordinator's settings; ``--autoscale MIN..MAX`` gets local workers (``url``: the server's, once up).

    Raises:
        ValueError: flags that cannot work together.
    """
    worker_token = tokens["worker"]
    settings = server_settings(ns, (worker_token,), (tokens["client"],))
    if settings.core.autoscale is not None and settings.autoscale_provider is None and (
        ns.autoscale_provider in (None, "local")
    ):  # `up --autoscale MIN..MAX`: worker processes on this host, started and stopped by the autoscaler
        from coordinator.io.ops.provision import LocalProvider

        settings = dataclasses.replace(settings, autoscale_provider=LocalProvider(
            # --drain-timeout 0: the coordinator's drain (--autoscale-drain-deadline) already ran
            # before the provider stops a worker; SIGTERM then hands back whatever is left at once.
            # Each carries the tags the plans it is started for require (the pool's needs).
            lambda worker_id, needs: [*_local_worker_argv(url(), worker_id, ns, needs.tags), "--drain-timeout", "0"],
            {**os.environ, "FLEETWIRE_WORKER_TOKEN": worker_token},
        ))
        ns.workers = 0  # the autoscaler keeps --autoscale-min..max workers instead
    # the admin token: operator actions (drain/undrain) and the all-plans dashboard
    return dataclasses.replace(settings, admin_tokens=(tokens["admin"],))


def _banner(server: Any, ids: list[str], tokens: dict[str, str], ns: argparse.Namespace) -> str:
    """What `up` prints once it is up: the URL, the tokens and the commands to try."""
    return (
        f"fleetwire is up: coordinator {server.url} with "
        + (f"{len(ids)} workers ({', '.join(ids) or 'none'})\n" if server.provisioner is None else
           f"{server.provisioner.min_workers}..{server.provisioner.max_workers} autoscaled local workers "
           "(auto-1, auto-2, ...)\n")
        + "In another shell:\n"
        f"  export FLEETWIRE_URL={server.url}\n"
        f"  export FLEETWIRE_TOKEN={tokens['client']}\n"
        + (f"  export FLEETWIRE_CA_FILE={ns.ca_file or ns.tls_cert}\n" if server.url.startswith("wss://") else "")
        + "  fleetwire submit echo --args '{\"hello\": 1}' --follow\n"
        "  fleetwire workers\n"
        "Operator commands (`fleetwire drain`/`undrain`, and `plans` of every client) and the dashboard\n"
        "take the admin token (they use it when it is exported):\n"
        f"  export FLEETWIRE_ADMIN_TOKEN={tokens['admin']}\n"
        "  fleetwire plans\n"
        "Workers join this coordinator with:\n"
        f"  FLEETWIRE_WORKER_TOKEN={tokens['worker']} fleetwire worker --url {server.url}\n"
        # The token is typed into the page's login form, never put in a URL (browser history).
        f"Dashboard: {server.url.replace('ws', 'http', 1)}/  (log in with the admin token above)\n"
        "Press Ctrl-C to stop."
    )


async def _start_local_worker(
    url: str, token: str, worker_id: str, ns: argparse.Namespace
) -> asyncio.subprocess.Process:
    """One `up` worker, its stdout a pipe: :func:`_await_registered` reads its registration line there, then
    :func:`_drop_output` the rest (its logs go to stderr, inherited)."""
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
    if getattr(ns, "spin_us", None) is not None:  # the local workers' busy-poll too (wireio/spin.py)
        cmd += ["--spin-us", f"{ns.spin_us:g}"]
    if getattr(ns, "autoscale", None) and ns.autoscale_worker_gpus:  # what the autoscaler was told they have
        cmd += ["--gpus", ",".join(str(i) for i in range(ns.autoscale_worker_gpus))]
    if url.startswith("wss://"):
        cmd += ["--ca-file", ns.ca_file or ns.tls_cert]
    return cmd


async def _await_registered(proc: asyncio.subprocess.Process, worker_id: str, timeout_s: float) -> None:
    assert proc.stdout is not None
    # One deadline, not asyncio.wait_for per line: on 3.11 wait_for loses a cancel (Ctrl-C) that comes as a line
    # is read, and the loop then read on until the worker registered or the timeout passed.
    async with asyncio.timeout(timeout_s):
        while True:
            line = await proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {worker_id} exited with status {await proc.wait()} before registering")
            if b"registered" in line:
                return


async def _drop_output(proc: asyncio.subprocess.Process) -> None:
    """Read and drop what ``proc`` writes to its stdout after its registration line, until it closes it.

    Nothing of the worker's own (its logs are on stderr), but whatever it or a process it started writes there: a
    pipe nobody reads fills at 64 KiB and the writer blocks in its write, a worker's loop with it. Dropped as the
    autoscaler's local workers' stdout is (/dev/null, coordinator/io/ops/provision.py ``LocalProvider``).
    """
    assert proc.stdout is not None
    while await proc.stdout.read(DRAIN_CHUNK_BYTES):
        pass


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
