"""Every fleetwire wire message, as msgspec Structs in tagged unions.

This module is the whole wire contract (docs/PROTOCOL.md is its prose). Rules:

* Every message is a Struct tagged by its ``type`` field (``tag_field="type"``).
* New fields always get defaults and field types never change, so older peers keep
  decoding newer frames; unknown fields are ignored (msgspec's default).
* Requests from a client carry ``req_id``; the reply (or ``error``) echoes it.
* Some Structs travel in both directions (``event``, ``cancel``, ``error``); which
  messages a peer may send is fixed per session role by the unions at the bottom.

Session roles and their messages (docs/PROTOCOL.md §Messages):

    worker  -> coordinator : hello heartbeat accept reject event done goodbye
                             data_chunk data_credit data_end
    coordinator -> worker  : welcome assign cancel revoke ack drain undrain error data_keys
                             data_open data_chunk data_credit data_end
    client  -> coordinator : submit subscribe unsubscribe cancel get_plan list_workers
                             list_plans drain_worker undrain_worker data_ticket
                             data_open data_chunk data_credit data_end
    coordinator -> client  : accepted subscribed event plan workers plans resync ok error data_grant
                             data_chunk data_credit data_end
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

PROTOCOL_VERSION = 1

PlanStateName = Literal["queued", "leased", "running", "succeeded", "failed", "cancelled"]
Outcome = Literal["succeeded", "failed", "cancelled"]
Accelerator = Literal["cpu", "gpu", "tpu", "npu", "mixed"]

TERMINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})

# A client request's id: 0 means "no request" (the default where one may be left out); a
# negative one is refused at decode (``invalid_message`` naming ``$.req_id``). docs/PROTOCOL.md §4.
ReqId = Annotated[int, msgspec.Meta(ge=0)]


# --------------------------------------------------------------------------- records
# Plain (untagged) Structs nested inside messages.


class GpuInfo(msgspec.Struct, omit_defaults=True):
    """One GPU as the worker's probe saw it."""

    name: str
    memory_bytes: int = 0
    uuid: str = ""
    index: int = 0
    parent_uuid: str = ""  # a MIG instance: the UUID of the physical GPU it is carved from
    visible_id: str = ""  # what CUDA_VISIBLE_DEVICES names it by ("": its index; a MIG instance: its UUID)


class Capabilities(msgspec.Struct, omit_defaults=True):
    """What a worker host offers; sent once in ``hello``."""

    cpu_cores: int = 0
    ram_bytes: int = 0
    gpus: list[GpuInfo] = []
    accelerator: Accelerator = "cpu"
    python_envs: list[str] = []
    models: list[str] = []
    ops: list[str] = []
    tags: list[str] = []
    max_concurrency: int = 1
    hostname: str = ""
    kv_blocks: int = 0  # KV-cache block budget (0: no KV admission on this worker)
    kv_block_tokens: int = 0  # tokens per KV block
    prefix_cache_tokens: int = 0  # prefix-cache size incl. offload tiers (0: kv_blocks * kv_block_tokens)
    carbon_zone: str = ""  # grid zone, e.g. "FR", "US-CAL-CISO"
    # continuous_batching and paged_kv were removed (nothing read them; docs/PROTOCOL.md §2, v1 notes):
    # an older worker that still sends them is understood, the fields being ignored as unknown.
    gpu_share: int = 1  # plans that may hold one of ``gpus`` at once (``--gpu-share K``)
    # It reads ``assign.traceparent`` "0" as "00" (protocol/tracecontext.py UNSAMPLED_SHORT): the coordinator sends it
    # the one-character form, which its decoder does not allocate (an older worker keeps getting "00").
    short_unsampled: bool = False


DeviceState = Literal["ok", "degraded", "quarantined"]


class DeviceHealth(msgspec.Struct, omit_defaults=True):
    """One device's health as the worker sampled it (NVML; docs/OPERATIONS.md §GPU health).

    ``index`` is its position in ``capabilities.gpus`` (as in ``assign.devices``). ``state``:
    ``ok``; ``degraded`` (hot or hardware-throttled: still placed on, ``reason`` says why);
    ``quarantined`` (a fatal XID, rising uncorrectable ECC errors or a failed health probe: no new
    plan is placed on it until an operator releases it, ``release_device``).
    """

    index: int
    state: DeviceState = "ok"
    reason: str = ""  # why it is degraded or quarantined ("": ok)
    utilization_pct: float = 0.0  # GPU busy, 0..100
    memory_used_bytes: int = 0
    temperature_c: float = 0.0
    power_w: float = 0.0
    throttle: list[str] = []  # clocks event reasons now active, e.g. ["hw_thermal_slowdown"]
    ecc_corrected: int = 0  # volatile ECC error counts (since the driver loaded)
    ecc_uncorrected: int = 0
    xid: int = 0  # the last critical XID seen (0: none)
    xid_count: int = 0  # critical XID events seen since the worker started


