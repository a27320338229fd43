"""Logging setup shared by every fleetwire process: structlog, to stderr.

Human-readable lines when stderr is a terminal (``--log-format console``), one JSON object
per line otherwise or with ``--log-format json``. Modules only ever call
``structlog.get_logger(__name__)`` and bind ``worker_id``/``plan_id``; this is the one
place that decides how lines look.

No line carries a plan's args, results, events or a token. Tracebacks never show local
variables (structlog's dict tracebacks and rich tracebacks do by default, and a handler's
frames hold its plan's args): both renderers here are built without locals, and code that
logs an exception passes ``exception=traceback_text(exc)`` (a plain string) rather than
``exc_info``, so a process that configured structlog its own way (the ``Agent`` used as a
library) cannot print locals either.
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import Literal

from fleetwire.cli.lean import without

# structlog imports rich (its pretty tracebacks and locals) and greenlet (its deprecated
# threadlocal) whenever they are installed: ~70 ms of every process's start, for features the
# renderers below never use (plain tracebacks, no locals). Imported without them, structlog
# renders exactly the same lines (fleetwire/cli/lean.py).
with without("rich", "greenlet"):
    import structlog

LogFormat = Literal["auto", "console", "json"]
LEVELS = ("debug", "info", "warning", "error")

__all__ = ["LEVELS", "LogFormat", "configure_logging", "traceback_text"]


def traceback_text(exc: BaseException) -> str:
    """``exc``'s traceback as plain text: frames and source lines, never local variables."""
    return "".join(traceback.format_exception(exc)).rstrip()


def configure_logging(fmt: LogFormat = "auto", level: str = "info") -> None:
    """Configure structlog (and the stdlib loggers of our dependencies) once per process."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, not {level!r}")
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer: structlog.types.Processor
    exceptions: structlog.types.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        # structlog's ``dict_tracebacks`` shows every frame's locals: a handler's args included.
        exceptions = structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        )
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
        exceptions = structlog.processors.format_exc_info
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            exceptions,
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
