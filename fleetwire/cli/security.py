"""The security flags of ``fleetwire coordinator`` / ``up`` and the ``fleetwire token`` command.

Kept apart from ``fleetwire/cli/main.py`` so the main parser stays readable. Nothing here imports
the coordinator at parser-build time (client commands must start fast); the coordinator's
modules are imported by the functions that run it. ``LIMIT_DEFAULTS`` mirrors
``coordinator.limits.Limits`` and ``PLAN_LIMIT_DEFAULTS`` the plan limits of
``coordinator.core.CoreConfig`` for the help texts; unit tests keep them equal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = [
    "LIMIT_DEFAULTS",
    "PLAN_LIMIT_DEFAULTS",
    "add_security_arguments",
    "add_token_arguments",
    "add_token_command",
    "plan_limit_settings",
    "security_settings",
]

# flag dest -> (Limits field, default); the defaults are coordinator.limits.Limits()'s.
LIMIT_DEFAULTS: dict[str, tuple[str, Any]] = {
    "max_connections": ("max_connections", 10_000),
    "handshake_timeout": ("handshake_timeout_s", 10.0),
    "worker_frame_bytes": ("worker_frame_bytes", None),
    "client_frame_bytes": ("client_frame_bytes", None),
    "worker_rate": ("worker_rate", 20_000.0),
    "worker_burst": ("worker_burst", 100_000),
    "client_rate": ("client_rate", 5_000.0),
    "client_burst": ("client_burst", 50_000),
    "flood_grace": ("flood_grace_s", 5.0),
    "max_pending_messages": ("max_pending_messages", 50_000),
    "max_pending_bytes": ("max_pending_bytes", 64 << 20),
    "max_commit_backlog_bytes": ("max_commit_backlog_bytes", 64 << 20),
    "ping_interval": ("ping_interval_s", 20.0),
    "ping_timeout": ("ping_timeout_s", 20.0),
    "close_timeout": ("close_timeout_s", 5.0),
    "penalty_base": ("penalty_base_s", 1.0),
    "penalty_max": ("penalty_max_s", 60.0),
    "penalty_hold": ("penalty_hold_s", 1.0),
    "max_pending_handshakes": ("max_pending_handshakes", 1024),
    "defer_accept": ("defer_accept_s", None),
    "refusal_log_burst": ("refusal_log_burst", 5),
    "refusal_log_interval": ("refusal_log_interval_s", 60.0),
    "max_connections_per_principal": ("max_connections_per_principal", None),
    "worker_connection_reserve": ("worker_connection_reserve", None),
    "cost_rate": ("cost_rate", 200_000.0),
    "cost_burst": ("cost_burst", 1_000_000),
    "frame_cost_budget": ("frame_cost_budget", 20_000),
}

# flag dest -> (CoreConfig field, default): limits the core enforces, in the same "limits" flag group.
PLAN_LIMIT_DEFAULTS: dict[str, tuple[str, Any]] = {
    "max_plans_per_client": ("max_plans_per_client", 10_000),
    "max_bytes_per_client": ("max_bytes_per_client", 64 << 20),
    "max_events_per_plan": ("max_events_per_plan", 10_000),
    "max_event_bytes_per_plan": ("max_event_bytes_per_plan", 64 << 20),
    "worker_reconnect_rate": ("worker_reconnect_rate", 0.2),
    "worker_reconnect_burst": ("worker_reconnect_burst", 10),
}


def _default(dest: str) -> Any:
    return (LIMIT_DEFAULTS.get(dest) or PLAN_LIMIT_DEFAULTS[dest])[1]


def add_security_arguments(p: argparse.ArgumentParser) -> None:
    """TLS and limit flags, shared by ``coordinator`` and ``up`` (docs/OPERATIONS.md §Security)."""
    g = p.add_argument_group("TLS")
    g.add_argument("--tls-cert", metavar="PEM", help="serve wss:// with this certificate chain (needs --tls-key)")
    g.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    g.add_argument("--tls-client-ca", metavar="PEM",
                   help="require workers to present a client certificate signed by this CA (mTLS)")
    g = p.add_argument_group("limits (0 disables a limit where noted)")
    g.add_argument("--max-connections", type=int, default=_default("max_connections"), metavar="N",
                   help=f"open sessions before new ones get HTTP 503; 0: none (default {_default('max_connections')})")
    g.add_argument("--handshake-timeout", type=float, default=_default("handshake_timeout"), metavar="S",
                   help="drop connections that have not finished the upgrade in S seconds "
                        f"(default {_default('handshake_timeout')})")
    g.add_argument("--worker-frame-bytes", type=int, default=None, metavar="N",
                   help="largest frame from a worker, closed 1009 above it (default: --max-frame-bytes)")
    g.add_argument("--client-frame-bytes", type=int, default=None, metavar="N",
                   help="largest frame from a client, closed 1009 above it (default: --max-frame-bytes)")
    for role in ("worker", "client"):
        g.add_argument(f"--{role}-rate", type=float, default=_default(f"{role}_rate"), metavar="MSGS",
                       help=f"messages per second per {role} connection; over it the connection is throttled, "
                            f"then closed 4429; 0: none (default {_default(f'{role}_rate'):g})")
        g.add_argument(f"--{role}-burst", type=int, default=_default(f"{role}_burst"), metavar="N",
                       help=f"messages a {role} connection may send at once above its rate "
                            f"(default {_default(f'{role}_burst')})")
    g.add_argument("--flood-grace", type=float, default=_default("flood_grace"), metavar="S",
                   help=f"how long a connection may stay throttled before 4429 (default {_default('flood_grace')})")
    g.add_argument("--penalty-base", type=float, default=_default("penalty_base"), metavar="S",
                   help="after a close for abuse (1009, 4400, 4429) the same token from the same address gets "
                        "HTTP 429 + Retry-After for S seconds, doubling per further offence; 0: off "
                        f"(default {_default('penalty_base')})")
    g.add_argument("--penalty-max", type=float, default=_default("penalty_max"), metavar="S",
                   help=f"the longest penalty cool-off (default {_default('penalty_max')})")
    g.add_argument("--penalty-hold", type=float, default=_default("penalty_hold"), metavar="S",
                   help="hold each penalty-box 429 this long before answering it, so a reconnect loop that "
                        f"ignores Retry-After stays slow (default {_default('penalty_hold')})")
    g.add_argument("--worker-reconnect-burst", type=int, default=_default("worker_reconnect_burst"), metavar="N",
                   help="registrations (hello) one worker id may make at once; past its budget a hello gets "
                        "error(too_many_reconnects) and 4429, then the penalty box "
                        f"(default {_default('worker_reconnect_burst')})")
    g.add_argument("--worker-reconnect-rate", type=float, default=_default("worker_reconnect_rate"), metavar="N",
                   help="registrations per second a worker id regains above its burst, so a worker that "
                        "reconnects in a loop is held back; 0: no budget "
                        f"(default {_default('worker_reconnect_rate'):g})")
    g.add_argument("--max-plans-per-client", type=int, default=_default("max_plans_per_client"), metavar="N",
                   help="unfinished plans per client token before submit gets error(too_many_plans); 0: none "
                        f"(default {_default('max_plans_per_client')})")
    g.add_argument("--max-bytes-per-client", type=int, default=_default("max_bytes_per_client"), metavar="B",
                   help="bytes of unfinished plans (args, requirements, overhead) per client token before submit "
                        "gets error(too_many_plans) naming bytes; the token's finished plans share the budget "
                        "(its oldest are forgotten past it); 0: none "
                        f"(default {_default('max_bytes_per_client')}, 64 MiB)")
    g.add_argument("--max-connections-per-principal", type=int, default=None, metavar="N",
                   help="open sessions one client token may hold before its next upgrade gets HTTP 503; 0: none "
                        "(default: a quarter of --max-connections, at least 16)")
    g.add_argument("--worker-connection-reserve", type=int, default=None, metavar="N",
                   help="of --max-connections, the slots only workers may take (clients get 503 past the rest); "
                        "0: none (default: a tenth of --max-connections)")
    g.add_argument("--cost-rate", type=float, default=_default("cost_rate"), metavar="UNITS",
                   help="work units per second one client token may spend (a unit: a message, a KiB received, "
                        "a row scanned, an event replayed); past it its connections are read more slowly; 0: none "
                        f"(default {_default('cost_rate'):g})")
    g.add_argument("--cost-burst", type=int, default=_default("cost_burst"), metavar="UNITS",
                   help="work units a client token may spend at once above its rate "
                        f"(default {_default('cost_burst')})")
    g.add_argument("--frame-cost-budget", type=int, default=_default("frame_cost_budget"), metavar="UNITS",
                   help="work units one frame's requests may cost before the rest wait for the next event-loop "
                        f"turn, so one frame never holds the loop (default {_default('frame_cost_budget')})")
    g.add_argument("--max-pending-messages", type=int, default=_default("max_pending_messages"), metavar="N",
                   help="messages waiting for a peer that does not read before it is closed 4503 "
                        f"(default {_default('max_pending_messages')})")
    g.add_argument("--max-pending-bytes", type=int, default=_default("max_pending_bytes"), metavar="N",
                   help="about how many bytes may wait for a peer that does not read before it is closed 4503 "
                        f"(default {_default('max_pending_bytes')}, 64 MiB)")
    g.add_argument("--max-events-per-plan", type=int, default=_default("max_events_per_plan"), metavar="N",
                   help="events of one plan held in memory for replay; past it the oldest go, ephemeral first "
                        f"(durable ones stay in the store) (default {_default('max_events_per_plan')})")
    g.add_argument("--max-event-bytes-per-plan", type=int, default=_default("max_event_bytes_per_plan"),
                   metavar="N", help="about how many payload bytes of one plan's events are held in memory; "
                                     f"0: no byte bound (default {_default('max_event_bytes_per_plan')}, 64 MiB)")
    g.add_argument("--max-commit-backlog-bytes", type=int, default=_default("max_commit_backlog_bytes"),
                   metavar="N", help="bytes of received frames waiting for the store; past it the coordinator stops "
                                     "reading until the disk catches up; 0: no bound "
                                     f"(default {_default('max_commit_backlog_bytes')}, 64 MiB)")
    g.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                   help="a browser origin allowed besides the coordinator's own, e.g. https://dash.example.com "
                        "(repeatable; '*' allows any)")
    g.add_argument("--ping-interval", type=float, default=_default("ping_interval"), metavar="S",
                   help=f"websocket ping period; a peer silent past --ping-timeout is closed 1011 "
                        f"(default {_default('ping_interval')})")
    g.add_argument("--ping-timeout", type=float, default=_default("ping_timeout"), metavar="S",
                   help=f"(default {_default('ping_timeout')})")
    g.add_argument("--close-timeout", type=float, default=_default("close_timeout"), metavar="S",
                   help="how long a closing connection waits for the peer before dropping TCP "
                        f"(default {_default('close_timeout')})")
    g.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="with --insecure: a Host name accepted besides loopback ones (127.0.0.1, ::1, localhost), "
                        "which a page using DNS rebinding cannot send (repeatable)")
    g.add_argument("--max-pending-handshakes", type=int, default=_default("max_pending_handshakes"), metavar="N",
                   help="TCP connections still in their websocket handshake; past it the oldest is dropped "
                        "(idle token-less sockets); kept under a quarter of the open-file limit, which the "
                        f"coordinator raises to its hard limit at start; 0: none "
                        f"(default {_default('max_pending_handshakes')})")
    g.add_argument("--defer-accept", type=float, default=_default("defer_accept"), metavar="S",
                   help="the kernel holds a new TCP connection until its first byte for up to S seconds before "
                        "the coordinator accepts it (TCP_DEFER_ACCEPT, Linux; rounded up to 1, 3, 7, 15 s...): "
                        "real peers send at once, idle sockets cost nothing meanwhile; 0: off "
                        "(default: --handshake-timeout)")
    g.add_argument("--refusal-log-burst", type=int, default=_default("refusal_log_burst"), metavar="N",
                   help="refused connections logged one by one per peer address and interval; the rest are "
                        f"summed up in one line at its end (default {_default('refusal_log_burst')})")
    g.add_argument("--refusal-log-interval", type=float, default=_default("refusal_log_interval"), metavar="S",
                   help=f"the refusal-log interval (default {_default('refusal_log_interval')})")
    g = p.add_argument_group("metrics")
    g.add_argument("--metrics-cache", type=float, default=2.0, metavar="S",
                   help="rebuild the /metrics exposition at most every S seconds; 0: on every scrape (default 2)")
    g.add_argument("--metrics-token", metavar="TOKEN",
                   help="require 'Authorization: Bearer TOKEN' on /metrics (default $FLEETWIRE_METRICS_TOKEN; "
                        "none: open, as it carries no plan data)")
    g.add_argument("--metrics-listen", metavar="HOST:PORT",
                   help="serve /metrics (and /healthz) on this address instead of the main port, e.g. an "
                        "interface only the monitoring network reaches")


def add_token_arguments(p: argparse.ArgumentParser) -> None:
    """Token-file and admin-token flags of ``fleetwire coordinator``."""
    p.add_argument("--token-file", metavar="TOML",
                   help="tokens with names and roles (see `fleetwire token new`); re-read on SIGHUP")
    p.add_argument("--admin-token", help="token with the admin role (default $FLEETWIRE_ADMIN_TOKEN)")


def plan_limit_settings(ns: argparse.Namespace) -> dict[str, Any]:
    """``CoreConfig`` keyword arguments from the parsed plan-limit flags (``--max-plans-per-client`` ...)."""
    return {field: getattr(ns, dest) for dest, (field, _) in PLAN_LIMIT_DEFAULTS.items()}


def security_settings(ns: argparse.Namespace) -> dict[str, Any]:
    """``ServerSettings`` keyword arguments from the parsed security flags (the plan limits aside)."""
    from coordinator.limits import Limits

    values = {field: getattr(ns, dest) for dest, (field, _) in LIMIT_DEFAULTS.items()}
    for field in ("ping_interval_s", "ping_timeout_s"):
        values[field] = values[field] or None  # 0: no pings
    limits = Limits(**values, allowed_origins=tuple(ns.allowed_origin), allowed_hosts=tuple(ns.allowed_host))
    return {
        "metrics_cache_s": ns.metrics_cache,
        "metrics_token": ns.metrics_token or os.environ.get("FLEETWIRE_METRICS_TOKEN") or None,
        "metrics_listen": ns.metrics_listen,
        "tls_cert": ns.tls_cert,
        "tls_key": ns.tls_key,
        "tls_client_ca": ns.tls_client_ca,
        "token_file": getattr(ns, "token_file", None),
        "limits": limits,
    }


# ---------------------------------------------------------------------------- fleetwire token


def add_token_command(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    """``fleetwire token new`` and ``fleetwire token hash``."""
    p = sub.add_parser("token", parents=parents, help="make tokens and token-file entries",
                       description="Tokens for --token-file: the file stores only each token's hash.")
    tsub = p.add_subparsers(dest="token_command", required=True, metavar="SUBCOMMAND")
    t = tsub.add_parser("new", help="make a token and print it with its token-file entry",
                        description="Print a fresh token (give it to its user; it is not stored anywhere) "
                                    "and the [[token]] entry to append to the token file.")
    t.add_argument("--name", required=True, help="who the token is for; logged, and the owner of its plans")
    t.add_argument("--role", required=True, choices=("worker", "client", "admin"))
    t.add_argument("--worker-ids", metavar="GLOB", help="for a worker token: the worker ids it may register")
    t.set_defaults(func=_token_new)
    t = tsub.add_parser("hash", help="print the token-file hash of a token read from stdin",
                        description="Read a token from stdin (so it stays out of shell history) and print "
                                    "the value for the token file's hash field.")
    t.set_defaults(func=_token_hash)


async def _token_new(ns: argparse.Namespace) -> int:
    from coordinator.auth import hash_token, new_token

    if ns.worker_ids is not None and ns.role != "worker":
        print("fleetwire: error: --worker-ids applies to --role worker only", file=sys.stderr)
        return 2
    token = new_token()
    lines = ["[[token]]", f"name = {_toml_str(ns.name)}", f'role = "{ns.role}"']
    if ns.worker_ids is not None:
        lines.append(f"worker_ids = {_toml_str(ns.worker_ids)}")
    lines.append(f'hash = "{hash_token(token)}"')
    print(f"# token for {ns.name} (shown once; the file keeps only its hash):", file=sys.stderr)
    print(token, flush=True)
    print("# append to the token file, then send the coordinator SIGHUP:", file=sys.stderr)
    print("\n".join(lines), flush=True)
    return 0


async def _token_hash(ns: argparse.Namespace) -> int:
    from coordinator.auth import hash_token

    token = sys.stdin.readline().strip()
    if not token:
        print("fleetwire: error: no token on stdin (try: printf %s \"$TOKEN\" | fleetwire token hash)",
              file=sys.stderr)
        return 2
    print(hash_token(token), flush=True)
    return 0


def _toml_str(text: str) -> str:
    # A JSON string without \\u-escaped astral characters is a valid TOML basic string.
    return json.dumps(text, ensure_ascii=False)