class Load(msgspec.Struct, omit_defaults=True):
    """A worker's own view of its load; sent in every ``heartbeat``."""

    in_flight: int = 0
    queued: int = 0
    latency_ema_ms: float = 0.0
    queued_tokens: int = 0
    latency_p50_ms: float = 0.0
    latency_p99_ms: float = 0.0
    uj_per_token: float = 0.0  # micro-joules per generated token
    zone_intensity_g_per_kwh: float = 0.0  # grid carbon intensity, gCO2e/kWh
    kv_blocks_used: int = 0
    power_w: float = 0.0  # accelerator power draw now (NVML), watts
    engine_running: int = 0  # inference engine's running requests (e.g. vLLM)
    engine_waiting: int = 0  # inference engine's waiting requests
    kv_cache_usage: float = 0.0  # inference engine's KV-cache usage, 0..1
    data_bytes_in: int = 0  # data endpoint: input bytes received since the worker started
    data_bytes_out: int = 0  # data endpoint: output bytes sent since the worker started
    data_refused: dict[str, int] = {}  # data endpoint: requests refused since the worker started, by HTTP status
    gpus_free: int = -1  # devices no plan holds now (-1: not reported)
    devices: list[DeviceHealth] = []  # each device's health (empty: not sampled; docs/OPERATIONS.md §GPU health)


class Requirements(msgspec.Struct, omit_defaults=True):
    """What a worker must have to run a plan. Empty means any worker."""

    tags: list[str] = []
    accelerator: Accelerator | None = None
    model: str | None = None
    min_gpu_memory_bytes: int = 0
    python_env: str | None = None


class Resources(msgspec.Struct, omit_defaults=True):
    """Devices a plan holds while it runs (docs/PROTOCOL.md §Resources). Empty means none.

    ``gpus``: how many devices (whole GPUs, or MIG instances on a MIG host), each with at least
    ``gpu_memory_gb`` GB (10^9 bytes) and, when ``accelerator`` is set, a model name containing it
    (case-insensitive, e.g. ``"H100"``). A fraction below 1 needs ``share``: one share of a device
    on a worker started with ``--gpu-share K``.
    """

    gpus: float = 0
    gpu_memory_gb: float = 0.0
    accelerator: str = ""
    share: bool = False


class Receipt(msgspec.Struct, omit_defaults=True):
    """What a finished plan used and emitted, and what placement projected (docs/PROTOCOL.md §Receipt).

    The worker fills the measurement (``joules`` .. ``devices``) in its ``done``; the coordinator
    adds the projection it made at assign (``projected_*``; 0: none made).
    """

    joules: float = 0.0  # energy over the plan's run
    co2e_g: float = 0.0  # joules / 3.6e6 * intensity
    estimated: bool = False  # True unless an NVML reading measured it
    source: str = ""  # nvml_counter | nvml_power | power_model | uj_per_token | none
    intensity_g_per_kwh: float = 0.0  # the worker's zone intensity when the plan ended (0: unknown)
    tokens: int = 0  # tokens the handler reported
    run_s: float = 0.0  # seconds from start to end on the worker
    devices: list[str] = []  # the devices it held (CUDA_VISIBLE_DEVICES names)
    projected_joules: float = 0.0  # chosen worker's µJ/token (per generated token) * hinted max output tokens
    projected_co2e_g: float = 0.0
    trace_id: str = ""  # the plan's trace (its submit's traceparent; "": not traced)
    # A plan held for a greener hour (docs/ROUTING.md §Carbon in time; coordinator/carbon_time/accounting.py):
    # the energy times (the zone's mean intensity over the run moved to its submit time - the mean over the run as
    # it happened), both read from the coordinator's latest forecast values. None: not held, or not covered.
    avoided_co2e_g: float | None = None
    ran_g_per_kwh: float = 0.0  # a held plan's: the zone's mean intensity over its run (0: not known)
    at_submit_g_per_kwh: float = 0.0  # ... and over the same run moved to its submit time


class RoutingHints(msgspec.Struct, omit_defaults=True):
    """How a plan would like to be placed; every field is optional."""

    policy: str | None = None  # override the coordinator's default placement policy
    session_key: str | None = None  # sticky: same worker while it is alive and has room
    prefix_hashes: list[int] = []  # hashes of the prompt's KV prefix blocks, in order
    prompt_tokens: int = 0  # estimated prompt tokens
    max_output_tokens: int = 0  # estimated (maximum) generated tokens
    prefix_block_tokens: int = 0  # tokens each prefix hash covers; 0: the worker's kv_block_tokens


