"""fleetwire: a control plane for fleets of GPU and CPU hosts. This package is the client SDK.

::

    from fleetwire import Client

    async with Client("ws://127.0.0.1:8765", token=token) as client:
        plan = await client.submit("echo", args={"x": 1})
        print(await plan.result())

``SyncClient`` offers the same verbs without ``await`` (scripts, notebooks). The wire
records the SDK returns (``Event``, ``PlanInfo``, ``Workers``, ...) are the protocol's
own Structs, re-exported here.
"""

from typing import TYPE_CHECKING

from fleetwire.client import Client
from fleetwire.errors import (
    AuthError,
    FleetwireConnectionError,
    FleetwireError,
    InvalidArgument,
    PlanCancelled,
    PlanError,
    PlanFailed,
    PlanNotFound,
    ProtocolError,
    RequestError,
)
from fleetwire.plan import Plan
from fleetwire.sync import SyncClient, SyncPlan
from protocol.messages import ErrorInfo, Event, OutputRef, PlanInfo, Requirements, WorkerInfo, Workers

if TYPE_CHECKING:
    __version__: str


def __getattr__(name: str) -> str:
    """``__version__``, looked up on first use (a search of the installed distributions: not every import's cost)."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        value = version("fleetwire")
    except PackageNotFoundError:  # running from a source tree that was never installed
        value = "0.0.0"
    globals()["__version__"] = value
    return value


__all__ = [
    "AuthError",
    "Client",
    "ErrorInfo",
    "Event",
    "FleetwireConnectionError",
    "FleetwireError",
    "InvalidArgument",
    "OutputRef",
    "Plan",
    "PlanCancelled",
    "PlanError",
    "PlanFailed",
    "PlanInfo",
    "PlanNotFound",
    "ProtocolError",
    "RequestError",
    "Requirements",
    "SyncClient",
    "SyncPlan",
    "WorkerInfo",
    "Workers",
    "__version__",
]
