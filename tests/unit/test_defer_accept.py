"""TCP_DEFER_ACCEPT on listening sockets (coordinator/io/frontdoor/admission.py, issue 17 finding 6), real ones."""

from __future__ import annotations

import socket

import pytest

from coordinator.io.frontdoor.admission import defer_accept
from coordinator.limits import Limits

needs_defer_accept = pytest.mark.skipif(not hasattr(socket, "TCP_DEFER_ACCEPT"), reason="TCP_DEFER_ACCEPT is Linux's")


@needs_defer_accept
def test_defer_accept_sets_whole_seconds_on_tcp_listeners_and_reports_what_the_kernel_keeps() -> None:
    """Fractions round up to a second; the kernel's own rounding (its SYN-ACK retransmit schedule) is returned."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        applied = defer_accept([listener], 0.2)
        assert applied >= 1
        assert listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT) == applied
        assert defer_accept([listener], 10) >= 10


def test_defer_accept_zero_or_non_tcp_sockets_leave_everything_as_it_was() -> None:
    """0 is off; a Unix socket is skipped; neither raises."""
    with socket.create_server(("127.0.0.1", 0)) as listener, socket.socket(socket.AF_UNIX) as unix:
        assert defer_accept([listener], 0) == 0
        assert defer_accept([unix], 5) == 0
        if hasattr(socket, "TCP_DEFER_ACCEPT"):
            assert listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT) == 0


def test_a_negative_defer_accept_is_refused_by_name() -> None:
    """Limits.check names defer accept; None (the handshake timeout) and 0 (off) are fine."""
    with pytest.raises(ValueError, match="defer accept"):
        Limits(defer_accept_s=-1).check()
    Limits(defer_accept_s=None).check()
    Limits(defer_accept_s=0).check()
