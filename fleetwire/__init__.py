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

import importlib
from typing import TYPE_CHECKING, Any

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
from protocol.messages import ErrorInfo, Event, OutputRef, PlanInfo, Requirements, WorkerInfo, Workers

if TYPE_CHECKING:
    from fleetwire.client import Client
    from fleetwire.plan import Plan
    from fleetwire.sync import SyncClient, SyncPlan

    __version__: str

# The client and its plans are imported on first use: the coordinator and the worker daemon are
# started through ``fleetwire.cli`` (this package) and never dial as a client (~15 ms of their start).
_LAZY = {"Client": "fleetwire.client", "Plan": "fleetwire.plan", "SyncClient": "fleetwire.sync",
         "SyncPlan": "fleetwire.sync"}  # fmt: skip


def __getattr__(name: str) -> Any:
    """The SDK's classes and ``__version__`` (a search of the installed distributions), on first use."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        value = version("fleetwire")
    except PackageNotFoundError:  # running from a source tree that was never installed
        value = "0.0.0"
    globals()["__version__"] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, "__version__"})


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
