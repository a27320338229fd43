"""Logging setup shared by every fleetwire process: structlog, to stderr.

Human-readable lines when stderr is a terminal (``--log-format console``), one JSON object
per line otherwise or with ``--log-format json``. Modules only ever call
``structlog.get_logger(__name__)`` and bind ``worker_id``/``plan_id``; this is the one
place that decides how lines look.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

LogFormat = Literal["auto", "console", "json"]
LEVELS = ("debug", "info", "warning", "error")


def configure_logging(fmt: LogFormat = "auto", level: str = "info") -> None:
    """Configure structlog (and the stdlib loggers of our dependencies) once per process."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, not {level!r}")
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer: structlog.types.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks if fmt == "json" else structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    # websockets logs every failed handshake ("opening handshake failed", with a traceback)
    # at ERROR: hostile or broken peers would flood the log, and our own refusals are logged
    # once by the coordinator. Its real failures ("connection handler failed",
    # "process_request failed") are bugs of ours and must stay visible.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("websockets").setLevel(logging.ERROR)
    # A logger's filters see only records logged on it (not its children's), so the filter
    # goes on the logger server connections log through.
    server_logger = logging.getLogger("websockets.server")
    if not any(isinstance(f, _DropHandshakeFailures) for f in server_logger.filters):
        server_logger.addFilter(_DropHandshakeFailures())


class _DropHandshakeFailures(logging.Filter):
    """Drops websockets' per-connection "opening handshake failed" records."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "opening handshake failed"
