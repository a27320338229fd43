"""The generated sections of docs/SEMANTICS.md, docs/PROTOCOL.md, docs/OPERATIONS.md and docs/CLUSTER.md, made from
the code they describe.

    python -m tests.docgen            # print every generated section
    python -m tests.docgen --write    # rewrite the stale sections in docs/
    python -m tests.docgen --check    # exit 1 when a section is stale (as tests/unit/test_docs.py and
                                      # tests/unit/test_protocol_example.py check)

Each section lies between ``<!-- BEGIN GENERATED: <name> (python -m tests.docgen --write) -->`` and
``<!-- END GENERATED -->`` in its document (:data:`SECTIONS`):

* ``plan transitions``: :data:`coordinator.plans.TRANSITIONS`, one row per (event, destination);
* ``close codes`` and ``error codes``: the ``CLOSE_*`` constants and ``ERROR_CODES`` of protocol/errors.py;
* ``worker session`` and ``client session``: the frames of :data:`SCENARIO` run through the real
  :class:`coordinator.core.Coordinator` (``CoreConfig()``), as a JSON peer sends and receives them;
* ``sqlite schema version``, ``store schema versions`` and ``postgresql schema version``: the schema version each
  store writes and the ones it migrates (coordinator/io/stores/schema.py, pg_schema.py ``SCHEMA_VERSION``,
  ``MIGRATIONS``).

The code gives the rows; the words of each row come from the tables below, keyed by the code's
own names, so a new state-table event, close code or error code without words fails the check
instead of going undocumented.

Why here, not in a package: the generator needs protocol, coordinator/plans.py and the core
together and writes files. coordinator/ outside coordinator/io/ is the pure core (no file I/O)
and fleetwire/'s SDK may not import coordinator; tests/ may import every layer, and this is a
tool for the docs, not something a user of the packages runs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import structlog

from coordinator.core import Coordinator, CoreConfig
from coordinator.io.stores import pg_schema, schema
from coordinator.plans import TRANSITIONS, PlanEventName
from coordinator.timeouts import DEFAULT_GRACE_S
from protocol import Codec, errors
from protocol.messages import FromClient, FromWorker, PlanStateName, ToClient, ToWorker

__all__ = [
    "EXAMPLES", "SCENARIO", "SECTIONS", "Step", "begin_marker", "generate", "run_scenario", "splice", "stale_sections",
]

ROOT: Final = Path(__file__).resolve().parents[1]
COMMAND: Final = "python -m tests.docgen --write"
END: Final = "<!-- END GENERATED -->"


def begin_marker(name: str) -> str:
    """The line that opens the generated section ``name``."""
    return f"<!-- BEGIN GENERATED: {name} ({COMMAND}) -->"


GRACE_S: Final = f"{DEFAULT_GRACE_S:g} s"  # the coordinator's timeout_s grace, as the docs write it


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ================================================================== plan transitions

# What each event of the state table is, in the words of the wire (docs/SEMANTICS.md §Plan lifecycle).
TRANSITION_EVENTS: Final[dict[PlanEventName, str]] = {
    "assign": "placement leases the plan to a worker (`assign` sent); attempt+1, so the first lease is attempt 1",
    "accept": "the worker's `accept`",
    "reject": "the worker's `reject` (`unknown_op`, `rejected`): the plan avoids that worker from now on",
    "revoke": "the worker's `reject(revoked)` after a `revoke` (work stealing): no avoidance, attempt not counted",
    "cancel": "a client's `cancel`; a leased worker is sent `cancel` and keeps the lease until its `done`",
    "done.succeeded": "the worker's `done(succeeded)`",
    "done.failed": "the worker's `done(failed)` with no `retries` left",
    "done.cancelled": "the worker's `done(cancelled)`",
    "worker_lost": "the lease is lost (worker reaped, lease missing from its `hello.running`, drain deadline "
    "passed) while counted attempts < `max_attempts`: requeued with attempt+1",
    "worker_lost.final": "the same on the last counted attempt: fails `worker_lost`, `detail.attempts` lists them",
    "retry": "the worker's `done(failed)` with `retries` left: `requeued` says which retry, attempt not counted",
    "handback": "its worker said `goodbye`: queued again at once, attempt not counted",
    "preempt": "its attempt was preempted (stopped for another team's plan, its host interrupted, or a device it "
    "held quarantined) and ended without succeeding: `preempted`, then queued again at once, attempt not counted",
    "doom": "a plan it needs (a reference or `after`) ended failed or cancelled, or an output it needs is lost and "
    "cannot be made again: fails `upstream_failed` or `output_lost` without running (§4 *Plan graphs*)",
    "timeout": f"the coordinator's own `timeout_s` check: still running `timeout_s` + the grace ({GRACE_S}) after it "
    "started, with no `done` from its worker; fails `timeout`, the worker is sent `cancel` (section 5, *Timeouts*)",
}


def transition_table() -> str:
    """The markdown table of :data:`~coordinator.plans.TRANSITIONS`, in the order the code lists it.

    Raises:
        KeyError: an event of the table has no words in :data:`TRANSITION_EVENTS`.
    """
    rows: dict[tuple[PlanEventName, PlanStateName], list[PlanStateName]] = {}
    for (state, event), target in TRANSITIONS.items():
        rows.setdefault((event, target), []).append(state)
    out = ["| from | event | to | when |", "|---|---|---|---|"]
    for (name, to), sources in rows.items():
        if name not in TRANSITION_EVENTS:
            raise KeyError(f"state-table event {name!r} has no words in tests/docgen.py TRANSITION_EVENTS")
        out.append(f"| {', '.join(sources)} | `{name}` | {to} | {_cell(TRANSITION_EVENTS[name])} |")
    return "\n".join(out) + "\n"


# ================================================================== close and error codes

CLOSE_CODE_MEANINGS: Final[dict[int, str]] = {
    errors.CLOSE_NORMAL: "Normal closure. The coordinator sends it after `goodbye`.",
    errors.CLOSE_GOING_AWAY: "The coordinator is shutting down (or restarting). Reconnect with backoff and resume "
    "(section 5).",
    errors.CLOSE_TOO_BIG: "A frame was over the size limit. The coordinator sends this as soon as the frame's header "
    "arrives and then closes the TCP connection without reading the rest, so a peer still writing that frame may "
    "see its write fail (or a reset) rather than the close frame.",
    errors.CLOSE_INTERNAL: "Internal error, or websocket ping timeout (about 40 s without a pong; client sessions: "
    "worker sessions are not pinged, a silent worker is closed `4408`).",
    errors.CLOSE_PROTOCOL: "Too many protocol errors on this session (100).",
    errors.CLOSE_REVOKED: "The session's token was revoked (the coordinator reloaded its token file without it). "
    "Reconnecting gets `401`.",
    errors.CLOSE_FORBIDDEN: "Out of scope: a message type of the other role; a worker message naming another "
    "worker's current lease; a `hello` with a `worker_id` its token may not register. Nothing was changed.",
    errors.CLOSE_HEARTBEAT_TIMEOUT: "Worker reaped: no heartbeat within `heartbeat_timeout_s`.",
    errors.CLOSE_REMOVED: "An operator removed this worker (`remove_worker`, `fleetwire remove`); a `hello` with its "
    "id is refused the same way until the coordinator restarts. The agent stops instead of reconnecting.",
    errors.CLOSE_REPLACED: "The `worker_id` moved to a newer session that proved it (`session_secret`, "
                           "client certificate) or found the holder silent; or, sent to the newcomer after "
                           "`error(worker_id_in_use)`, the id is held by a live session.",
    errors.CLOSE_RATE_LIMITED: "The connection stayed above its message rate limit (it was throttled first). "
    "Slow down. Also sent after `error(too_many_reconnects)`: the worker id registered more often than its reconnect "
    "budget.",
    errors.CLOSE_MOVED: "Cluster mode: another coordinator owns this session's shard; the `moved` message sent "
    "just before says where. Reconnect to its `url` (or to the next coordinator of the list when it is empty).",
    errors.CLOSE_SLOW_CONSUMER: "The peer stopped reading and the messages waiting for it reached the limit. "
    "Reconnect and resume from the last `seq` processed.",
}

ErrorWhere = Literal["error", "ErrorInfo", "reject", "ErrorInfo, reject"]

ERROR_CODE_MEANINGS: Final[dict[str, tuple[ErrorWhere, str]]] = {
    errors.BAD_FRAME: ("error", "The frame is not valid msgpack or JSON at all (malformed, truncated, empty, "
                       "trailing bytes), or it is the wrong frame kind for the subprotocol. Nothing of the frame "
                       "was handled."),
    errors.INVALID_MESSAGE: ("error", "A message that parses but is not valid: not a map (`42`, `null`, `\"x\"`, "
                             "or such an item of an array frame), no string `type`, a known `type` whose fields do "
                             "not validate (the message names the path, e.g. `` `$.req_id` ``), a msgpack extension "
                             "type other than the timestamp. Also an empty `hello.worker_id`, a worker event "
                             "with a reserved kind, or a worker message without an `attempt` (0)."),
    errors.UNKNOWN_TYPE: ("error", "A `type` neither role may send (a type of the other role closes the session "
                          "`4403`)."),
    errors.NOT_REGISTERED: ("error", "A worker message before `hello`."),
    errors.ALREADY_REGISTERED: ("error", "A second `hello` on one session."),
    errors.PLAN_NOT_FOUND: ("error", "`subscribe`, `cancel` or `get_plan` named a plan that does not exist (or is "
                            "another principal's). `plan_id` is set."),
    errors.UNKNOWN_WORKER: ("error", "`drain_worker`, `undrain_worker` or `remove_worker` named a worker that is not "
                            "registered."),
    errors.STALE_LEASE: ("error", "A worker message for a (plan, attempt) that is not its current lease (an older "
                         "attempt, its own or not, or a plan the coordinator does not hold). Stop that attempt "
                         "(`attempt`, always 1 or more: a message without one is `invalid_message`). A "
                         "message naming the *current* attempt of another worker's lease is not stale: it closes "
                         "the session `4403`. A plan that finished, or went back to the queue, has no lease: a "
                         "message about its last attempt is stale whoever held it."),
    errors.INVALID_TRANSITION: ("error", "The message asks for a move the state table forbids (e.g. `reject` after "
                                "`accept`)."),
    errors.INVALID_ARGUMENT: ("error", "A request was refused: a `submit` (section 5), a `list_plans` limit, a drain "
                              "deadline; a `hello` whose `protocol` is not 1 or whose `worker_id` is too long."),
    errors.UNKNOWN_OP: ("ErrorInfo, reject", "The worker has no handler for the op."),
    errors.REJECTED: ("reject", "The worker is full or draining; the plan is requeued and avoids that worker."),
    errors.REVOKED: ("reject", "The worker dropped an unstarted plan the coordinator revoked; the plan is requeued "
                     "and may go back to that worker."),
    errors.HANDLER_ERROR: ("ErrorInfo", "The handler raised or exited non-zero. The coordinator also uses it for a "
                           "`done(failed)` without `error`."),
    errors.ENGINE_ERROR: ("ErrorInfo", "The inference engine a worker fronts (op `generate`) was unreachable, "
                          "answered an HTTP error or failed mid-stream."),
    errors.TIMEOUT: ("ErrorInfo", "The attempt ran past `timeout_s`: reported by the worker, or, when the worker "
                     f"did not report it within a grace ({GRACE_S}), by the coordinator (`detail.enforced_by` is "
                     "`\"coordinator\"`; section 5, *Timeouts*)."),
    errors.WORKER_LOST: ("ErrorInfo", "The plan lost its worker on its last attempt."),
    errors.CANCELLED: ("ErrorInfo", "The `error` of a cancelled plan's `PlanInfo`."),
    errors.INTERNAL: ("error", "A coordinator bug while handling the message. Details are in the coordinator log."),
    errors.UNAVAILABLE: ("error", "A `submit` while the coordinator's store cannot take writes (cluster mode: the "
                         "PostgreSQL primary is away, a failover is under way). Nothing was recorded; the error's "
                         "`retry_after_s` says when to send it again (the SDK does, with the same plan id). Sent "
                         "instead of closing the session."),
    errors.TOO_MANY_PLANS: ("error", "A `submit` while the principal already has its limit of unfinished (queued, "
                            "leased or running) plans. Nothing was recorded; retry once some finish."),
    errors.FORBIDDEN: ("error", "`drain_worker`, `undrain_worker` or `remove_worker` on a session whose token is "
                       "not an admin token. Nothing changed; use an admin token."),
    errors.WORKER_ID_IN_USE: ("error", "A `hello` for a worker id a live session holds, or whose holder's "
                              "connection closed less than `--worker-reconnect-grace-s` ago, without that id's "
                              "`session_secret` or the holder's client certificate; the message names the "
                              "holder's address, and `retry_after_s` the grace left. The session is then closed "
                              "`4409`; the holder keeps the id."),
    errors.TOO_MANY_RECONNECTS: ("error", "A `hello` for a worker id that registered more often than its reconnect "
                                 "budget (`--worker-reconnect-burst` at once, then `--worker-reconnect-rate` per "
                                 "second): a worker reconnecting in a loop. Nothing changed; `retry_after_s` says "
                                 "when the id may register again. The session is then closed `4429`, and the "
                                 "token's next upgrades from that address get `429` for a cool-off."),
    errors.UPSTREAM_FAILED: ("ErrorInfo", "A plan whose output the plan uses, or which it runs after (`after`), ended "
                             "failed or cancelled, or failed so itself: `detail.upstream` names that plan and "
                             "`detail.root` the one whose end started it (§4 *Plan graphs*)."),
    errors.OUTPUT_LOST: ("ErrorInfo", "An output the plan uses is gone (its worker is gone, or its spool dropped it) "
                         "and cannot be made again (its producer is not `deterministic`, took uploaded inputs, or "
                         "its rebuild failed), or its producer succeeded without making it. The message names the "
                         "output and why (§4 *Plan graphs*)."),
    errors.TICKET_REFUSED: ("ErrorInfo", "The worker holding an output the plan uses refused the ticket to fetch it "
                            "(401 or 403, through the relay `unauthorized` or `forbidden`): it does not accept the key "
                            "that signed it (cluster mode: coordinators with different `--cluster-secret-file`, or a "
                            "key dropped, or one the holder has not learned yet). The output is not taken as lost; the "
                            "plan is placed again with a fresh ticket, the attempt not counted, up to 3 times; after "
                            "that an attempt counts as a failure (retried up to `retries`). The message has the "
                            "holder's reason (§4 *Plan graphs*)."),
}


def close_codes() -> dict[str, int]:
    """Every ``CLOSE_*`` constant of protocol/errors.py, by name, in code order (value order)."""
    found = {name: code for name, code in vars(errors).items() if name.startswith("CLOSE_") and isinstance(code, int)}
    return dict(sorted(found.items(), key=lambda item: item[1]))


def close_code_table() -> str:
    """The markdown table of the close codes the coordinator sends.

    Raises:
        KeyError: a close code has no words in :data:`CLOSE_CODE_MEANINGS`.
    """
    out = ["| Code | Constant (protocol/errors.py) | Meaning |", "|---|---|---|"]
    for name, value in close_codes().items():
        if value not in CLOSE_CODE_MEANINGS:
            raise KeyError(f"close code {name} = {value} has no words in tests/docgen.py CLOSE_CODE_MEANINGS")
        out.append(f"| `{value}` | `{name}` | {_cell(CLOSE_CODE_MEANINGS[value])} |")
    return "\n".join(out) + "\n"


def error_code_table() -> str:
    """The markdown table of ``protocol.errors.ERROR_CODES``, in the order the code lists them.

    Raises:
        KeyError: an error code has no words in :data:`ERROR_CODE_MEANINGS`.
    """
    out = ["| Code | Where | When |", "|---|---|---|"]
    for code in errors.ERROR_CODES:
        if code not in ERROR_CODE_MEANINGS:
            raise KeyError(f"error code {code!r} has no words in tests/docgen.py ERROR_CODE_MEANINGS")
        where, when = ERROR_CODE_MEANINGS[code]
        out.append(f"| `{code}` | {where} | {_cell(when)} |")
    return "\n".join(out) + "\n"


# ================================================================== session transcripts

Peer = Literal["worker", "client"]

WORKER: Final = 1  # connection ids of the scenario's sessions
CLIENT: Final = 2
WORKER_AGAIN: Final = 3
WORKER_ADDRESS: Final = "10.0.0.7:56068"
CAPABILITIES: Final = (
    '{"cpu_cores":16,"ram_bytes":64000000000,"gpus":[{"name":"NVIDIA H100","memory_bytes":80000000000,'
    '"uuid":"GPU-5f1c"}],"accelerator":"gpu","ops":["echo","shell"],"tags":["gpu","us-east"],'
    '"max_concurrency":2,"hostname":"node1"}'
)
# The ids the coordinator makes for plans submitted without one, in order.
GENERATED_IDS: Final = ("0534272ff99425ff", "2b5d9b0d09faa73e")


@dataclass(frozen=True)
class Step:
    """One input of the scenario.

    Attributes:
        at_s: the core's clock (monotonic seconds) for this input.
        conn: the connection it comes on (:data:`WORKER`, :data:`CLIENT`, :data:`WORKER_AGAIN`).
        frame: the JSON text frame the peer sends; ``""`` for no frame (see ``drop``).
        drop: the connection drops (no close frame) instead of sending.
        note: a line shown in the transcript of the step's peer before its frame.
    """

    at_s: float
    conn: int
    frame: str = ""
    drop: bool = False
    note: str = ""


_ROLE: Final[dict[int, Peer]] = {WORKER: "worker", CLIENT: "client", WORKER_AGAIN: "worker"}

# One run: a worker and a client on the same coordinator. §9 shows the worker's side, §10 the client's.
SCENARIO: Final[tuple[Step, ...]] = (
    Step(0.0, WORKER, '{"type":"hello","worker_id":"gpu-node-1","capabilities":' + CAPABILITIES
         + ',"version":"0.1.0"}'),
    Step(0.2, WORKER, '{"type":"heartbeat","load":{}}'),
    Step(1.0, CLIENT, '{"type":"submit","req_id":1,"op":"echo","args":{"prompt":"hi"},"requirements":{"tags":["gpu"]},'
         '"plan_id":"job-42","timeout_s":60}'),
    Step(1.1, WORKER, '{"type":"accept","plan_id":"job-42","attempt":1,"seq":1}'),
    Step(1.2, WORKER, '[{"type":"event","plan_id":"job-42","attempt":1,"kind":"progress","data":{"pct":50},'
         '"seq":2,"ephemeral":true},{"type":"done","plan_id":"job-42","attempt":1,"outcome":"succeeded",'
         '"result":{"prompt":"hi"},"seq":3}]'),
    Step(1.5, CLIENT, '{"type":"get_plan","req_id":2,"plan_id":"job-42"}'),
    Step(2.0, CLIENT, '{"type":"submit","req_id":3,"op":"train","requirements":{"tags":["tpu"]}}'),
    Step(10.0, WORKER, '{"type":"heartbeat","load":{"latency_ema_ms":12.5}}'),
    Step(10.5, CLIENT, '{"type":"list_workers","req_id":4}'),
    Step(11.0, CLIENT, '{"type":"get_plan","req_id":5,"plan_id":"nope"}'),
    Step(11.5, CLIENT, '{"type":"subscribe","req_id":6,"plan_ids":["job-42"],"from_seq":3}'),
    Step(12.0, CLIENT, '{"type":"submit","req_id":7,"op":"shell","args":{"cmd":"sleep 600"}}'),
    Step(12.1, WORKER, '{"type":"accept","plan_id":"2b5d9b0d09faa73e","attempt":1,"seq":4}'),
    Step(12.2, WORKER, '{"type":"event","plan_id":"2b5d9b0d09faa73e","attempt":1,"kind":"running","data":{},'
         '"seq":5}'),
    Step(13.0, CLIENT, '{"type":"cancel","req_id":8,"plan_id":"2b5d9b0d09faa73e"}'),
    Step(13.1, WORKER, '{"type":"done","plan_id":"2b5d9b0d09faa73e","attempt":1,"outcome":"cancelled","seq":6}'),
    Step(13.5, WORKER, '{"type":"accept","plan_id":"job-42","attempt":7,"seq":7}'),
    Step(14.0, CLIENT, '{"type":"submit","req_id":9,"op":"echo","plan_id":"job-9","args":{"prompt":"again"}}'),
    Step(14.1, WORKER, '{"type":"accept","plan_id":"job-9","attempt":1,"seq":8}'),
    Step(15.0, CLIENT, '{"type":"submit","req_id":10,"op":"echo","plan_id":"job-9","args":{"prompt":"again"}}'),
    Step(16.0, WORKER, drop=True, note="(the connection drops; the worker dials again on a new session)"),
    Step(17.0, WORKER_AGAIN, '{"type":"hello","worker_id":"gpu-node-1","capabilities":' + CAPABILITIES
         + ',"running":[{"plan_id":"job-9","attempt":1},{"plan_id":"2b5d9b0d09faa73e","attempt":1}],'
         '"version":"0.1.0","session_secret":"secret-1"}'),
    Step(17.1, WORKER_AGAIN, '{"type":"done","plan_id":"job-9","attempt":1,"outcome":"succeeded",'
         '"result":{"prompt":"again"},"seq":9}'),
    Step(18.0, CLIENT, '[{"type":"get_plan","req_id":11},{"type":"frobnicate","req_id":12},'
         '{"type":"list_workers","req_id":13}]'),
    Step(19.0, CLIENT, '{"type":"heartbeat","load":{}}'),
    Step(20.0, WORKER_AGAIN, '{"type":"goodbye","reason":"SIGTERM: draining"}'),
)


def _inbound(role: Peer) -> Codec:
    return Codec("json", FromWorker if role == "worker" else FromClient, role)


def _outbound(role: Peer) -> Codec:
    return Codec("json", ToWorker if role == "worker" else ToClient, "coordinator")


def run_scenario(steps: tuple[Step, ...] = SCENARIO) -> dict[Peer, list[str]]:
    """Run ``steps`` through a real core and return each peer's transcript lines.

    Frames are decoded with :class:`protocol.Codec` as the server decodes them; each step's
    effects for a connection become one frame, encoded as the server encodes them.
    """
    ids: Iterator[str] = iter(GENERATED_IDS)
    core = Coordinator(CoreConfig(), new_id=lambda: next(ids))
    core.open_session(WORKER, "worker", 0.0, principal="workers", address=WORKER_ADDRESS)
    core.open_session(CLIENT, "client", 0.0, principal="alice", address="10.0.0.9:40112")
    opened = {WORKER, CLIENT}
    lines: dict[Peer, list[str]] = {"worker": [], "client": []}
    for step in steps:
        role = _ROLE[step.conn]
        if step.note:
            lines[role].append(step.note)
        if step.drop:
            core.close_session(step.conn, step.at_s)
        else:
            if step.conn not in opened:  # a reconnect: a new session for the same peer
                core.open_session(step.conn, _ROLE[step.conn], step.at_s, principal="workers", address=WORKER_ADDRESS)
                opened.add(step.conn)
            lines[role].append(f"→ {step.frame}")
            for msg in _inbound(role).decode(step.frame):
                core.receive(step.conn, msg, step.at_s)
        effects = core.take_effects()
        for conn, msgs in effects.sends.items():
            lines[_ROLE[conn]].append(f"← {_outbound(_ROLE[conn]).encode(msgs).decode()}")
        for conn, code, reason in effects.closes:
            lines[_ROLE[conn]].append(f'  (closed by the coordinator: {code} "{reason}")')
            core.close_session(conn, step.at_s)
    return lines


def _fenced(lines: list[str]) -> str:
    return "```text\n" + "\n".join(lines) + "\n```\n"


def worker_transcript() -> str:
    """§9: the worker's frames of :data:`SCENARIO`."""
    return _fenced(run_scenario()["worker"])