class RunningPlan(msgspec.Struct, omit_defaults=True):
    """A plan a (re)connecting worker is still running, listed in ``hello``."""

    plan_id: str
    attempt: int
    devices: list[int] = []  # the devices it holds: positions in ``capabilities.gpus``


class OutputRef(msgspec.Struct, frozen=True, omit_defaults=True):
    """Another plan's output, used as an input (docs/PROTOCOL.md §Plan graphs): plan ``plan_id``'s output ``name``."""

    plan_id: str
    name: str


class InputSpec(msgspec.Struct, omit_defaults=True):
    """A plan input: uploaded by the client to the worker, or another plan's output (docs/PROTOCOL.md §Data plane).

    ``name`` is a plain file name (protocol/tickets.py ``name_problem``); ``size`` in bytes;
    ``digest`` is ``blake3:<hex>`` (what the SDK declares), ``sha256:<hex>`` or ``blake2b:<hex>`` of the
    whole content, checked by the worker. An uploaded input needs both (``invalid_argument`` naming
    the field without them): the worker checks the bytes it receives against the digest.

    The reference form sets ``ref`` and leaves ``size`` and ``digest`` out: the plan waits until the
    referenced output exists, and the coordinator fills them in from it in ``assign`` (issue #28).
    """

    name: str
    size: int = -1  # -1: not given (a reference's; an uploaded input's is required)
    digest: str = ""  # "": not given (a reference's; an uploaded input's is required)
    ref: OutputRef | None = None  # another plan's output (None: the client uploads it)


#: The op of the coordinator's copy plans (``<plan>.c<n>``): each keeps a copy of outputs of a plan submitted with
#: ``replicas`` on another worker; every worker has its handler (worker_agent/handlers.py). Clients may not submit it.
COPY_OP = "fleetwire.copy"


class Pull(msgspec.Struct, omit_defaults=True):
    """Where an input in the reference form is (``assign.pulls``; docs/PROTOCOL.md §Plan graphs).

    Output ``output`` of attempt ``attempt`` of plan ``plan_id`` (the producer's key, or its rebuild's),
    on worker ``worker_id``: fetch it from that worker's data endpoint ``url`` with ``ticket`` (a ``get``
    ticket the coordinator signed for that worker), or copy it from this worker's own spool when
    ``worker_id`` is this worker's id.
    """

    name: str  # the input it is (a name of ``assign.inputs``)
    plan_id: str
    attempt: int
    output: str
    worker_id: str
    url: str = ""  # the holder's data endpoint ("": it has none)
    ticket: str = ""


class OutputSpec(msgspec.Struct, omit_defaults=True):
    """An output a plan's attempt left on its worker (``done.outputs``)."""

    name: str
    size: int
    digest: str = ""


class DataKey(msgspec.Struct, omit_defaults=True):
    """A key the worker verifies data-plane tickets with, named by its key id (protocol/tickets.py)."""

    kid: str
    key: bytes


class ErrorInfo(msgspec.Struct, omit_defaults=True):
    """Why a plan failed: a stable code and a message a person can act on."""

    code: str
    message: str
    detail: Any = None


class WorkerInfo(msgspec.Struct, omit_defaults=True):
    """One registry row, as ``list_workers`` reports it."""

    id: str
    capabilities: Capabilities
    load: Load | None = None
    leases: int = 0
    connected: bool = False
    alive: bool = False
    last_beat_age_s: float | None = None
    address: str = ""
    draining: bool = False  # drained by an operator (drain_worker): takes no new plans
    version: str = ""  # the worker's fleetwire version, from its ``hello`` ("": it sent none)
    gpu_use: list[int] = []  # plans holding each of ``capabilities.gpus`` now, in that order


class PlanInfo(msgspec.Struct, omit_defaults=True):
    """A plan's current record, as ``get_plan`` reports it."""

    id: str
    op: str
    state: PlanStateName
    attempt: int = 0
    worker_id: str | None = None
    priority: int = 0
    requirements: Requirements = msgspec.field(default_factory=Requirements)
    result: Any = None
    error: ErrorInfo | None = None
    last_seq: int = 0
    waiting_reason: str | None = None
    result_bytes: int = 0  # in a listing (``plans``): the result's size; the result itself is left out
    owner: str = ""  # in ``get_plan``/``cancel``: the principal that submitted it ("": not said)
    history: list[dict[str, Any]] = []  # in ``get_plan``/``cancel``: attempts that ended without ending it
    ended_at: float | None = None  # in ``get_plan``/``cancel``: Unix time it reached its final state
    receipt: Receipt | None = None  # a finished plan's energy and carbon (None: none came)
    # To an admin session: the id its owner submitted, when that is not ``id`` (another principal's plan held it
    # when it came: ``id`` is then a key the coordinator made; docs/SEMANTICS.md §Plan ids). None otherwise.
    name: str | None = None
    trace_id: str = ""  # in ``get_plan``/``cancel``: the trace its submit's ``traceparent`` names ("": none)


