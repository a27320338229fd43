"""Logging setup: websockets' handshake noise is dropped, its real failures are kept."""

from __future__ import annotations

import logging

import pytest
import structlog

from fleetwire.cli.logs import configure_logging


def test_handshake_failures_dropped_handler_failures_kept(caplog: pytest.LogCaptureFixture) -> None:
    """After configure_logging, 'opening handshake failed' is dropped and 'connection handler failed' shows."""
    server = logging.getLogger("websockets.server")
    filters, level = list(server.filters), logging.getLogger("websockets").level
    configure_logging("json", "info")
    try:
        with caplog.at_level(logging.ERROR):
            server.error("opening handshake failed")
            server.error("connection handler failed")
            server.info("connection open")
    finally:
        # configure_logging binds this test's captured stderr: leave no trace for later tests.
        structlog.reset_defaults()
        server.filters[:] = filters
        logging.getLogger("websockets").setLevel(level)
    assert [r.getMessage() for r in caplog.records] == ["connection handler failed"]