def client_transcript() -> str:
    """§10: the client's frames of :data:`SCENARIO`."""
    return _fenced(run_scenario()["client"])


# ================================================================== store schema versions

# The schema version each store writes, and the ones it migrates, as the docs state them: a statement of a
# version in prose goes stale at the next migration (docs/OPERATIONS.md said 4, docs/SEMANTICS.md 3, at 6).
# tests/unit/test_docs.py refuses "schema version N" outside these sections.


def _versions(first: int, last: int) -> str:
    return f"version {first}" if first == last else f"versions {first} to {last}"


def _paragraph(text: str, indent: str = "") -> str:
    return textwrap.fill(text, width=110, initial_indent=indent, subsequent_indent=" " * len(indent))


def sqlite_upgrade() -> str:
    """docs/OPERATIONS.md §Upgrade: the SQLite file's version (coordinator/io/stores/schema.py)."""
    v, old = schema.SCHEMA_VERSION, sorted(schema.MIGRATIONS)
    return _paragraph(
        f"**Upgrade.** This release writes schema version {v} (`PRAGMA user_version`; "
        f"coordinator/io/stores/schema.py `SCHEMA_VERSION`): a file of {_versions(old[0], old[-1])} is migrated "
        "at the first start, checksums included, in one transaction. An older coordinator refuses a "
        f"version {v} file: keep a backup taken before the upgrade if you may downgrade."
    )