# --------------------------------------------------------------------------- messages


class _Msg(msgspec.Struct, tag_field="type", omit_defaults=True, gc=False):
    """Base of every tagged message.

    ``gc=False``: the cyclic collector does not track messages (tens of thousands a second go
    through a coordinator; docs/PERFORMANCE.md). A message never refers back to itself, so it
    cannot be part of a cycle; do not build one that does (it would never be freed).
    """


# ---- worker -> coordinator


class Hello(_Msg, tag="hello"):
    """First message of a worker session: who it is and what it can do."""

    worker_id: str
    capabilities: Capabilities
    running: list[RunningPlan] = []
    version: str = ""
    protocol: int = PROTOCOL_VERSION
    data_url: str = ""  # where clients reach its data endpoint, e.g. http://10.0.0.5:8766 ("": none)
    session_secret: str = ""  # this id's secret from its last ``welcome``: proof to take over a live id


class Heartbeat(_Msg, tag="heartbeat"):
    """Periodic liveness beat with the worker's load."""

    load: Load = msgspec.field(default_factory=Load)
    # The worker is stopping: place no new plan on it (its running plans finish, then its
    # ``goodbye`` follows). Sent once, at the start of a graceful stop.
    leaving: bool = False


class Accept(_Msg, tag="accept"):
    """The worker started (or queued locally) an assigned plan."""

    plan_id: str
    attempt: int
    seq: int = 0  # the worker's message counter (see ``ack``); 0: not counted


class Reject(_Msg, tag="reject"):
    """The worker will not run an assigned plan (unknown op, full, draining)."""

    plan_id: str
    attempt: int
    code: str = "rejected"
    reason: str = ""
    seq: int = 0  # the worker's message counter (see ``ack``); 0: not counted


class Done(_Msg, tag="done"):
    """The plan's attempt ended on the worker."""

    plan_id: str
    attempt: int
    outcome: Outcome
    result: Any = None
    error: ErrorInfo | None = None
    seq: int = 0  # the worker's message counter (see ``ack``); 0: not counted
    outputs: list[OutputSpec] = []  # outputs this attempt left on the worker's data endpoint
    receipt: Receipt | None = None  # the attempt's energy and carbon (None: nothing measured, or an older worker)
    # The attempt was preempted (a ``preempt``, its host being interrupted, or a device it held quarantined under
    # ``--on-quarantine requeue``) and did not succeed: the coordinator queues the plan again without counting the
    # attempt (docs/SEMANTICS.md §Preemption).
    preempted: bool = False


class Goodbye(_Msg, tag="goodbye"):
    """The worker is leaving on purpose; the coordinator may close the session."""

    reason: str = ""


# ---- both directions


class Event(_Msg, tag="event"):
    """One event of a plan's stream.

    From a worker: ``plan_id``, ``attempt``, ``kind``, ``data`` (``seq`` is the
    worker's own counter, informational). To a client: the coordinator stamps
    ``seq``, the per-plan position (1, 2, 3, ... without gaps for durable events).
    """

    plan_id: str
    kind: str
    data: Any = None
    seq: int = 0
    attempt: int = 0
    ephemeral: bool = False


class Cancel(_Msg, tag="cancel"):
    """Client -> coordinator: cancel a plan. Coordinator -> worker: stop it."""

    plan_id: str
    req_id: ReqId = 0
    attempt: int = 0
    with_dependants: bool = False  # client -> coordinator: cancel the plans that use its outputs or run after it too


class Error(_Msg, tag="error"):
    """A request failed or a frame was refused. ``code`` is stable (docs/PROTOCOL.md)."""

    code: str
    message: str
    req_id: int = 0
    plan_id: str | None = None
    attempt: int = 0  # with plan_id: which lease the error is about (stale_lease); 0 = any
    retry_after_s: float = 0.0  # with a retryable code (unavailable): send the request again after this long


# ---- coordinator -> worker


class Welcome(_Msg, tag="welcome"):
    """Answer to ``hello``: session settings and which running plans to keep."""

    worker_id: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    continue_plans: list[str] = []
    abandon_plans: list[str] = []
    version: str = ""
    protocol: int = PROTOCOL_VERSION
    prefetch: int = 0  # assigns it may hold unstarted beyond max_concurrency (a local queue)
    data_keys: list[DataKey] = []  # ticket keys for this worker, current first (protocol/tickets.py)
    session_secret: str = ""  # present it in the next ``hello`` to take this id over from a live session


