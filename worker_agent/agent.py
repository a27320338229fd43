"""The worker agent: one persistent session to the coordinator (docs/SEMANTICS.md §Worker session).

Theory of operation:

* ``run()`` dials ``/v1/worker``, runs a session, and when the session ends dials again after
  the delay of :class:`~protocol.backoff.ReconnectBackoff` (reconnect that follows the cluster:
  full jitter; ``base`` for a pass over the list after a served session or a ``moved``, doubled by
  each refusal that names no wait but the first (a session closed before ``welcome`` included) and
  by the silent tries once a whole pass got no answer (a dial that timed out, a ``welcome`` that did
  not come within the dial's bound included); a refusal's Retry-After waited as such).
  HTTP 401/403 at the handshake is fatal (``AuthError``): retrying cannot fix a token.
  So is close ``4410`` (``WorkerRemoved``): an operator removed this id, whether it closed a live
  session or refused the ``hello`` of a restarted agent; the coordinator refuses the id until it
  restarts.
* A session: send ``hello`` (capabilities; plans still running or with an unsent ``done``, and
  the newest acknowledged ones, in case a store loss took them) → wait for ``welcome`` (cancel
  the plans in ``abandon_plans`` without a ``done``; re-send the kept results of the continued
  ones, worker_agent/outbox.py) → three tasks:
  the reader decodes each frame and dispatches every message synchronously (no awaits between
  decode and state change); the single writer drains the outbox, coalescing everything queued
  into one frame per send (a stream's event goes at once when waiting cannot help, written by
  the handler's own step when the writer is idle: worker_agent/outbox.py, ``write_frames``, and
  wireio/wsbulk.py ``write_frame_now``); the heartbeat task queues ``heartbeat(load)``
  every interval ±10 %.
* Plans outlive sessions. Their events and ``done`` go to the outbox whether or not a session
  is up; a new session's writer sends them after the next ``welcome``. Messages whose send
  failed are put back (at-least-once: the coordinator may see an event twice, never zero times).
  Plan messages carry ``seq``; sent ones wait in the outbox until ``ack(seq)`` says the
  coordinator recorded them, and a new session re-sends the unacknowledged ones first (the
  coordinator drops the copies it already has).
* A plan is *silenced* (cancelled locally, nothing more sent for it) when the coordinator says
  its lease is not ours: ``abandon_plans``, ``error(stale_lease)``, or a newer attempt of it.
* ``stop()``: reject new plans, let running ones finish for up to ``drain_timeout_s`` (a second
  ``stop()`` skips the wait), silence the rest, send ``goodbye`` and close; then the tracer's spans go and it
  shuts down (bounded: :func:`_shut_down`). Plans stopped this
  way are handed back: on ``goodbye`` the coordinator requeues them at once, without counting
  the attempt against ``max_attempts`` (it does not see them cancelled).
* Prefetch (``welcome.prefetch``): with every slot busy, up to that many assigns wait here,
  unstarted and not yet accepted, and start in arrival order as slots free. ``revoke`` of a
  waiting plan drops it and answers ``reject(code="revoked")``; a revoke of a started plan
  is ignored. A cancelled waiting plan ends ``cancelled`` at once; ``drain`` and ``stop()``
  hand waiting plans back with ``reject``.
* ``preempt`` (docs/SEMANTICS.md §Preemption): the plan's handler sees ``ctx.preempted`` and its
  processes get SIGTERM at once; past ``grace_s`` it is cancelled; unless it succeeded, its ``done``
  says ``preempted`` and the coordinator queues it again for free. ``interrupt()`` (SIGUSR1, or
  ``--interruption-command`` exiting 0: this host is going away) takes no new plan, hands the
  waiting ones back, preempts the running ones with ``--preemption-grace`` and then stops.

Structure: :class:`Agent` is the session loop (dial, handshake, reader, writer, heartbeats,
reconnect, stop); the handshake's rules (where a dial goes, the ``hello``, what a refusal or the
answer means) are worker_agent/handshake.py's, sans-I/O. It *has* a
:class:`~worker_agent.runner.PlanRunner`, which owns the plans (running, waiting, silenced) and
answers through the :class:`~worker_agent.outbox.SendQueue` the two share; the agent's reader
hands it each plan message. Configuration is one :class:`~worker_agent.settings.AgentSettings`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import random
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, Unpack, assert_never, overload

import msgspec
import structlog
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException
from websockets.typing import Subprotocol

import protocol
from protocol import ENCODING_SUBPROTOCOL, SUBPROTOCOLS, Codec, DecodeFailure, errors
from protocol.backoff import ReconnectBackoff
from protocol.chunkview import with_chunk_views
from protocol.urls import keepalive, with_worker_id
from wireio.frame_sink import FrameSink, SinkConnection
from wireio.spawn import kill_session, started
from wireio.spin import SPIN
from wireio.tracing import Tracing
from wireio.wsbulk import send_frame, write_frame_now
from worker_agent import handshake
from worker_agent.attempts import Attempts
from worker_agent.data_side import DataSide, WatchedOutbound
from worker_agent.dataplane import DataServer
from worker_agent.devices import DeviceAllocator
from worker_agent.gpu_health import HealthMonitor, HealthRules, HealthSource, NvmlHealthSource, physical_of
from worker_agent.handler_proc import HandlerProcesses, Isolation, isolate
from worker_agent.handlers import Handler, builtin_handlers
from worker_agent.outbox import SendQueue, write_frames
from worker_agent.probe import check_declared_gpus, probe_capabilities
from worker_agent.pull_relay import PullRelay
from worker_agent.relay import RelayEndpoint
from worker_agent.runner import REJECTED, PlanRunner
from worker_agent.session import (
    AuthError,
    WorkerRemoved,
    client_tls,
    default_worker_id,
    dial_error_text,
    worker_url,
)
from worker_agent.settings import AgentOptions, AgentSettings
from worker_agent.telemetry import Telemetry

__all__ = ["REJECTED", "Agent", "AgentSettings", "AuthError", "WorkerRemoved", "default_worker_id", "worker_url"]

log = structlog.get_logger(__name__)

F = TypeVar("F", bound=Handler)

MAX_BATCH = 4096  # messages per frame before size-splitting


async def _shut_down(tracing: Tracing) -> None:
    """Shut the worker's tracing down (its spans still queued exported, its exporter child stopped, the spans lost
    logged: wireio/tracing.py), in a thread of its own. Bounded by the child's ``exit_wait_s``: against a collector
    that never answers the child is killed there, and its unanswered spans are counted dropped. Not in the loop's
    default executor, whose threads the loop's ``getaddrinfo`` shares and ``asyncio.run`` waits for."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleetwire-tracing-stop")
    try:
        await asyncio.get_running_loop().run_in_executor(pool, tracing.shutdown)
    finally:
        pool.shutdown(wait=False)