def store_versions() -> str:
    """docs/SEMANTICS.md §Durability: both stores' versions, one bullet."""
    v, old = schema.SCHEMA_VERSION, sorted(schema.MIGRATIONS)
    pg, pg_old = pg_schema.SCHEMA_VERSION, sorted(pg_schema.MIGRATIONS)
    return _paragraph(
        f"**Schema versions.** The SQLite file is at schema version {v} (`PRAGMA user_version`, "
        f"coordinator/io/stores/schema.py); a file of {_versions(old[0], old[-1])} is migrated on open. The "
        f"PostgreSQL database of cluster mode is at schema version {pg} (`fleetwire_meta.schema_version`, "
        f"coordinator/io/stores/pg_schema.py); a database of {_versions(pg_old[0], pg_old[-1])} is migrated at start "
        "(docs/CLUSTER.md §Tables). Either store refuses a newer version than its coordinator's.",
        "- ",
    )


def pg_schema_version() -> str:
    """docs/CLUSTER.md §Tables: the cluster database's version (coordinator/io/stores/pg_schema.py)."""
    v, old = pg_schema.SCHEMA_VERSION, sorted(pg_schema.MIGRATIONS)
    return _paragraph(
        f"This release writes schema version {v} (`fleetwire_meta.schema_version`; "
        f"coordinator/io/stores/pg_schema.py `SCHEMA_VERSION`, `MIGRATIONS`) and migrates a database of "
        f"{_versions(old[0], old[-1])}."
    )