class Assign(_Msg, tag="assign"):
    """Run this plan: the lease is (plan_id, attempt)."""

    plan_id: str
    attempt: int
    op: str
    args: Any = None
    # The plan's trace context, from its submit (W3C; "": not traced; protocol/tracecontext.py). Right after ``args``:
    # a map's keys come in field order, and msgspec looks a key up from the field after the last one found, so here
    # it is found at the first try (last, after ``args`` it was the 7th name tried). Wire-compatible: a map by name.
    traceparent: str = ""
    timeout_s: float | None = None
    inputs: list[InputSpec] = []  # the handler starts once these arrived and were verified
    outputs: list[str] = []  # names the client declared it will fetch
    resources: Resources | None = None  # the plan's device request (None: none)
    devices: list[int] = []  # the devices the coordinator counts it on: positions in ``capabilities.gpus``
    pulls: list[Pull] = []  # where its inputs in the reference form are: fetch them before the handler starts


class DataKeys(_Msg, tag="data_keys"):
    """The ticket keys changed (a rotation): these replace the worker's keys, current first."""

    keys: list[DataKey] = []


class Revoke(_Msg, tag="revoke"):
    """Give back an assigned plan that has not started."""

    plan_id: str
    attempt: int


class Ack(_Msg, tag="ack"):
    """The worker's ``accept``/``reject``/``event``/``done`` messages up to ``seq`` (its counter) are recorded."""

    seq: int


class Drain(_Msg, tag="drain"):
    """Take no new plans; finish running ones within ``deadline_s``."""

    deadline_s: float | None = None


class Undrain(_Msg, tag="undrain"):
    """Take new plans again (an operator's ``undrain_worker`` ended a drain)."""


# ---- client -> coordinator


class Submit(_Msg, tag="submit"):
    """Submit a plan. ``plan_id`` doubles as an idempotency key when given."""

    req_id: ReqId
    op: str
    args: Any = None
    requirements: Requirements = msgspec.field(default_factory=Requirements)
    priority: int = 0
    timeout_s: float | None = None
    max_attempts: int = 3
    plan_id: str | None = None
    subscribe: bool = True
    hints: RoutingHints = msgspec.field(default_factory=RoutingHints)
    retries: int = 0  # times a handler failure (done failed) is retried on a new attempt
    inputs: list[InputSpec] = []  # uploaded to the worker's data endpoint (event ``data_ready``)
    outputs: list[str] = []  # names of outputs the client means to fetch (may be empty)
    # True: the SDK re-sends a plan it was told was accepted and the coordinator no longer knows
    # (a store loss), with the same id and spec (docs/SEMANTICS.md §Recovery from clients and workers).
    recovered: bool = False
    resources: Resources | None = None  # devices the plan holds while it runs (None: none)
    after: list[str] = []  # plans that must succeed before this one is placed (docs/PROTOCOL.md §Plan graphs)
    # Running it again gives the same outputs: a lost output it made may be rebuilt by running it again (issue #28).
    deterministic: bool = True
    preemptible: bool = False  # it may be stopped and requeued for another team's plan (docs/SEMANTICS.md §Preemption)
    traceparent: str = ""  # the caller's W3C trace context: the plan's spans join that trace ("": none)
    # Carbon time shifting (docs/SEMANTICS.md §Deadlines): the plan may finish any time within ``deadline_s`` seconds
    # of its submit (or by ``deadline_at``, Unix seconds; one of the two), so the coordinator may hold it for a
    # greener hour. ``expected_run_s``: how long it runs (None: its op's observed median). None: placed at once.
    deadline_s: float | None = None
    deadline_at: float | None = None
    expected_run_s: float | None = None
    # Copies wanted of outputs, by name, the producer's own included (2: one more on another worker), made
    # before the plan is reported succeeded (docs/PROTOCOL.md §Plan graphs, *Replicas*). {}: one copy each.
    replicas: dict[str, int] = {}


class Subscribe(_Msg, tag="subscribe"):
    """Stream events of these plans (or of all mine), replaying from ``from_seq``."""

    req_id: ReqId = 0
    plan_ids: list[str] = []
    all: bool = False
    from_seq: int = 0


class Unsubscribe(_Msg, tag="unsubscribe"):
    """Stop streaming events of these plans (empty with ``all``: everything)."""

    req_id: ReqId = 0
    plan_ids: list[str] = []
    all: bool = False


class GetPlan(_Msg, tag="get_plan"):
    """Ask for a plan's current record."""

    req_id: ReqId
    plan_id: str


class DataTicket(_Msg, tag="data_ticket"):
    """Ask for a ticket to a plan's bytes on its worker: ``get`` its outputs, or ``put`` its inputs again."""

    req_id: ReqId
    plan_id: str
    direction: Literal["put", "get"] = "get"
    # A ``get`` for one output of a succeeded plan, which follows its lineage (docs/SEMANTICS.md §Graphs): the
    # grant may name a rebuild of the plan, or say one is under way (``data_grant.rebuilding``). "": any output.
    output: str = ""
    # The plan id of the grant this client could not fetch ``output`` with (its holder answered 404, or is gone):
    # the coordinator takes that copy as lost. "": none failed.
    lost: str = ""


