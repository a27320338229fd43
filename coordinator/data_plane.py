"""The coordinator's part of the data plane: ticket keys, tickets, where a plan's bytes are (docs/PROTOCOL.md).

What it owns: the master keys that sign data-plane tickets (current and previous, each with a
key id), their rotation, and the grants (worker data address + signed ticket) handed to clients.
Plans' bytes never pass through here: a client uploads inputs to, and downloads outputs from,
the worker's data endpoint directly, presenting the ticket (protocol/tickets.py).

Rules:

* The core draws no random numbers and reads no clock: the driver supplies each new master key
  (:meth:`DataPlane.rotate`, when :meth:`DataPlane.rotation_due`) and the offset from ``now``
  (monotonic) to Unix time (:attr:`DataPlane.wall_offset`), which ticket expiries are written in.
* A worker gets its keys (:func:`protocol.tickets.worker_key` of each master, never a master) in
  ``welcome`` and, after a rotation, in ``data_keys``. A new master is *published* before it *signs*: it is
  accepted (sent) at once, but the one before it signs for :func:`publish_s` more (the reconnect grace and a
  tick): the ``data_keys`` that tells a holder of it goes on the holder's connection while a consumer's worker
  fetches from the holder's data endpoint, so nothing orders the two, and a holder whose session closed is told
  only in its next ``welcome`` (or is reaped by then). A first master signs at once (nothing older).
* A master that stopped signing keeps verifying as long as tickets it signed can live (``ticket_ttl_s`` from
  when the next one began to sign), so a rotation shorter than the tickets' life never cuts one short; it is
  dropped at the first rotation after that.
* At most :data:`MAX_KEPT_KEYS` masters are kept (the signing one included), and as many shared keys:
  ``data_keys`` stays small whatever the flags. A rotation so short that more would be needed
  (``ticket_ttl_s`` plus the publish delay and overlap above ``rotation_s`` x (:data:`MAX_KEPT_KEYS` - 1)) is
  refused at start (:func:`key_rotation_problem`, docs/OPERATIONS.md §Data plane).
* When a plan with inputs or outputs is leased, its stream gets a ``data_ready`` event (per
  attempt): the worker's ``url``, a ``put`` ticket for the inputs (sizes, digests) and
  a ``get`` ticket for the declared outputs, with their expiry. A client asks ``data_ticket``
  for a fresh one (an expired ticket, or outputs after the plan ended).
* No keys yet (a driver that never rotated): no tickets; ``data_ticket`` is refused.
* Tickets and the worker's URL name the plan by its key (coordinator/plans.py): a grant to a
  session that knows the plan by another id (its owner's name, docs/SEMANTICS.md §Plan ids)
  names it by that id and adds the key (``data_grant.key``, ``data_ready``'s ``key``).

Depends on the registry (where a worker's data address is) and the outbox (``data_keys``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from protocol import errors
from protocol.messages import COPY_OP, DataGrant, DataKey, DataKeys, Error, InputSpec, Submit
from protocol.tickets import FileClaim, TicketClaims, digest_problem, name_problem, sign, worker_key

if TYPE_CHECKING:
    from coordinator.effects import Outbox
    from coordinator.graphs import Source
    from coordinator.plans import Plan
    from coordinator.registry import WorkerRegistry
    from coordinator.streams import Streams

__all__ = [
    "MAX_KEPT_KEYS", "MAX_REPLICAS", "DataPlane", "data_problem", "key_rotation_problem", "publish_s", "ref_problem",
]

MAX_REPLICAS = 3  # copies of an output a submit may ask for (``submit.replicas``), the producer's own included

MAX_DATA_NAMES = 1024  # inputs and outputs of one plan, each

MAX_KEPT_KEYS = 8  # ticket keys kept at once, the signing one included (each kind: a core's own, the cluster's shared)


PUBLISH_MARGIN_S = 1.0  # past the reconnect grace before a new master signs: a reaper tick, a frame in flight


def publish_s(reconnect_grace_s: float | None) -> float:
    """How long a core's new master is accepted before it signs: every connected worker has read its ``data_keys``
    by then, and one whose session closed before has either registered again (its ``welcome`` has it) or, its
    reconnect grace over, been reaped (its outputs are lost, not refused)."""
    return (reconnect_grace_s or 0.0) + PUBLISH_MARGIN_S


def key_rotation_problem(ticket_ttl_s: float, rotation_s: float, overlap_s: float = 0.0) -> str | None:
    """Why ``--data-key-rotation`` cannot go with ``--data-ticket-ttl`` (too many keys to keep), or None.

    ``overlap_s``: how long past the tickets' life a key stays accepted after the next one is made (a core's own:
    :func:`publish_s`; a cluster's shared key: its publish delay and the rounds of overlap, shared_keys.py;
    the larger). A key made every ``rotation_s`` then needs ceil((TTL + overlap) / rotation) kept besides the
    newest, at most ``MAX_KEPT_KEYS - 1``.
    """
    needed_s = ticket_ttl_s + overlap_s
    if rotation_s <= 0 or needed_s <= rotation_s * (MAX_KEPT_KEYS - 1):
        return None
    why = "the TTL" if not overlap_s else f"the TTL, plus {overlap_s:g} s while the next one is published and overlaps"
    least = f"{needed_s / (MAX_KEPT_KEYS - 1):g} s ((TTL + {overlap_s:g}) / {MAX_KEPT_KEYS - 1})" if overlap_s else (
        f"{needed_s / (MAX_KEPT_KEYS - 1):g} s (TTL / {MAX_KEPT_KEYS - 1})")
    return (f"--data-key-rotation {rotation_s:g} is too short for --data-ticket-ttl {ticket_ttl_s:g}: a key stays "
            f"accepted as long as the tickets it signed ({why}), and at most {MAX_KEPT_KEYS} keys are kept; give "
            f"a rotation of at least {least} or a shorter TTL")


def data_problem(msg: Submit) -> str | None:
    """Why a submit's ``inputs``/``outputs``/``replicas`` are invalid (naming the field), or None."""
    if msg.op == COPY_OP:
        return f"op {COPY_OP!r} is the coordinator's own (the copies of replicated outputs); a client cannot submit it"
    if len(msg.inputs) > MAX_DATA_NAMES or len(msg.outputs) > MAX_DATA_NAMES:
        return f"a plan has at most {MAX_DATA_NAMES} inputs and {MAX_DATA_NAMES} outputs"
    seen: set[str] = set()
    for index, spec in enumerate(msg.inputs):
        field = f"inputs[{index}].name"
        problem = name_problem(spec.name, field)
        if problem is None and spec.name in seen:
            problem = f"{field} {spec.name!r} is given twice"
        if problem is None and spec.ref is not None:
            problem = ref_problem(spec, index)
        elif problem is None and spec.size < 0:
            problem = (f"inputs[{index}].size is required for an uploaded input (bytes, >= 0)" if spec.size == -1
                       else f"inputs[{index}].size must be >= 0 (got {spec.size})")
        elif problem is None and not spec.digest:
            problem = f"inputs[{index}].digest is required for an uploaded input (e.g. blake3:<64 hex>)"
        elif problem is None:
            problem = digest_problem(spec.digest, f"inputs[{index}].digest")
        if problem is not None:
            return problem
        seen.add(spec.name)
    outputs: set[str] = set()
    for index, name in enumerate(msg.outputs):
        problem = name_problem(name, f"outputs[{index}]")
        if problem is None and name in outputs:
            problem = f"outputs[{index}] {name!r} is given twice"
        if problem is not None:
            return problem
        outputs.add(name)
    for name, copies in msg.replicas.items():
        if name not in outputs:
            return f"replicas names {name!r}, which is not one of the plan's outputs"
        if not isinstance(copies, int) or not 1 <= copies <= MAX_REPLICAS:
            return (f"replicas[{name!r}] must be 1 to {MAX_REPLICAS} (the copies of the output, its producer's own "
                    f"included; got {copies!r})")
    return None