# ================================================================== documents

# The session examples (checked by tests/unit/test_protocol_example.py); the rest are tables (tests/unit/test_docs.py).
EXAMPLES: Final = ("worker session", "client session")

SECTIONS: Final[dict[str, tuple[str, Callable[[], str]]]] = {
    # name: (document, generator). A name may appear in one document only.
    "plan transitions": ("docs/SEMANTICS.md", transition_table),
    "plan transitions (protocol)": ("docs/PROTOCOL.md", transition_table),
    "close codes": ("docs/PROTOCOL.md", close_code_table),
    "error codes": ("docs/PROTOCOL.md", error_code_table),
    "worker session": ("docs/PROTOCOL.md", worker_transcript),
    "client session": ("docs/PROTOCOL.md", client_transcript),
    "sqlite schema version": ("docs/OPERATIONS.md", sqlite_upgrade),
    "store schema versions": ("docs/SEMANTICS.md", store_versions),
    "postgresql schema version": ("docs/CLUSTER.md", pg_schema_version),
}


def splice(document: str, name: str, section: str) -> str:
    """``document`` with the generated section ``name`` replaced by ``section``.

    Raises:
        ValueError: the section's markers are missing or out of order.
    """
    begin = begin_marker(name)
    start = document.find(begin)
    end = document.find(END, start)
    if start < 0 or end < 0:
        raise ValueError(f"the document has no {begin!r} ... {END!r} section")
    return document[: start + len(begin)] + "\n\n" + section + "\n" + document[end:]