class ListWorkers(_Msg, tag="list_workers"):
    """Ask for the registry and the cluster summary."""

    req_id: ReqId


class ListPlans(_Msg, tag="list_plans"):
    """Ask for the plans this session may see (newest first) and the queue in placement order."""

    req_id: ReqId
    states: list[PlanStateName] = []  # only plans in these states; empty: every state
    limit: int = 200  # at most this many plans (and queue entries) in the answer
    cursor: str = ""  # a previous answer's ``next_cursor``: the page after it ("": the newest)
    op: str = ""  # only plans of this op ("": any)
    owner: str = ""  # only plans of this principal ("": any the session may see; a client: itself only)
    id_contains: str = ""  # only plans whose id contains this text, case-sensitive ("": any)


class DrainWorker(_Msg, tag="drain_worker"):
    """Stop placing plans on a worker; its running plans get ``deadline_s`` to finish, then are requeued."""

    req_id: ReqId
    worker_id: str
    deadline_s: float | None = None  # None: running plans may finish whenever they finish


class UndrainWorker(_Msg, tag="undrain_worker"):
    """Place plans on a drained worker again."""

    req_id: ReqId
    worker_id: str


class ReleaseDevice(_Msg, tag="release_device"):
    """Put a quarantined device back in service (admin; docs/OPERATIONS.md §GPU health).

    Client -> coordinator: ``worker_id`` and ``device`` (its position in ``capabilities.gpus``);
    answered ``ok`` once passed on, ``error`` for an unknown or disconnected worker or device.
    Coordinator -> worker: the same message; the worker clears the device's quarantine, takes its
    counters as the new baseline, and reports its health in its next load (sent at once).
    """

    req_id: ReqId
    worker_id: str
    device: int


class ReleasePlan(_Msg, tag="release_plan"):
    """Run a plan held for a greener hour now (``fleetwire release``; its owner or an admin).

    Answered ``plan`` with its record (``queued`` with no carbon reason once released; a plan that
    was not held is left as it is), or ``error(plan_not_found)``.
    """

    req_id: ReqId
    plan_id: str


class RemoveWorker(_Msg, tag="remove_worker"):
    """Remove a worker for good, at once: its unfinished plans are requeued, its session closed 4410."""

    req_id: ReqId
    worker_id: str


# ---- coordinator -> client


class Accepted(_Msg, tag="accepted"):
    """The plan is recorded; ``state`` is its state right now."""

    req_id: int
    plan_id: str
    state: PlanStateName = "queued"
    duplicate: bool = False


class Subscribed(_Msg, tag="subscribed"):
    """The subscription is in place; replayed events follow.

    ``last_seqs``: each plan named in the ``subscribe`` and its last seq as the subscription starts
    (the replay ends there, live events follow). Below the subscriber's ``from_seq``, this
    coordinator's stream is behind what it saw (a store loss): the next events are numbered from
    that seq + 1 and are new ones, not replays (docs/SEMANTICS.md §Recovery from clients and workers).
    """

    req_id: int
    plan_ids: list[str] = []
    last_seqs: dict[str, int] = {}


class PlanReply(_Msg, tag="plan"):
    """Answer to ``get_plan`` and ``cancel``."""

    req_id: int
    plan: PlanInfo


class Workers(_Msg, tag="workers"):
    """Answer to ``list_workers``."""

    req_id: int
    workers: list[WorkerInfo] = []
    summary: str = ""
    version: str = ""  # the coordinator's version ("": not said)


class Plans(_Msg, tag="plans"):
    """Answer to ``list_plans``."""

    req_id: int
    plans: list[PlanInfo] = []  # newest first, at most ``limit``
    queue: list[str] = []  # queued plan ids in placement order (priority, then age), at most ``limit``
    counts: dict[str, int] = {}  # visible plans per state, over all of them (not only those listed)
    total: int = 0  # visible plans matching ``states`` (and ``op``, ``owner``, ``id_contains``), before ``limit``
    next_cursor: str = ""  # more plans match after this page: ask again with ``cursor`` set to it
    waiting: dict[str, str] = {}  # plan id in ``queue`` -> why it waits (its waiting reason, cut as in rows)


class Resync(_Msg, tag="resync"):
    """Events ``first_seq``..``last_seq`` of a plan cannot be replayed: the coordinator no longer holds them.

    Sent in a replay (after ``subscribed`` or a duplicate ``accepted``) in place of the missing
    events, so a subscriber never sees a silent gap; ``plan`` is the plan's record now.
    """

    plan_id: str
    first_seq: int = 0
    last_seq: int = 0
    plan: PlanInfo | None = None
    recovered: bool = False  # False: the events are gone for good
    req_id: int = 0


