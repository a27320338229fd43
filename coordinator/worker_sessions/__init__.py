"""The worker session of the core (docs/SEMANTICS.md §Worker session): hello to goodbye, and the reaper.

One concern per module; :class:`WorkerSessions` (dispatch.py) builds the three others and hands
each message to its owner::

    dispatch.py      WorkerSessions  the ``match`` over a worker's messages; what the core calls
    registration.py  Registration    hello (identity, takeover, register, continued leases, welcome),
                                     goodbye, removal; Identities: what outlives a worker's sessions
    leases.py        Leases          accept, reject, event, done: a lease's traffic
    liveness.py      Liveness        heartbeat, detach, the reaper
"""

from coordinator.worker_sessions.dispatch import WorkerSessions
from coordinator.worker_sessions.registration import WorkerSessionConfig

__all__ = ["WorkerSessionConfig", "WorkerSessions"]
