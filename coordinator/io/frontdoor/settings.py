"""What a coordinator process is configured with: :class:`ServerSettings`, and its checks.

The command line builds one (fleetwire/cli/main.py); a ``CoordinatorServer``
(coordinator/io/frontdoor/server.py) or a ``ClusterHost`` (coordinator/io/cluster/host.py) is
built from it. :meth:`ServerSettings.check` refuses settings that cannot work, naming the flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from coordinator.carbon_time import ForecastSource
from coordinator.core import CoreConfig
from coordinator.io.ops.metrics_http import parse_listen
from coordinator.io.ops.provision import Provider
from coordinator.limits import Limits
from coordinator.shards import ClusterConfig
from protocol.relay import MAX_CHUNK_BYTES

__all__ = ["LOOPBACK_HOSTS", "ServerSettings"]

LOOPBACK_HOSTS: Final = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(frozen=True)
class ServerSettings:
    """Everything the coordinator process is configured with.

    Attributes:
        host: interface to bind; loopback by default.
        port: TCP port; 0 picks a free one (read ``CoordinatorServer.port`` after start).
        worker_tokens: bearer tokens accepted on ``/v1/worker``.
        client_tokens: bearer tokens accepted on ``/v1/client``.
        insecure: accept connections without tokens (only allowed on loopback).
        core: the core's settings (coordinator/core.py ``CoreConfig``): heartbeat interval and
            timeout (told to workers in ``welcome``; the reaper drops a worker whose last beat
            is older than the timeout), the reaper's circuit breaker, the plan quota per client
            principal and the per-plan event bounds, placement, the autoscaler (None: none) and
            plan retention. The server fills in only ``version``.
        reaper_interval_s: how often the reaper runs; defaults to a tenth of the heartbeat
            timeout (at most 1 s), so detection takes at most timeout + interval.
        max_frame_bytes: largest accepted frame (larger closes that connection with 1009).
        admin_tokens: bearer tokens of the ``admin`` role (``/v1/client``, sees every plan).
        token_file: a TOML token file (coordinator/auth.py); reloaded by ``reload_tokens``.
        tls_cert / tls_key: serve ``wss://`` with this PEM certificate chain and key.
        tls_client_ca: require worker client certificates signed by this CA (mTLS).
        limits: rate, size, connection and buffer limits (coordinator/limits.py).
        autoscale_hook: a shell command run with each autoscaler decision as JSON on stdin
            (needs ``core.autoscale``).
        ping_workers: send websocket keepalive pings (``limits.ping_interval_s``) on
            ``/v1/worker`` sessions too. Off by default: a worker heartbeats and the reaper
            closes a silent one 4408 after the heartbeat timeout, which covers a half-open
            worker connection; with 10,000 workers the pings were ~40 % of the steady CPU
            (docs/PERFORMANCE.md). Client sessions are always pinged (docs/OPERATIONS.md §Test matrix row 22).
    """

    host: str = "127.0.0.1"
    port: int = 8765
    worker_tokens: tuple[str, ...] = ()
    client_tokens: tuple[str, ...] = ()
    insecure: bool = False
    core: CoreConfig = field(default_factory=CoreConfig)
    reaper_interval_s: float | None = None
    max_frame_bytes: int = 1 << 20
    store: str = "memory"  # coordinator/io/stores/store.py: "memory", "sqlite" (in data_dir) or "sqlite:PATH"
    data_dir: str | None = None  # where "sqlite" keeps its file; default coordinator.io.stores.store.default_data_dir()
    cluster: ClusterConfig = ClusterConfig()  # noqa: RUF009 - frozen; cluster mode (a postgresql:// store) only
    accept_store_loss: bool = False  # a damaged store starts from what is readable (coordinator/io/stores/integrity.py)
    store_writer: str = "process"  # SQLite commits under load: a child process, or "thread" (stores/writer_process.py)
    ping_workers: bool = False
    admin_tokens: tuple[str, ...] = ()
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    limits: Limits = Limits()  # noqa: RUF009 - frozen, so one shared default is safe
    autoscale_hook: str | None = None
    autoscale_provider: Provider | None = None  # starts and stops workers (coordinator/io/ops/provision.py)
    metrics_cache_s: float = 2.0  # /metrics is rebuilt at most this often (coordinator/io/ops/metrics_http.py)
    otlp_endpoint: str = ""  # traces to this OTLP/HTTP collector ("": OTEL_EXPORTER_OTLP_ENDPOINT says; §Tracing)
    metrics_token: str | None = None  # /metrics needs this bearer token when set
    metrics_listen: str | None = None  # HOST:PORT: /metrics on its own socket (404 on the main port)
    openai: bool = True  # serve the OpenAI-compatible routes on the main port (docs/OPENAI.md; --no-openai)
    openai_queue_timeout_s: float = 30.0  # an OpenAI request waits this long for a worker, then 503
    # False (--openai-durable off): the door's plans are never written to the store, so a request's steps wait for
    # no commit (docs/OPENAI.md §Durability); True: recorded before placement as every plan.
    openai_durable: bool = True
    # Grid carbon forecasts for time shifting (--carbon-forecast; coordinator/io/ops/carbon_feed.py); None: none, so
    # plans with a deadline are placed at once. A forecast older than carbon_forecast_max_age_s is stale.
    carbon_forecast: ForecastSource | None = None
    carbon_forecast_max_age_s: float = 86_400.0
    openai_rate: float = 0.0  # OpenAI requests per second per principal, then 429 (0: no limit; --openai-rate)
    openai_burst: int = 0  # OpenAI requests a principal may make at once (0: one second's worth; --openai-burst)

    def check(self) -> None:
        """Raise ``ValueError`` with an actionable message when the settings cannot work."""
        core = self.core
        if core.heartbeat_interval_s <= 0 or core.heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat interval and timeout must be positive seconds")
        if core.heartbeat_timeout_s < core.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat timeout ({core.heartbeat_timeout_s} s) must be at least the interval "
                f"({core.heartbeat_interval_s} s), or every worker would be reaped between beats"
            )
        if self.insecure:
            if self.host not in LOOPBACK_HOSTS:
                raise ValueError(f"--insecure is only allowed on a loopback address, not {self.host!r}")
        elif self.token_file is None and (not self.worker_tokens or not (self.client_tokens or self.admin_tokens)):
            raise ValueError(
                "refusing to start without tokens: pass --token-file, or set FLEETWIRE_WORKER_TOKEN and "
                "FLEETWIRE_CLIENT_TOKEN (or --worker-token/--client-token), or pass --insecure on a loopback address"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca (mTLS) needs TLS: pass --tls-cert and --tls-key too")
        self.limits.check()
        for name in ("max_plans_per_client", "max_event_bytes_per_plan"):
            if getattr(core, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no limit), got {getattr(core, name)}")
        if core.max_events_per_plan < 1:
            raise ValueError(f"max_events_per_plan must be >= 1, got {core.max_events_per_plan}")
        if not core.worker_reconnect_rate >= 0:
            raise ValueError(f"--worker-reconnect-rate must be >= 0 per second (0: no budget), "
                             f"got {core.worker_reconnect_rate}")
        if core.worker_reconnect_burst < 1:
            raise ValueError(f"--worker-reconnect-burst must be >= 1, got {core.worker_reconnect_burst}")
        if not 0 <= core.worker_reconnect_grace_s < float("inf"):
            raise ValueError(f"--worker-reconnect-grace-s must be >= 0 seconds, got {core.worker_reconnect_grace_s}")
        if not 0 <= core.preemption_grace_s <= 86_400:
            raise ValueError(f"--preemption-grace must be 0 to 86400 seconds, got {core.preemption_grace_s}")
        if not 0 <= core.preemption_min_run_s < float("inf"):
            raise ValueError(f"--preemption-min-run must be >= 0 seconds, got {core.preemption_min_run_s}")
        core.placement.check()
        if core.autoscale is not None:
            core.autoscale.check()
        elif self.autoscale_hook is not None:
            raise ValueError("--autoscale-hook needs the autoscaler: pass --autoscale too")
        elif self.autoscale_provider is not None:
            raise ValueError("--autoscale-provider needs the autoscaler: pass --autoscale too")
        if not self.metrics_cache_s >= 0:
            raise ValueError(f"--metrics-cache must be >= 0 seconds, got {self.metrics_cache_s}")
        if self.metrics_token is not None and len(self.metrics_token) < 16:
            raise ValueError("--metrics-token must be at least 16 characters")
        if self.metrics_listen is not None:
            parse_listen(self.metrics_listen)
        if self.store.startswith("postgresql://"):
            self.cluster.check()
        if not core.plan_retention_s >= 0:  # NaN too
            raise ValueError(f"--plan-retention must be >= 0 seconds (0 keeps every plan), got {core.plan_retention_s}")
        if core.plan_retention_bytes < 0:
            raise ValueError(f"--plan-retention-bytes must be >= 0 (0: no byte bound), got {core.plan_retention_bytes}")
        if core.relay_max_bytes < MAX_CHUNK_BYTES or core.relay_window_bytes < MAX_CHUNK_BYTES:
            raise ValueError(f"--relay-max-bytes (and the relay window) must be at least one chunk, {MAX_CHUNK_BYTES} "
                             f"bytes; got {core.relay_max_bytes}")
        for flag, share in (("--relay-principal-bytes", core.relay_principal_bytes),
                            ("--relay-session-bytes", core.relay_session_bytes)):
            if share and not MAX_CHUNK_BYTES <= share <= core.relay_max_bytes:
                raise ValueError(f"{flag} must be 0 (its default share) or from one chunk, {MAX_CHUNK_BYTES} bytes, "
                                 f"to --relay-max-bytes ({core.relay_max_bytes}); got {share}")
        if not core.relay_idle_s > 0:  # NaN too
            raise ValueError(f"--relay-idle must be > 0 seconds, got {core.relay_idle_s}")
        if not 0 < self.openai_queue_timeout_s < float("inf"):
            raise ValueError(f"--openai-queue-timeout must be > 0 seconds, got {self.openai_queue_timeout_s}")
        if not 0 <= self.openai_rate < float("inf") or self.openai_burst < 0:
            raise ValueError(f"--openai-rate must be >= 0 requests/s (0: no limit) and --openai-burst >= 0, got "
                             f"{self.openai_rate} and {self.openai_burst}")

    @property
    def reaper_period_s(self) -> float:
        if self.reaper_interval_s is not None:
            return self.reaper_interval_s
        return min(1.0, self.core.heartbeat_timeout_s / 10)