def ref_problem(spec: InputSpec, index: int) -> str | None:
    """Why an input in the reference form (``ref`` set) is invalid, naming the field, or None."""
    ref = spec.ref
    assert ref is not None
    if spec.size != -1 or spec.digest:
        return f"inputs[{index}] names another plan's output (ref): leave its size and digest out"
    if not ref.plan_id:
        return f"inputs[{index}].ref.plan_id must be a non-empty plan id"
    return name_problem(ref.name, f"inputs[{index}].ref.name")


class DataPlane:
    """Ticket keys and grants.

    Args:
        registry: the workers (a plan's worker's data address).
        outbox: where ``data_keys`` and ``data_ticket`` answers go.
        streams: its ``now`` (the input being handled) is when a ``data_ready`` ticket is issued.
        ticket_ttl_s: how long a ticket is valid.
        rotation_s: how often the driver should rotate the master key (0: never after the first).
    """

    def __init__(
        self, *, registry: WorkerRegistry, outbox: Outbox, streams: Streams, ticket_ttl_s: float, rotation_s: float
    ) -> None:
        self._registry = registry
        self._outbox = outbox
        self._streams = streams
        self.ticket_ttl_s = ticket_ttl_s
        self.rotation_s = rotation_s
        self.wall_offset = 0.0
        """Unix time minus the core's ``now`` (the driver sets it; tickets' expiries are Unix time)."""
        self._masters: list[tuple[str, bytes]] = []  # newest first: those still accepted
        self._signs_from: list[float] = []  # when each of ``_masters`` signs from (core time): published by then
        self.shared: tuple[str, bytes] | None = None
        """Cluster mode: the key every shard's core shares (kid, secret; the driver sets it before any worker comes):
        it signs a worker's pull of another shard's output (coordinator/graphs/remote.py); workers verify with it."""
        self._shared_kept: list[tuple[str, bytes]] = []  # the shared keys still accepted, the signing one first
        self.tickets_issued = 0
        """Tickets signed so far (``data_ready`` and ``data_ticket``; the metric ``fleetwire_data_tickets_issued``)."""
        self._rotated_at: float | None = None

    # ------------------------------------------------------------------ keys

    def rotation_due(self, now: float) -> bool:
        """Whether the driver should call :meth:`rotate` now (no key yet, or the current one is old)."""
        if self._rotated_at is None:
            return True
        return self.rotation_s > 0 and now - self._rotated_at >= self.rotation_s

    def rotate(self, kid: str, secret: bytes, now: float) -> None:
        """Publish ``secret`` (named ``kid``): the workers are told at once, and it signs from :func:`publish_s`
        on (at once when it is the first); each older key stays to verify while tickets it signed may live (at most
        :data:`MAX_KEPT_KEYS` in all)."""
        if not kid or "." in kid or len(secret) < 16:
            raise ValueError("a data-plane key needs a non-empty kid without '.' and at least 16 bytes")
        starts = now + publish_s(self._registry.reconnect_grace_s) if self._masters else now
        # A key stops signing when the one after it starts; tickets it signed live ``ticket_ttl_s`` past that.
        stops = [starts, *self._signs_from]
        kept = [index for index, stop in enumerate(stops[:-1]) if now < stop + self.ticket_ttl_s]
        kept = kept[: MAX_KEPT_KEYS - 1]
        self._masters = [(kid, secret), *(self._masters[index] for index in kept)]
        self._signs_from = [starts, *(self._signs_from[index] for index in kept)]
        self._rotated_at = now
        send = self._outbox.send
        for record in self._registry:
            if record.conn_id is not None:
                send(record.conn_id, DataKeys(keys=self.worker_keys(record.id)))

    def _signer(self, now: float) -> tuple[str, bytes]:
        """The master that signs at ``now``: the newest one published, else the oldest kept (nothing older)."""
        for key, starts in zip(self._masters, self._signs_from, strict=True):
            if starts <= now:
                return key
        return self._masters[-1]

    def set_shared(self, keys: list[tuple[str, bytes]]) -> None:
        """Cluster mode: the shared keys still accepted, the one that signs first (coordinator/io/cluster/
        shared_keys.py); the workers are told when they changed (a rotation, or an old one dropped)."""
        if keys == self._shared_kept:
            return
        self._shared_kept = list(keys)
        self.shared = keys[0] if keys else None
        send = self._outbox.send
        for record in self._registry:
            if record.conn_id is not None:
                send(record.conn_id, DataKeys(keys=self.worker_keys(record.id)))

    def worker_keys(self, worker_id: str) -> list[DataKey]:
        """The keys worker ``worker_id`` verifies tickets with, current first (then the cluster's shared ones)."""
        keys = [DataKey(kid=kid, key=worker_key(secret, worker_id)) for kid, secret in self._masters]
        shared = self._shared_kept or ([self.shared] if self.shared is not None else [])
        keys.extend(DataKey(kid=kid, key=worker_key(secret, worker_id)) for kid, secret in shared)
        return keys

    # ------------------------------------------------------------------ grants

    def ready_event(self, plan: Plan) -> dict[str, Any]:
        """The data of a leased plan's ``data_ready`` event: url, ``put`` and ``get`` tickets, expiry."""
        now = self._streams.now
        put = self.grant(plan, "put", now)
        get = self.grant(plan, "get", now)
        data: dict[str, Any] = {"attempt": plan.attempt, "worker_id": plan.worker_id}
        if plan.name is not None and (put is not None or get is not None):  # its owner knows it by its name
            data["key"] = plan.id
        if put is not None:
            data.update(url=put.url, ticket=put.ticket, expires_at=put.expires_at, files=put.files)
        if get is not None:
            data.update(url=get.url, get_ticket=get.ticket, expires_at=get.expires_at)
        return data

    def grant(
        self, plan: Plan, direction: Literal["put", "get"], now: float, req_id: int = 0, shown: str | None = None
    ) -> DataGrant | None:
        """A ticket to the plan's bytes on its current (or last) worker; None without keys or a worker.

        ``shown``: the id the session knows the plan by (None: its key); the grant adds the key when they differ.
        """
        worker_id = plan.worker_id
        if not self._masters or worker_id is None:
            return None
        kid, secret = self._signer(now)
        files: dict[str, FileClaim]
        if direction == "put":  # an input in the reference form is not uploaded: its worker fetches it (pull_ticket)
            files = {spec.name: FileClaim(spec.size, spec.digest) for spec in plan.inputs if spec.ref is None}
        else:
            files = {name: FileClaim() for name in plan.outputs}
            files.update((spec.name, FileClaim(spec.size, spec.digest)) for spec in plan.produced)
        expires_at = now + self.wall_offset + self.ticket_ttl_s
        claims = TicketClaims(plan.id, plan.attempt, worker_id, direction, files, expires_at)
        url = self._registry.get(worker_id).data_url if worker_id in self._registry else ""
        self.tickets_issued += 1
        key = plan.id
        return DataGrant(
            req_id=req_id, plan_id=key if shown is None else shown, attempt=plan.attempt, worker_id=worker_id,
            url=url, ticket=sign(claims, kid, worker_key(secret, worker_id)), direction=direction,
            expires_at=expires_at, files={name: [claim.size, claim.digest] for name, claim in files.items()},
            key="" if shown is None or shown == key else key,
        )

    def pull_ticket(self, source: Source, now: float, *, shared: bool = False) -> str:
        """A ``get`` ticket to one output on the worker that holds it, for another worker that fetches it as an
        input (``assign.pulls``, docs/PROTOCOL.md §Plan graphs); "" without keys. ``shared``: signed with the
        cluster's shared key (a holder served by another shard's core)."""
        if shared and self.shared is not None:
            kid, secret = self.shared
        elif not self._masters:
            return ""
        else:
            kid, secret = self._signer(now)
        claims = TicketClaims(source.plan_id, source.attempt, source.worker_id, "get",
                              {source.name: FileClaim(source.size, source.digest)},
                              now + self.wall_offset + self.ticket_ttl_s)
        self.tickets_issued += 1
        return sign(claims, kid, worker_key(secret, source.worker_id))

    def answer(
        self, conn_id: int, plan: Plan, direction: Literal["put", "get"], req_id: int, now: float,
        shown: str | None = None,
    ) -> None:
        """Answer a ``data_ticket`` for a plan the session may see (``shown``: the id it named the plan by)."""
        problem = None
        plan_id = plan.id if shown is None else shown
        if direction == "put" and not plan.inputs:
            problem = f"plan {plan_id!r} has no inputs"
        elif direction == "put" and plan.terminal:
            problem = f"plan {plan_id!r} already ended {plan.state}; it takes no inputs"
        elif plan.worker_id is None:
            problem = f"plan {plan_id!r} has not been placed on a worker yet; wait for its data_ready event"
        grant = None if problem else self.grant(plan, direction, now, req_id, shown)
        if grant is None:
            problem = problem or "this coordinator has no data-plane key yet; try again shortly"
            self._outbox.send(
                conn_id, Error(code=errors.INVALID_ARGUMENT, message=problem, req_id=req_id, plan_id=plan_id)
            )
            return
        self._outbox.send(conn_id, grant)

