"""What the driver must do after an input: the :class:`Effects` of a step, and the :class:`Outbox` that fills them.

What it owns: the effects accumulated since the driver last took them (frames per connection,
closes, autoscaler decisions), and the core's ways of refusing a session: a protocol error
(``error``, then 4400 after too many), a scope refusal (4403) and a submit over the plan limit.

Rules:

* Frames to one connection keep the order they were sent in. Nothing is queued for a
  session that is closing or gone: its frames would never be read.
* A session is closed at most once (the first code and reason win).
* Records are not here: the core adds the step's records (coordinator/records.py) when the
  driver takes the effects, and the driver commits them before it sends any frame of the step.

Depends only on the session table (coordinator/sessions.py) and the protocol messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import structlog

from coordinator import scopes
from coordinator.records import Record
from coordinator.sessions import Session, SessionTable
from protocol import errors
from protocol.messages import Error, ToClient, ToWorker

__all__ = ["Effects", "Outbound", "Outbox", "TraceNote"]

log = structlog.get_logger(__name__)

Outbound = ToWorker | ToClient
"""A frame the core sends: to a worker session or to a client session."""


TraceNote = tuple[str, str, int, str, Any]
"""A lifecycle step of a traced plan (its caller sampled it), for the driver's spans (io/ops/tracing.py):
``(traceparent, plan_id, attempt, kind, data)``, a plain tuple (the least the core builds per step).

``kind`` is the stream event's (``queued``, ``waiting``, ``succeeded``, ...; ``data`` its data); ``leased``
is the scheduler's (``data``: ``(policy, worker_id)`` of the placement; None: recovery adopted the lease).
Noted only while the core traces (``Streams.tracing``): off, nothing is built.
"""


@dataclass
class Effects:
    """What the server must do: commit ``records``, then send ``sends`` (each list in order), then ``closes``.

    No frame of a step may leave before the step's records are durable (coordinator/io/stores/commit.py).
    """

    sends: dict[int, list[Outbound]] = field(default_factory=dict)
    closes: list[tuple[int, int, str]] = field(default_factory=list)  # (conn_id, close code, reason)
    records: list[Record] = field(default_factory=list)  # coordinator/records.py
    decisions: list[dict[str, Any]] = field(default_factory=list)  # autoscaler decisions, for the hook command
    traces: list[TraceNote] | None = None  # traced plans' steps, for the driver's spans (None: none this step)


class Outbox:
    """The effects of the step under way, and the refusals that close or answer a session.

    Args:
        sessions: the open sessions (read only: a frame goes out only to an open, not closing, one).
        counters: the core's counters; refusals are counted there.
        max_protocol_errors: protocol errors one session may make before it is closed with 4400.
    """

    def __init__(self, sessions: SessionTable, counters: dict[str, int], max_protocol_errors: int) -> None:
        self._counters = counters
        self._max_protocol_errors = max_protocol_errors
        self._effects = Effects()
        self.sessions = sessions
        """The open sessions (read only; Streams.emit reads them for its inlined :meth:`send`)."""
        self.sends = self._effects.sends
        """The frames of the step under way, by connection (:meth:`send`; Streams.emit adds its events here)."""
        self.work = 0
        """Work units charged so far (issue 17 finding 1): rows scanned, events replayed. The driver
        reads the difference around each input, adds one per message and charges the principal."""

    def charge(self, units: int) -> None:
        """Count work an input cost beyond its one message (the driver bounds it per frame and principal)."""
        self.work += units

    def take(self) -> Effects:
        """The effects accumulated since the last call; the outbox starts a new step empty."""
        effects, self._effects = self._effects, Effects()
        self.sends = self._effects.sends
        return effects

    # ------------------------------------------------------------------ frames and closes

    def send(self, conn_id: int, msg: Outbound) -> None:
        """Queue a frame for a connection, unless it is gone or closing."""
        session = self.sessions.get(conn_id)
        if session is not None and not session.closing:
            sends = self.sends
            queued = sends.get(conn_id)  # no setdefault(conn_id, []): that makes a list per frame
            if queued is None:
                sends[conn_id] = [msg]
            else:
                queued.append(msg)

    def discard(self, conn_id: int) -> None:
        """The connection is gone: drop the frames queued for it (nothing can reach it any more)."""
        self.sends.pop(conn_id, None)

    def close(self, s: Session, code: int, reason: str) -> None:
        """Close a session with a websocket close code; later input from it is ignored."""
        if not s.closing:
            s.closing = True
            self._effects.closes.append((s.conn_id, code, reason))

    def traced(self, note: TraceNote) -> None:
        """A traced plan's step, for the driver's spans."""
        traces = self._effects.traces
        if traces is None:
            self._effects.traces = [note]
        else:
            traces.append(note)

    def decided(self, decision: dict[str, Any]) -> None:
        """An autoscaler decision, for the server's hook command."""
        self._effects.decisions.append(decision)

    # ------------------------------------------------------------------ refusals

    def forbid(self, s: Session, reason: str, kind: scopes.ScopeReason) -> None:
        """Close a session that overstepped its role or token (4403), changing nothing else (scopes.py)."""
        counters = self._counters
        counters["scope_refused"] += 1
        key = f"scope_refused.{kind}"  # by reason, for /metrics (coordinator/io/ops/metrics.py)
        counters[key] = counters.get(key, 0) + 1
        log.warning(
            "refused: out of scope", reason=reason, conn_id=s.conn_id, role=s.role, principal=s.principal,
            address=s.address, worker_id=s.worker_id,
        )
        self.close(s, errors.CLOSE_FORBIDDEN, reason[:120])  # a close reason holds at most 123 bytes

    def refuse_submit(self, s: Session, req_id: int, reason: str) -> None:
        """Answer a submit over the principal's plan limit; the first refusal per session is logged."""
        s.quota_refusals += 1
        self._counters["plans_refused"] += 1
        if s.quota_refusals == 1:
            log.warning("refused: plan limit", conn_id=s.conn_id, principal=s.principal, address=s.address)
        self.send(s.conn_id, Error(code=errors.TOO_MANY_PLANS, message=reason, req_id=req_id))

    def protocol_error(
        self, s: Session, code: str, message: str, *, req_id: int = 0, plan_id: str | None = None
    ) -> None:
        """Answer a message that broke the protocol; too many on one session close it with 4400."""
        s.protocol_errors += 1
        self._counters["protocol_errors"] += 1
        self.send(s.conn_id, Error(code=code, message=message, req_id=req_id, plan_id=plan_id))
        if s.protocol_errors >= self._max_protocol_errors:
            self.close(s, errors.CLOSE_PROTOCOL, f"too many protocol errors ({s.protocol_errors})")
