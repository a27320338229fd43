"""How a worker agent is configured: :class:`AgentSettings`, checked once when it is built.

``Agent(url, token, settings=AgentSettings(...))`` takes them whole; ``Agent(url, token, tags=[...])``
takes the same fields as keyword arguments (:class:`AgentOptions`) and builds the settings from them.
The URL and token stay separate: they say where to connect and as whom, not how to behave.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import protocol
from protocol import ENCODING_SUBPROTOCOL, Encoding
from worker_agent.devices import parse_gpus
from worker_agent.isolation import PlanIsolation

__all__ = ["ON_QUARANTINE", "AgentOptions", "AgentSettings"]

#: What ``on_quarantine`` may say: the plans on a quarantined device finish, or are requeued (§GPU health).
ON_QUARANTINE = ("finish", "requeue")


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentSettings:
    """A worker agent's configuration.

    Args:
        worker_id: this worker's id; None: ``<hostname>-<pid>``.
        tags: labels plans can require.
        max_concurrency: plans run at once; assigns beyond it (and beyond the prefetch the
            coordinator allows) are rejected with ``rejected``.
        allow_shell: offer the ``shell`` op (runs arbitrary commands, as the worker's user or
            ``plan_user``).
        python_allow: fnmatch patterns of ``module:function`` the ``python`` op may call (the
            plain function a target resolves to must match too: worker_agent/pychild.py);
            empty: no ``python`` op.
        plan_env: more of the worker's environment variables plans' processes get (names or
            fnmatch patterns) besides worker_agent/isolation.py ``PLAN_ENV``; never ``FLEETWIRE_*``.
        plan_user: the Unix user (name or uid) plans' processes run as; the worker must run as
            root. None: the worker's own user.
        python_envs: interpreters to advertise besides this one.
        models: models this host serves (plans may require one).
        accelerator: the accelerator class to advertise instead of the probed one.
        carbon_zone: the grid zone of this host, e.g. ``FR`` or ``US-CAL-CISO``.
        kv_blocks, kv_block_tokens: the KV-cache budget, for KV-block admission.
        encoding: ``"msgpack"`` or ``"json"``, offered as the websocket subprotocol.
        reconnect_base_s, reconnect_cap_s: the backoff's first ceiling and its cap.
        kill_grace_s: seconds between SIGTERM and SIGKILL for a cancelled plan's subprocesses.
        drain_timeout_s: how long ``stop()`` lets running plans finish before handing them back.
        handshake_timeout_s: how long the websocket upgrade may take, and how long to wait for
            ``welcome`` after ``hello`` (``--handshake-timeout``); past it the session is closed, logged
            with the URL and this timeout, and the agent reconnects as its backoff says.
        reconnect_dial_timeout_s: in cluster mode (several URLs, or after a ``moved``), how long a
            reconnect's upgrade to one URL may take, and then its wait for ``welcome`` (each at most
            ``handshake_timeout_s``): a frozen coordinator accepts the TCP connection and answers
            nothing, a stuck one upgrades and answers nothing; either way the URL goes to the back of
            the turn (worker_agent/handshake.py). The first dial keeps ``handshake_timeout_s``.
        max_frame_bytes: frames are split to stay under this; must not exceed the
            coordinator's limit. Event data and results are limited to it less 4 KiB.
        outbox_limit: the most messages queued for sending (see ``worker_agent.outbox.Outbox``).
        ca_file: CA certificate (PEM) to trust for a ``wss://`` coordinator (default: system CAs).
        data_listen: ``HOST:PORT`` of the data endpoint (worker_agent/dataplane.py); None: none
            (plans with inputs fail ``inputs_unavailable`` here). Port 0 picks a free one.
        data_advertise: the URL clients dial for it, when not ``http(s)://HOST:PORT``.
        data_tls_cert, data_tls_key: serve the data endpoint over TLS (``https``).
        spool_dir: where inputs and outputs are kept (None: a new temporary directory).
        spool_memory_bytes: inputs up to this size are kept in memory, larger ones on disk.
        spool_capacity_bytes: the most bytes of inputs and outputs kept at once (0: the disk's room).
        output_retention_s: how long an output is kept for the client to fetch.
        input_timeout_s: how long a started plan waits with no byte of its inputs arriving (then
            ``inputs_unavailable``).
        upload_stall_timeout_s: an upload that sends nothing this long is dropped.
        cert_file, key_file: this worker's client certificate and key, for a coordinator
            that requires mTLS (``--tls-client-ca``).
        gpus: devices to declare instead of NVML's (``--gpus``: ``0,1,2,3`` or
            ``0:80GB:H100,1:80GB:H100``; worker_agent/devices.py); "": NVML's. A declaration
            that contradicts the devices NVML sees is refused when the agent is built.
        gpu_share: plans one device may hold at once (``--gpu-share K``; 1: none shared).
        ping_interval_s, ping_timeout_s: websocket pings to the coordinator; one unanswered for
            ``ping_timeout_s`` ends the session (the agent reconnects). None: 1 s / 3 s in cluster
            mode (several URLs, or after a ``moved``), else 20 s / 20 s. 0: no pings.
        gpu_health_interval_s: seconds between two readings of every device's health (NVML; 0: none;
            worker_agent/gpu_health.py): a quarantined device takes no new plan.
        gpu_hot_c: temperature (°C) from which a device is reported degraded.
        on_quarantine: what becomes of the plans running on a device when it is quarantined: ``finish``
            (they run on; the default) or ``requeue`` (they are preempted with ``preemption_grace_s``
            and queued again, elsewhere, without charging an attempt; docs/OPERATIONS.md §GPU health).
        preemption_grace_s: when this host is interrupted (``interruption_command``, SIGUSR1), how long its
            preempted plans have to checkpoint and end before they are cancelled (docs/SEMANTICS.md §Preemption;
            a coordinator's ``preempt`` brings its own grace).
        interruption_command: a shell command polled every ``interruption_poll_s``: exit status 0 says this
            host will be interrupted (a spot instance reclaimed: e.g. ``curl -sf`` of the cloud's metadata
            endpoint), its first line of output why. None: not polled (SIGUSR1 still interrupts).
        interruption_poll_s: seconds between two runs of ``interruption_command``.

    Raises:
        ValueError: a value out of range; the message names the field.
    """

    worker_id: str | None = None
    tags: Sequence[str] = ()
    max_concurrency: int = 4
    allow_shell: bool = False
    python_allow: Sequence[str] = ()
    plan_env: Sequence[str] = ()
    plan_user: str | None = None
    python_envs: Sequence[str] = ()
    models: Sequence[str] = ()
    accelerator: protocol.messages.Accelerator | None = None
    carbon_zone: str = ""
    kv_blocks: int = 0
    kv_block_tokens: int = 0
    encoding: Encoding = "msgpack"
    reconnect_base_s: float = 0.5
    reconnect_cap_s: float = 30.0
    kill_grace_s: float = 5.0
    drain_timeout_s: float = 20.0
    handshake_timeout_s: float = 10.0
    reconnect_dial_timeout_s: float = 3.0
    max_frame_bytes: int = 1 << 20
    outbox_limit: int = 10_000
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    data_listen: str | None = None
    data_advertise: str = ""
    data_tls_cert: str | None = None
    data_tls_key: str | None = None
    spool_dir: str | None = None
    spool_memory_bytes: int = 1 << 20
    spool_capacity_bytes: int = 0
    output_retention_s: float = 3600.0
    input_timeout_s: float = 600.0
    upload_stall_timeout_s: float = 30.0
    gpus: str = ""
    gpu_share: int = 1
    ping_interval_s: float | None = None
    ping_timeout_s: float | None = None
    gpu_health_interval_s: float = 5.0
    gpu_hot_c: float = 90.0
    on_quarantine: str = "finish"
    preemption_grace_s: float = 30.0
    interruption_command: str | None = None
    interruption_poll_s: float = 5.0

    def __post_init__(self) -> None:
        if self.encoding not in ENCODING_SUBPROTOCOL:
            raise ValueError(f"encoding must be 'msgpack' or 'json', got {self.encoding!r}")
        if self.max_concurrency < 0:
            raise ValueError(f"max_concurrency must be >= 0, got {self.max_concurrency}")
        if not 0 < self.reconnect_base_s <= self.reconnect_cap_s:
            raise ValueError("reconnect delays must satisfy 0 < reconnect_base_s <= reconnect_cap_s")
        if not self.handshake_timeout_s > 0:
            raise ValueError(f"handshake_timeout_s must be > 0, got {self.handshake_timeout_s}")
        if not self.reconnect_dial_timeout_s > 0:
            raise ValueError(f"reconnect_dial_timeout_s must be > 0, got {self.reconnect_dial_timeout_s}")
        if self.max_frame_bytes < 8192:
            raise ValueError(f"max_frame_bytes must be >= 8192, got {self.max_frame_bytes}")
        if self.kv_blocks < 0 or self.kv_block_tokens < 0:
            raise ValueError(
                f"kv_blocks and kv_block_tokens must be >= 0, got {self.kv_blocks} and {self.kv_block_tokens}"
            )
        if self.data_listen is not None:
            host, sep, port = self.data_listen.rpartition(":")
            if not sep or not host or not port.isdigit() or int(port) > 65535:
                raise ValueError(f"data_listen must be HOST:PORT, got {self.data_listen!r}")
        if self.gpu_share < 1 or self.gpu_share > 64:
            raise ValueError(f"gpu_share must be between 1 and 64 plans per device, got {self.gpu_share}")
        if self.gpus:
            parse_gpus(self.gpus)  # raises ValueError naming the bad entry
        if (self.data_tls_cert is None) != (self.data_tls_key is None):
            raise ValueError("data_tls_cert and data_tls_key go together")
        for name in ("ping_interval_s", "ping_timeout_s"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no pings), got {getattr(self, name)}")
        if not 0 <= self.gpu_health_interval_s <= 3600:
            raise ValueError(f"gpu_health_interval_s must be in 0 (off) .. 3600, got {self.gpu_health_interval_s}")
        if self.on_quarantine not in ON_QUARANTINE:
            raise ValueError(f"on_quarantine must be 'finish' or 'requeue', got {self.on_quarantine!r}")
        if not 0 <= self.preemption_grace_s <= 86_400:
            raise ValueError(f"preemption_grace_s must be in 0 .. 86400 seconds, got {self.preemption_grace_s}")
        if not 0.1 <= self.interruption_poll_s <= 3600:
            raise ValueError(f"interruption_poll_s must be in 0.1 .. 3600 seconds, got {self.interruption_poll_s}")
        for name in ("output_retention_s", "input_timeout_s", "upload_stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        # Tuples, so a caller's list changed later cannot change a frozen configuration.
        for name in ("tags", "python_allow", "plan_env", "python_envs", "models"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        self.plan_isolation()  # raises ValueError naming a bad --plan-env or --plan-user

    def plan_isolation(self) -> PlanIsolation:
        """How plans' processes start on this worker (their environment, their user).

        Raises:
            ValueError: a ``plan_env`` entry naming ``FLEETWIRE_*``; an unknown or root
                ``plan_user``, or one on a worker not running as root.
        """
        return PlanIsolation.of(self.plan_env, self.plan_user)

    def advertised_capabilities(self) -> dict[str, Any]:
        """The capabilities these settings set, as ``Capabilities`` fields; they override the probe."""
        advertised: dict[str, Any] = {}
        if self.models:
            advertised["models"] = list(dict.fromkeys(self.models))
        if self.accelerator is not None:
            advertised["accelerator"] = self.accelerator
        if self.carbon_zone:
            advertised["carbon_zone"] = self.carbon_zone
        if self.kv_blocks:
            advertised.update(kv_blocks=self.kv_blocks, kv_block_tokens=self.kv_block_tokens)
        if self.gpus:
            advertised["gpus"] = parse_gpus(self.gpus)
            advertised.setdefault("accelerator", "gpu")
        if self.gpu_share != 1:
            advertised["gpu_share"] = self.gpu_share
        return advertised


class AgentOptions(TypedDict, total=False):
    """:class:`AgentSettings`' fields as ``Agent(...)`` keyword arguments (same names, same meaning)."""

    worker_id: str | None
    tags: Sequence[str]
    max_concurrency: int
    allow_shell: bool
    python_allow: Sequence[str]
    plan_env: Sequence[str]
    plan_user: str | None
    python_envs: Sequence[str]
    models: Sequence[str]
    accelerator: protocol.messages.Accelerator | None
    carbon_zone: str
    kv_blocks: int
    kv_block_tokens: int
    encoding: Encoding
    reconnect_base_s: float
    reconnect_cap_s: float
    kill_grace_s: float
    drain_timeout_s: float
    handshake_timeout_s: float
    reconnect_dial_timeout_s: float
    max_frame_bytes: int
    outbox_limit: int
    ca_file: str | None
    cert_file: str | None
    key_file: str | None
    data_listen: str | None
    data_advertise: str
    data_tls_cert: str | None
    data_tls_key: str | None
    spool_dir: str | None
    spool_memory_bytes: int
    spool_capacity_bytes: int
    output_retention_s: float
    input_timeout_s: float
    upload_stall_timeout_s: float
    gpus: str
    gpu_share: int
    ping_interval_s: float | None
    ping_timeout_s: float | None
    gpu_health_interval_s: float
    gpu_hot_c: float
    on_quarantine: str
    preemption_grace_s: float
    interruption_command: str | None
    interruption_poll_s: float
