"""The CLI's transfer progress bars: drawn only on a terminal, only for transfers of a few MB or more."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console
from rich.progress import Progress

from fleetwire.cli.progress import MIN_BYTES, Bars, transfer_progress
from fleetwire.direct import DirectTransport


class _Client:
    def __init__(self, transport: Any) -> None:
        self.transport = transport


class _Auto:
    def __init__(self, direct: DirectTransport) -> None:
        self.direct = direct


def test_small_transfers_get_no_bar_and_large_ones_one_each() -> None:
    """A transfer under MIN_BYTES draws nothing; a larger one gets one bar that follows its progress."""
    progress = Progress(console=Console(file=io.StringIO()))
    bars = Bars(progress, "upload")
    bars("small", 10, MIN_BYTES - 1)
    assert progress.tasks == []
    bars("big", 1 << 20, 8 * MIN_BYTES)
    bars("big", 2 << 20, 8 * MIN_BYTES)
    assert len(progress.tasks) == 1
    assert progress.tasks[0].completed == 2 << 20 and progress.tasks[0].total == 8 * MIN_BYTES


async def test_no_terminal_or_json_means_no_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """With stderr not a terminal, or with --json, the transport gets no progress callback."""
    direct = DirectTransport()
    try:
        monkeypatch.setattr("sys.stderr", io.StringIO())
        async with transfer_progress(_Client(_Auto(direct)), "upload", as_json=False):
            assert direct.progress is None

        class _Tty(io.StringIO):
            def isatty(self) -> bool:
                return True

        monkeypatch.setattr("sys.stderr", _Tty())
        async with transfer_progress(_Client(direct), "upload", as_json=True):
            assert direct.progress is None
        async with transfer_progress(_Client(_Auto(direct)), "upload", as_json=False):
            assert direct.progress is not None
        assert direct.progress is None
    finally:
        await direct.aclose()