class DataGrant(_Msg, tag="data_grant"):
    """Answer to ``data_ticket``: where the plan's bytes are and the ticket to present there.

    The ``data_ready`` event of a plan carries the same fields (without ``req_id``).
    """

    req_id: int
    plan_id: str
    attempt: int
    worker_id: str
    url: str  # the worker's data endpoint ("" when it has none: the relay's case)
    ticket: str
    direction: Literal["put", "get"] = "get"
    expires_at: float = 0.0  # Unix seconds
    files: dict[str, list[Any]] = {}  # name -> [size, digest] the ticket covers (-1: size not known)
    # The plan's key on the worker (the data endpoint's URL path, the ticket's plan), when it is not ``plan_id``:
    # its owner's id was another principal's when it came (docs/SEMANTICS.md §Plan ids). "": ``plan_id``.
    key: str = ""
    # The plan making ``data_ticket.output`` again, when its copies were lost (docs/SEMANTICS.md §Graphs): the ticket
    # is empty; ask again once that plan ended. "": none (the grant is to the plan that holds it).
    rebuilding: str = ""


class Moved(_Msg, tag="moved"):
    """Cluster mode: this coordinator does not own the shard the session is for; reconnect to ``url``.

    Sent to a worker whose ``hello`` names a pool of another shard, to a client whose ``submit``
    belongs to another shard, and by a coordinator's front port to every session that names its
    pool in the URL (``?pool=NAME``); the coordinator then closes the session with ``4307``.
    ``url`` is the owner's websocket URL for that shard ("" while nobody owns it: retry the
    list of coordinators), ``epoch`` its lease epoch (a larger one is newer), ``shard`` the slot.
    """

    url: str
    epoch: int = 0
    shard: int = 0


# ---- relay: a plan's bytes through the coordinator (docs/PROTOCOL.md §11 Relay)
# ``data_open`` goes client -> coordinator -> worker; ``data_chunk``, ``data_credit`` and ``data_end``
# travel both ways, each naming its stream by (plan_id, attempt, name, direction), and by ``stream``,
# the id its client gave it in ``data_open`` (0: none), echoed in every message of that stream.


class DataOpen(_Msg, tag="data_open"):
    """Open a relayed stream of one input (``put``) or output (``get``) of a plan attempt.

    The client sends it with the grant's ticket; the coordinator checks it against the plan and
    passes it on to the plan's worker with ``credit`` set (the stream's window in bytes). A worker
    sends a ``get`` with a pull's ticket when it cannot dial the holder (a relayed pull: it is then
    the stream's client; docs/PROTOCOL.md §Plan graphs).
    """

    plan_id: str
    attempt: int
    name: str
    direction: Literal["put", "get"] = "put"
    ticket: str = ""
    offset: int = 0  # get: the first byte wanted (a resumed download)
    credit: int = 0  # coordinator -> worker: unacknowledged bytes the sender may have in flight
    stream: int = 0  # the client's id for this stream (a new one per open); echoed in all of its messages
    pull: bool = False  # get: a worker fetching the output as another plan's input (kept its whole retention)


class DataChunk(_Msg, tag="data_chunk"):
    """Bytes of a relayed stream: ``data`` starts at ``offset`` (at most 256 KiB; msgpack bin, JSON base64)."""

    plan_id: str
    attempt: int
    name: str
    offset: int
    data: bytes = b""
    direction: Literal["put", "get"] = "put"
    last: bool = False  # the stream's final byte is in this chunk
    size: int = -1  # get: the output's size in bytes
    stream: int = 0  # the stream's id (data_open.stream); a message of an older stream is dropped


class DataCredit(_Msg, tag="data_credit"):
    """From the receiver of a relayed stream: it holds ``offset`` bytes; the sender may send up to
    ``offset + credit`` (the first one from a worker answers a ``put``'s ``data_open``)."""

    plan_id: str
    attempt: int
    name: str
    offset: int
    direction: Literal["put", "get"] = "put"
    credit: int = 0
    size: int = -1  # put: the input's declared size
    stream: int = 0  # the stream's id (data_open.stream)
    wait: str = ""  # coordinator -> client: the stream waits in line for relay room, and why (credit 0 until then)


class DataEnd(_Msg, tag="data_end"):
    """A relayed stream ended: ``code`` "" when it completed (a ``put``: the input arrived whole and
    verified), else why it stopped (docs/PROTOCOL.md §11 Relay lists the codes)."""

    plan_id: str
    attempt: int
    name: str
    direction: Literal["put", "get"] = "put"
    code: str = ""
    message: str = ""
    offset: int = 0  # bytes the receiver holds
    stream: int = 0  # the stream's id (data_open.stream)