class Agent:
    """A worker agent. Build it, add handlers, ``await agent.run()``; ``agent.stop()`` ends it.

    ``Agent(url, token, tags=["text"])`` and ``Agent(url, token, settings=AgentSettings(tags=["text"]))``
    are the same agent; keyword options given with ``settings`` replace those fields of it.

    Args:
        url: the coordinator, ``ws://host:port`` (``/v1/worker`` is appended when no path).
        token: a worker-role bearer token, or None when the coordinator runs ``--insecure``.
        settings: everything else (worker_agent/settings.py); default: ``AgentSettings()``.
        telemetry: energy, carbon and inference-engine figures for hello and heartbeats
            (worker_agent/telemetry.py); default: none beyond plan counts.
        health_source: what reads the devices' health (worker_agent/gpu_health.py); None: NVML's,
            when it sees a device (``settings.gpu_health_interval_s`` 0: none at all).
        tracing: where the worker's spans go (wireio/tracing.py); None: no spans. The agent shuts it down when
            :meth:`run` ends.
        **options: :class:`~worker_agent.settings.AgentSettings` fields by name.

    Attributes:
        url: the coordinator's worker endpoint.
        worker_id: this worker's id (the settings' or ``<hostname>-<pid>``).
        settings: the configuration in effect.
        runner: the plans of this worker (worker_agent/runner.py).
        registered: set on ``welcome``, cleared when the session ends.

    Raises:
        ValueError: a bad URL, an option out of range, or TLS files that cannot be loaded.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        settings: AgentSettings | None = None,
        telemetry: Telemetry | None = None,
        health_source: HealthSource | None = None,
        tracing: Tracing | None = None,
        **options: Unpack[AgentOptions],
    ) -> None:
        if settings is None:
            settings = AgentSettings(**options)
        elif options:
            settings = dataclasses.replace(settings, **options)
        self.settings = settings
        # Cluster mode: ``a,b,c`` — dialled in turn; a ``moved`` names the next one (docs/CLUSTER.md).
        self.urls = handshake.worker_urls(url, settings.tags)
        self.url = self.urls[0]
        self._dialer = handshake.Dialer(self.urls)  # the list in turn, or where a ``moved`` said
        self.worker_id = settings.worker_id or default_worker_id()
        self.telemetry = telemetry or Telemetry()
        self.registered = asyncio.Event()  # set on welcome, cleared when the session ends
        self._session_secret = ""  # from the last welcome; sent in every later hello (proof of the id)
        self._hello_retry_s = 0.0  # the last hello refusal's retry_after_s (too_many_reconnects): back off that long
        self._opened = False  # the current dial's websocket opened (protocol/backoff.py: an answer)
        self._token = token
        self._ssl = client_tls(self.url, settings.ca_file, settings.cert_file, settings.key_file)
        self._log = log.bind(worker_id=self.worker_id)
        self._send_queue = SendQueue(settings.outbox_limit, self._log)
        self._outbox = self._send_queue.outbox
        # Which attempts the data endpoint takes bytes for (worker_agent/attempts.py): fed by what the
        # coordinator says (_dispatch) and what the runner answers (worker_agent/data_side.py WatchedOutbound).
        self.attempts = Attempts()
        self._handler_processes = HandlerProcesses()  # isolated handlers' children (worker_agent/handler_proc.py)
        self.runner = PlanRunner(
            worker_id=self.worker_id,
            max_concurrency=settings.max_concurrency,
            kill_grace_s=settings.kill_grace_s,
            max_payload_bytes=settings.max_frame_bytes - 4096,
            handlers=builtin_handlers(allow_shell=settings.allow_shell, python_allow=settings.python_allow),
            isolation=settings.plan_isolation(),  # plans' environment and user (worker_agent/isolation.py)
            telemetry=self.telemetry,
            outbound=WatchedOutbound(self._send_queue, self.attempts),
            logger=self._log,
        )
        self.data_server: DataServer | None = None  # started by run() with settings.data_listen
        self.relay: RelayEndpoint | None = None  # relayed inputs and outputs (worker_agent/relay.py), from run()
        self._data_side = DataSide(settings, self.worker_id, self.attempts, self._send_queue.send, self._log)
        self.pulls = self.runner.pull_relay = PullRelay(self._send_queue.send)  # relayed pulls (pull_relay.py)
        if settings.gpus:  # refused here, at start, when NVML sees devices that say otherwise
            check_declared_gpus(settings.gpus)
        self._advertised = settings.advertised_capabilities()  # set by flags, overriding the probe
        self._codecs: dict[str, Codec] = {}
        self._capabilities: protocol.Capabilities | None = None
        self._stop_requested = asyncio.Event()
        self._stop_now = asyncio.Event()
        self._stopping = False
        self._finish_writing = False
        self._handshake_task: asyncio.Future[Any] | None = None
        self._rng = random.Random()
        self._health_source = health_source
        self.health: HealthMonitor | None = None  # started with the first hello when the worker has devices
        self.runner.tracing = tracing
        self.interrupted: str | None = None  # why this host is being interrupted (interrupt()); None: it is not
        self._interruption: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ handlers

    @property
    def ops(self) -> list[str]:
        """The ops this worker advertises, sorted."""
        return self.runner.ops

    @overload
    def handler(self, name: F, /) -> F: ...
    @overload
    def handler(self, name: str | None = None, /, *, isolation: Isolation = "auto") -> Callable[[F], F]: ...

    def handler(self, name: str | F | None = None, /, *, isolation: Isolation = "auto") -> F | Callable[[F], F]:
        """Register a handler: ``@agent.handler``, ``@agent.handler()`` or ``@agent.handler("op")``;
        ``isolation`` says where it runs (:meth:`add_handler`)."""
        if callable(name):
            self.add_handler(name.__name__, name)
            return name

        def register(fn: F) -> F:
            self.add_handler(name or fn.__name__, fn, isolation=isolation)
            return fn

        return register

    def add_handler(self, name: str, fn: Handler, *, isolation: Isolation = "auto") -> None:
        """Offer op ``name``, run by ``fn(ctx, args)`` (replaces a built-in of that name).
        Ops added while connected are advertised in the next ``hello``.

        ``isolation`` (worker_agent/handler_proc.py, docs/SEMANTICS.md §GPU resources): ``"process"`` runs
        each plan in a child process (reused per device set) whose ``CUDA_VISIBLE_DEVICES`` names only the
        plan's devices; ``"auto"`` (default) does so on a worker that has devices for a function defined at
        the top level of a module, and runs anything else in the worker's process; ``"inline"`` never.

        Raises:
            ValueError: ``isolation="process"`` for a handler a child process cannot import.
        """
        self.runner.add_handler(name, isolate(fn, isolation, self._handler_processes))

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Connect and serve until ``stop()``, reconnecting after every lost session.

        Raises:
            AuthError: the coordinator answered the handshake with 401 or 403.
            WorkerRemoved: an operator removed this worker's id (close 4410).
        """
        backoff = ReconnectBackoff(self.settings.reconnect_base_s, self.settings.reconnect_cap_s,
                                   urls=len(self.urls), rng=self._rng)  # fmt: skip
        await self.telemetry.start()
        await self._start_data_plane()
        watch = asyncio.ensure_future(self._watch_interruption()) if self.settings.interruption_command else None
        try:
            while not self._stopping:
                registered = False
                wait_s = 0.0  # a refusal's Retry-After (429 penalty box, 503 full or database away): the wait
                self._hello_retry_s = 0.0
                self._opened = False  # set once the websocket opens: a coordinator answered
                refused = False
                try:
                    registered = await self._connect_and_serve()
                except (AuthError, WorkerRemoved):
                    raise
                except InvalidStatus as exc:
                    refused = True
                    wait_s = errors.retry_after_seconds(exc.response.headers.get("Retry-After")) or 0.0
                    self._log.warning(
                        "coordinator refused the connection", url=self.url,
                        status=exc.response.status_code, retry_after_s=wait_s or None,
                    )
                except (OSError, TimeoutError, WebSocketException) as exc:
                    self._log.warning("cannot reach coordinator", url=self.url, error=dial_error_text(self.url, exc))
                except Exception:  # a bug must not end a worker that plans depend on; back off
                    self._log.error("session failed", exception=traceback.format_exc())
                if self._stopping:
                    break
                wait_s = max(wait_s, self._hello_retry_s)  # a refused hello's error.retry_after_s
                if registered:
                    delay = backoff.served()
                elif self._dialer.moved:  # told where to go: go at once (the pass from here held at base)
                    delay = backoff.moved()
                elif refused or self._opened:  # answered, served nothing: its wait, else a doubling (1013 included)
                    delay = backoff.refused(wait_s)
                else:
                    delay = backoff.unanswered()
                if self._dialer.moved:
                    delay = 0.0  # a served session's moved: go at once too
                self._log.debug("reconnecting", delay_s=round(delay, 3), failures=backoff.failures)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop_requested.wait(), delay)
        finally:
            for task in (watch, self._interruption):
                if task is not None and not task.done():
                    task.cancel()
            # Each waited for: the watch's command killed and reaped (a Process left unwaited outlives the loop), the
            # interruption's wait for the preempted plans ended (no task of the agent's outlives its run).
            await asyncio.gather(*(t for t in (watch, self._interruption) if t is not None), return_exceptions=True)
            self.registered.clear()
            await self.runner.silence_all("worker stopping")
            await self.telemetry.stop()
            if self.health is not None:
                await self.health.stop()
                self.health = None
            await self._handler_processes.close()
            if self.runner.tracing is not None:  # the spans still queued go to the collector, then it stops
                await _shut_down(self.runner.tracing)
            self.data_server = self.relay = None
            await self._data_side.stop()

    async def _start_data_plane(self) -> None:
        """Start the data side (worker_agent/data_side.py): the spool, the relay's end, the data endpoint
        (``settings.data_listen``) and the spool's sweeper; the runner keeps plans' bytes in the spool."""
        self.runner.spool = await self._data_side.start()
        self.relay, self.data_server = self._data_side.relay, self._data_side.server
        self.runner.input_timeout_s = self.settings.input_timeout_s

    def stop(self) -> None:
        """Stop gracefully (see the module docstring); a second call skips the drain wait.

        Call it on the agent's event loop (e.g. from ``loop.add_signal_handler``).
        """
        if self._stopping:
            self._stop_now.set()
            return
        self._stopping = True
        self.runner.stop_accepting()
        self._stop_requested.set()
        if self._handshake_task is not None:
            self._handshake_task.cancel()

    def interrupt(self, reason: str = "interrupted") -> None:
        """This host is going away (a spot reclaim, SIGUSR1, ``interruption_command``): take no new plan, preempt
        the running ones (``ctx.preempted``, SIGTERM to their processes; ``preemption_grace_s`` to checkpoint),
        whose ``done(preempted)`` has the coordinator queue them elsewhere at once, then stop (docs/SEMANTICS.md
        §Preemption). Call it on the agent's event loop; a second call changes nothing."""
        if self.interrupted is not None or self._stopping:
            return
        self.interrupted = reason
        grace_s = self.settings.preemption_grace_s
        self._log.warning("host interruption: draining and preempting its plans", reason=reason, grace_s=grace_s,
                          running=self.runner.running_count)  # fmt: skip
        self.runner.stop_accepting()
        self._send_queue.send(protocol.Heartbeat(load=self._load(), leaving=True))  # no new plans here
        self.runner.preempt_all(grace_s, reason)
        self._interruption = asyncio.ensure_future(self._leave_when_stopped(grace_s))

    async def _leave_when_stopped(self, grace_s: float) -> None:
        """Stop once the preempted plans ended (their grace, then the kill grace, at most)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.runner.idle.wait(), grace_s + self.settings.kill_grace_s + 1.0)
        self.stop()

    async def _watch_interruption(self) -> None:
        """Run ``interruption_command`` every ``interruption_poll_s``; exit status 0 interrupts this host."""
        command, period = self.settings.interruption_command, self.settings.interruption_poll_s
        assert command is not None
        while self.interrupted is None and not self._stopping:
            try:
                # In a session of its own: a timeout or the agent's end kills it with what it started (a cancel
                # while asyncio starts it too: wireio/spawn.py).
                start = asyncio.create_subprocess_shell(
                    command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
                proc = await started(start, kill_session)
                try:  # not asyncio.wait_for: on 3.11 it loses run()'s cancel that comes as the command ends (this
                    async with asyncio.timeout(max(period, 1.0)):  # loop then ran on after the agent stopped)
                        out, _ = await proc.communicate()
                except TimeoutError:
                    await kill_session(proc)
                    out = b""
                except asyncio.CancelledError:
                    await kill_session(proc)
                    raise
                if proc.returncode == 0:
                    first = out.decode("utf-8", "replace").strip().splitlines()[:1]
                    self.interrupt(f"--interruption-command: {first[0][:200] if first else 'exit status 0'}")
                    return
            except OSError as exc:
                self._log.warning("cannot run --interruption-command", error=str(exc))
            await asyncio.sleep(period)

    # ------------------------------------------------------------------ session

    def _codec(self, subprotocol: str | None) -> Codec:
        encoding = SUBPROTOCOLS.get(subprotocol or "", "msgpack")  # none selected → msgpack
        codec = self._codecs.get(encoding)
        if codec is None:
            # msgpack: relayed chunks decode as views into their frame, written to the spool without a copy
            inbound = with_chunk_views(protocol.messages.ToWorker, encoding)
            codec = self._codecs[encoding] = Codec(encoding, inbound, "coordinator")
        return codec

    def _hello(self) -> protocol.Hello:
        if self._capabilities is None:  # GPUs, RAM and CPUs do not change; probe once
            settings = self.settings
            probed = probe_capabilities(
                tags=settings.tags, max_concurrency=settings.max_concurrency, ops=(), python_envs=settings.python_envs
            )
            self._capabilities = msgspec.structs.replace(probed, **self._advertised)  # flags beat the probe
            self.runner.devices = DeviceAllocator(self._capabilities.gpus, self.settings.gpu_share)
            self._watch_health(self._capabilities.gpus)
        caps = self.telemetry.capabilities(msgspec.structs.replace(self._capabilities, ops=self.ops))
        return handshake.hello(
            self.worker_id, caps, running=self.runner.running_plans() + self._outbox.pending_done(),
            recent=self._outbox.recent_done, session_secret=self._session_secret,
            data_url=self.data_server.url if self.data_server is not None else "",
        )

    def _watch_health(self, gpus: list[protocol.GpuInfo]) -> None:
        """Start reading the devices' health (worker_agent/gpu_health.py), when there are devices and a source."""
        if not gpus or self.settings.gpu_health_interval_s <= 0 or self.health is not None:
            return
        source = self._health_source or NvmlHealthSource.open()
        if source is None:
            return
        physical = physical_of(gpus, getattr(source, "uuids", ()))
        rules = HealthRules(len(gpus), hot_c=self.settings.gpu_hot_c)
        self.health = HealthMonitor(source, physical, rules, self.settings.gpu_health_interval_s, self._health_changed)
        self.health.start()

    def _health_changed(self) -> None:
        """A device's health moved: quarantined devices take no new plan here, and the coordinator is told at once;
        with ``on_quarantine="requeue"`` the plans running on a newly quarantined device are preempted (requeued)."""
        assert self.health is not None
        rules = self.health.rules
        blocked = frozenset(rules.quarantined)
        newly = blocked - self.runner.devices.blocked
        self.runner.devices.blocked = blocked
        if newly and self.settings.on_quarantine == "requeue":
            why = "; ".join(f"device {index} quarantined: {rules.state(index)[1]}" for index in sorted(newly))
            self.runner.preempt_holding(newly, self.settings.preemption_grace_s, f"worker {self.worker_id}: {why}")
        if self.registered.is_set():
            self._send_queue.send(protocol.Heartbeat(load=self._load()))

    async def _connect_and_serve(self) -> bool:
        """One session; returns whether it got as far as ``welcome``."""
        self._handshake_task = asyncio.ensure_future(self._handshake())
        try:
            shaken = await self._handshake_task
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._stopping and task is not None and not task.cancelling():
                return False  # stop() interrupted the handshake
            raise
        finally:
            self._handshake_task = None
        if shaken is None:
            return False
        ws, codec, welcome, early = shaken
        async with ws:
            self._on_welcome(welcome)
            for msg in early:
                self._dispatch(msg)
            await self._serve(ws, codec, welcome)
        return True

    async def _handshake(self) -> tuple[ClientConnection, Codec, protocol.Welcome, list[Any]] | None:
        """Dial, send ``hello`` and read until the answer (worker_agent/handshake.py); None: no session this time.

        The upgrade and then the wait for ``welcome`` each get the dial's bound (handshake.py: a cluster reconnect's
        the shorter ``reconnect_dial_timeout_s``); a welcome that does not come within it is a dial that timed out:
        its URL goes to the back of the turn, as a frozen coordinator's."""
        url = self.url = self._dialer.next_url()
        # A cluster reconnect's dial is bounded shorter: a frozen coordinator answers nothing (handshake.py).
        timeout_s = self._dialer.timeout_s(self.settings.handshake_timeout_s, self.settings.reconnect_dial_timeout_s)
        ws = await self._dial(url, timeout_s)
        try:
            codec = self._codec(ws.subprotocol)
            self._outbox.rewind()  # what the last session sent but got no ack for goes first
            self._outbox.discard_heartbeats()
            await ws.send(codec.encode([self._hello()]), text=codec.text)
            answer = handshake.Answer()
            async with asyncio.timeout(timeout_s):
                while (verdict := answer.feed(codec.decode(await ws.recv()))) is None:
                    pass
                if isinstance(verdict, handshake.Welcomed):
                    return ws, codec, verdict.welcome, verdict.early
                if isinstance(verdict, protocol.Error):
                    self._hello_retry_s = verdict.retry_after_s if verdict.retry_after_s > 0 else 0.0
                    self._log.error("coordinator refused hello", code=verdict.code, message=verdict.message,
                                    retry_after_s=verdict.retry_after_s or None)  # fmt: skip
                else:
                    self._follow(verdict)
                await ws.close()
                return None
        except TimeoutError:  # upgraded, then no answer to hello (overloaded, stuck): run() backs off and redials
            self._dialer.dial_ended(url, timed_out=True)  # a hung handshake: to the back of the turn
            self._opened = False  # and for the backoff a dial that timed out (unanswered), not a refusal
            shorter = timeout_s < self.settings.handshake_timeout_s  # a cluster reconnect's bound (handshake.py)
            flag = "--reconnect-dial-timeout" if shorter else "--handshake-timeout"
            self._log.error(f"no welcome from the coordinator within {flag} after hello; reconnecting",
                            url=url, timeout_s=timeout_s)  # fmt: skip
            await ws.close()
            return None
        except ConnectionClosed as exc:
            if exc.rcvd is not None and exc.rcvd.code == errors.CLOSE_REMOVED:  # our hello refused: removed
                raise WorkerRemoved(self.worker_id, self.url, exc.rcvd.reason) from None
            raise
        except BaseException:
            await ws.close()
            raise

    async def _dial(self, url: str, timeout_s: float) -> ClientConnection:
        """The websocket upgrade to ``url``, within ``timeout_s``.

        Raises:
            AuthError: refused 401 or 403 (worker_agent/handshake.py ``upgrade_refusal``).
            InvalidStatus: refused otherwise (the backoff waits its Retry-After).
        """
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else None
        # Only for wss://: an explicit ssl=None there would mean plain TCP.
        tls: dict[str, Any] = {"ssl": self._ssl} if self._ssl is not None else {}
        # A frozen coordinator is left within seconds in cluster mode (protocol/urls.py keepalive).
        ping_interval, ping_timeout, close_timeout = keepalive(
            self.settings.ping_interval_s, self.settings.ping_timeout_s, cluster=self._dialer.cluster
        )
        try:
            ws = await connect(
                # The id in the upgrade: a reconnect-budget 429 then holds this id only, not its neighbours
                # on this host with the same token (docs/PROTOCOL.md §1).
                with_worker_id(url, self.worker_id),
                additional_headers=headers,
                subprotocols=[Subprotocol(ENCODING_SUBPROTOCOL[self.settings.encoding])],
                compression=None,
                max_size=64 << 20,
                open_timeout=timeout_s,
                ping_interval=ping_interval,
                ping_timeout=ping_timeout,
                close_timeout=close_timeout,
                create_connection=SinkConnection,  # relayed chunks past the library's copies, frames dispatched as read
                **tls,
            )
        except InvalidStatus as exc:
            self._dialer.dial_ended(url, timed_out=False)
            fatal = handshake.upgrade_refusal(url, exc.response.status_code, exc.response.body)
            if fatal is not None:
                raise fatal from None
            raise
        except TimeoutError:
            self._dialer.dial_ended(url, timed_out=True)
            raise
        self._dialer.dial_ended(url, timed_out=False)
        self._opened = True
        return ws

    def _follow(self, moved: protocol.messages.Moved) -> None:
        """Cluster mode: the shard of this worker's pool is served at ``moved.url`` ("": try the list)."""
        self._log.info("moved", shard=moved.shard, epoch=moved.epoch, to=moved.url or "(no owner yet)", url=self.url)
        self._dialer.follow(moved)

    def _on_welcome(self, welcome: protocol.Welcome) -> None:
        if self.data_server is not None:
            self.data_server.set_keys(welcome.data_keys)
        if self.relay is not None:
            self.relay.set_keys(welcome.data_keys)
        for plan_id in welcome.abandon_plans:
            self.attempts.ended(plan_id, 0, "was taken back by the coordinator (abandoned while this worker was away)")
        self._session_secret = welcome.session_secret
        self.runner.on_welcome(welcome)
        resent = self._outbox.welcomed(welcome.continue_plans)
        if resent:
            self._log.warning("re-sending results the coordinator lost", plans=resent)
        self._finish_writing = False
        self.registered.set()
        self._log.info(
            "registered",
            url=self.url,
            continue_plans=len(welcome.continue_plans),
            abandon_plans=len(welcome.abandon_plans),
        )

    async def _serve(self, ws: ClientConnection, codec: Codec, welcome: protocol.Welcome) -> None:
        interval = welcome.heartbeat_interval_s if welcome.heartbeat_interval_s > 0 else 10.0
        reader = asyncio.ensure_future(self._read_loop(ws, codec))
        writer = asyncio.ensure_future(self._write_loop(ws, codec))
        beater = asyncio.ensure_future(self._heartbeat_loop(interval))
        stopper = asyncio.ensure_future(self._stop_requested.wait())
        tasks = (reader, writer, beater, stopper)
        try:
            await asyncio.wait((reader, writer, stopper), return_when=asyncio.FIRST_COMPLETED)
            if stopper.done() and not reader.done() and not writer.done():
                await self._leave(ws, reader, writer)
        finally:
            self.registered.clear()
            if self.relay is not None:
                self.relay.reset()  # the coordinator ended its streams with the session
            self.pulls.reset()  # ... and this worker's relayed pulls, which open again on the next one
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results[:2]:
            if isinstance(result, Exception) and not isinstance(result, ConnectionClosed):
                self._log.error(
                    "session task failed", error=f"{type(result).__name__}: {result}",
                    exception="".join(traceback.format_exception(result)),
                )
        level = "info" if self._stopping or ws.close_code in (1000, 1001) else "warning"
        if ws.close_code in (errors.CLOSE_REPLACED, errors.CLOSE_REMOVED):
            level = "error"  # another process registered with our id, or an operator removed it
        getattr(self._log, level)(
            "disconnected", close_code=ws.close_code, close_reason=ws.close_reason, running=self.runner.running_count
        )
        if ws.close_code == errors.CLOSE_REMOVED and not self._stopping:
            # An operator removed this worker for good: stop instead of reconnecting.
            raise WorkerRemoved(self.worker_id, self.url, ws.close_reason or "")

    async def _read_loop(self, ws: ClientConnection, codec: Codec) -> None:
        await FrameSink(self._dispatch, codec.decode, text=codec.text).read(ws)  # past websockets' queue (wireio)

    async def _write_loop(self, ws: ClientConnection, codec: Codec) -> None:
        """The session's only sender: everything queued goes out coalesced (worker_agent/outbox.py, write_frames);
        a stream's event that comes spaced while it waits is written at once by the one who sends it."""
        text = codec.text

        async def send(frame: bytes) -> None:
            await send_frame(ws, frame, text)  # big ones without the library's copies

        await write_frames(
            self._send_queue, codec, send, max_frame_bytes=self.settings.max_frame_bytes, max_batch=MAX_BATCH,
            finishing=lambda: self._finish_writing,
            after_round=self.relay.resume if self.relay is not None else None,  # relayed outputs' next chunks
            write_now=functools.partial(_write_now_spin, ws, text),
        )

    async def _heartbeat_loop(self, interval_s: float) -> None:
        while True:
            self._send_queue.send(protocol.Heartbeat(load=self._load()))
            await asyncio.sleep(interval_s * self._rng.uniform(0.9, 1.1))

    def _load(self) -> protocol.Load:
        """The load for a ``heartbeat``: the runner's, telemetry's and the data endpoint's counts."""
        load = self.telemetry.load(self.runner.load.snapshot())
        if self.runner.devices.gpus:
            load.gpus_free = self.runner.devices.free
        if self.health is not None:
            load.devices = self.health.rules.report()
        server = self.data_server
        return load if server is None else server.count_into(load)

    async def _leave(self, ws: ClientConnection, reader: asyncio.Future[None], writer: asyncio.Future[None]) -> None:
        """Graceful stop while connected: drain, hand back what is left, goodbye, close."""
        runner = self.runner
        drain_timeout_s = self.settings.drain_timeout_s
        self._log.info("stopping", running=runner.running_count, drain_timeout_s=drain_timeout_s)
        # Announce the stop first, so the coordinator places nothing more here while the running
        # plans finish (docs/PROTOCOL.md, heartbeat.leaving); goodbye then removes the worker.
        self._send_queue.send(protocol.Heartbeat(load=self._load(), leaving=True))
        runner.hand_back_waiting(f"worker {self.worker_id} is stopping")
        runner.hand_back_unfed("handed back: worker stopping before any of its inputs arrived")
        if runner.running_count and drain_timeout_s > 0:
            idle = asyncio.ensure_future(runner.idle.wait())
            now = asyncio.ensure_future(self._stop_now.wait())
            await asyncio.wait(
                (idle, now, reader, writer), timeout=drain_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            idle.cancel()
            now.cancel()
        runner.silence_running("handed back: worker stopping")
        self._send_queue.send(protocol.Goodbye(reason="worker stopping"))
        self._finish_writing = True
        if not writer.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(writer), 5.0)
        await ws.close()

    # ------------------------------------------------------------------ dispatch (no awaits)

    def _dispatch(self, msg: protocol.messages.ToWorker | DecodeFailure) -> None:
        SPIN.received()  # the spin after this worker's last frame ends (wireio/spin.py)
        match msg:
            case protocol.Assign():
                self.attempts.assigned(msg.plan_id, msg.attempt)  # before the runner: a reject ends it again
                self.runner.on_assign(msg)
            case protocol.Ack():  # second: one a sequential round trip, at the front of the assign's frame
                self._outbox.ack(msg.seq)
            case protocol.Cancel():
                self.attempts.ended(msg.plan_id, msg.attempt, "was cancelled")
                self.runner.on_cancel(msg)
            case protocol.Error():
                if msg.code == errors.STALE_LEASE and msg.plan_id:
                    self.attempts.ended(msg.plan_id, msg.attempt, "is no longer this worker's (stale lease)")
                self.runner.on_error(msg)
            case protocol.Drain():
                self.runner.on_drain(msg)
            case protocol.Undrain():
                self.runner.on_undrain()
            case protocol.Revoke():
                self.runner.on_revoke(msg)
            case protocol.Preempt():
                self.runner.on_preempt(msg)  # checkpoint signal now, cancelled past its grace (§Preemption)
            case protocol.DataKeys():
                if self.data_server is not None:
                    self.data_server.set_keys(msg.keys)
                if self.relay is not None:
                    self.relay.set_keys(msg.keys)
            case protocol.DataOpen() | protocol.DataChunk() | protocol.DataCredit() | protocol.DataEnd():
                if not self.pulls.on_message(msg) and self.relay is not None:  # a pull's, else a stream it holds
                    self.relay.on_message(msg)
            case protocol.Welcome():
                self._log.warning("ignored a second welcome")
            case protocol.messages.Moved():
                self._follow(msg)  # the coordinator closes 4307 next; the next dial goes there
            case protocol.ReleaseDevice():
                if self.health is not None and 0 <= msg.device < len(self.health.rules):
                    self.health.release(msg.device)  # its quarantine ends; the next load says so (sent at once)
                else:
                    self._log.warning("release of a device this worker does not watch", device=msg.device)
            case DecodeFailure():
                self._log.warning("undecodable message from coordinator", code=msg.code, message=msg.message)
            case _:
                assert_never(msg)


def _write_now_spin(ws: ClientConnection, text: bool, frame: bytes) -> bool:
    """``write_frame_now``, then the spin (wireio/spin.py): a finished plan's ``done`` written at once expects the
    coordinator's next frame soon when plans come one after another."""
    if write_frame_now(ws, text, frame):
        SPIN.sent()
        return True
    return False