def generate(root: Path = ROOT) -> dict[str, str]:
    """Every document with a generated section, by path relative to ``root``, as it should read."""
    texts: dict[str, str] = {}
    for name, (path, make) in SECTIONS.items():
        text = texts.get(path)
        if text is None:
            text = (root / path).read_text()
        texts[path] = splice(text, name, make())
    return texts


def stale_sections(root: Path = ROOT) -> list[str]:
    """The names of the generated sections whose document differs from the code, in :data:`SECTIONS` order."""
    stale = []
    for name, (path, make) in SECTIONS.items():
        text = (root / path).read_text()
        if splice(text, name, make()) != text:
            stale.append(f"{path}: {name}")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.docgen", description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="rewrite the stale generated sections in docs/")
    group.add_argument("--check", action="store_true", help="exit 1 when a generated section is stale")
    ns = parser.parse_args(argv)
    # The core logs what the scenario does (registrations, the 4403); only the sections go to stdout.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    if ns.check:
        stale = stale_sections()
        for where in stale:
            print(f"{where} is stale; run {COMMAND}", file=sys.stderr)
        return 1 if stale else 0
    if ns.write:
        for path, text in generate().items():
            if (ROOT / path).read_text() != text:
                (ROOT / path).write_text(text)
                print(f"rewrote {path}")
        return 0
    for name, (path, make) in SECTIONS.items():
        print(f"{begin_marker(name)}  [{path}]\n\n{make()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