class Ok(_Msg, tag="ok"):
    """A request that needs no data in its answer succeeded."""

    req_id: int


# --------------------------------------------------------------------------- shared fleets (issue #27)
# docs/PROTOCOL.md §Shared fleets: ``preempt`` goes to workers, ``get_usage``/``usage`` are a client's request
# and its answer.


class Preempt(_Msg, tag="preempt"):
    """Coordinator -> worker: stop this attempt so another plan can run. The handler is told (Python:
    ``ctx.preempted``; child processes: SIGTERM) and has ``grace_s`` to checkpoint and end, then it is
    stopped; the attempt ends with its ``done`` as usual and the plan is requeued without charging an attempt."""

    plan_id: str
    attempt: int
    grace_s: float = 30.0
    reason: str = ""  # who waits and why it may go first, for the plan's ``preempted`` event


class UsageTotals(msgspec.Struct, omit_defaults=True):
    """One principal's or team's usage in a ``usage`` answer (coordinator/ledger.py)."""

    name: str
    team: str = ""  # by principal: the team it was in ("" by team)
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    slot_seconds: float = 0.0
    gpu_seconds: float = 0.0
    tokens: int = 0
    joules: float = 0.0
    co2e_g: float = 0.0
    preemptions: int = 0
    avoided_co2e_g: float = 0.0  # held plans' receipts' ``avoided_co2e_g`` (docs/ROUTING.md §Carbon in time)


class GetUsage(_Msg, tag="get_usage"):
    """Client -> coordinator: usage totals by principal or team (an admin: everyone's; a client: its own)."""

    req_id: ReqId
    by: Literal["principal", "team"] = "principal"
    since: float = 0.0  # Unix seconds: only usage from the hour that holds it on (0: all time)


class Usage(_Msg, tag="usage"):
    """Coordinator -> client: the answer to ``get_usage``."""

    req_id: int
    by: Literal["principal", "team"] = "principal"
    since: float = 0.0
    rows: list[UsageTotals] = []


# --------------------------------------------------------------------------- unions

FromWorker = Union[Hello, Heartbeat, Accept, Reject, Event, Done, Goodbye, DataChunk, DataCredit, DataEnd, DataOpen]
ToWorker = Union[
    Welcome, Assign, Cancel, Revoke, Preempt, Ack, Drain, Undrain, Error, DataKeys, Moved, DataOpen, DataChunk,
    DataCredit,
    DataEnd, ReleaseDevice,
]
FromClient = Union[
    Submit, Subscribe, Unsubscribe, Cancel, GetPlan, GetUsage, ListWorkers, ListPlans, DrainWorker, UndrainWorker,
    DataTicket,
    DataOpen, DataChunk, DataCredit, DataEnd, RemoveWorker, ReleaseDevice, ReleasePlan,
]
ToClient = Union[
    Accepted, Subscribed, Event, PlanReply, Workers, Plans, Usage, Resync, Ok, Error, DataGrant, Moved, DataChunk,
    DataCredit, DataEnd,
]

AnyMessage = Union[
    Hello, Heartbeat, Accept, Reject, Done, Goodbye, Event, Cancel, Error, Welcome, Assign,
    Revoke, Ack, Drain, Undrain, Submit, Subscribe, Unsubscribe, GetPlan, ListWorkers, ListPlans,
    DrainWorker, UndrainWorker, Accepted, Subscribed, PlanReply, Workers, Plans, Resync, Ok,
    DataKeys, DataTicket, DataGrant, Moved, DataOpen, DataChunk, DataCredit, DataEnd, RemoveWorker,
    Preempt, GetUsage, Usage, ReleaseDevice, ReleasePlan,
]

ALL_MESSAGE_TYPES: tuple[type[_Msg], ...] = (
    Hello, Heartbeat, Accept, Reject, Done, Goodbye, Event, Cancel, Error, Welcome, Assign,
    Revoke, Ack, Drain, Undrain, Submit, Subscribe, Unsubscribe, GetPlan, ListWorkers, ListPlans,
    DrainWorker, UndrainWorker, Accepted, Subscribed, PlanReply, Workers, Plans, Resync, Ok,
    DataKeys, DataTicket, DataGrant, Moved, DataOpen, DataChunk, DataCredit, DataEnd, RemoveWorker,
    Preempt, GetUsage, Usage, ReleaseDevice, ReleasePlan,
)


def type_name(cls: type[_Msg]) -> str:
    """The wire ``type`` tag of a message class."""
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


def type_names(union: Any) -> frozenset[str]:
    """The wire tags of every message in a union."""
    return frozenset(type_name(cls) for cls in union.__args__)
