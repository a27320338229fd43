"""Fixtures shared by integration test modules (tests/conftest.py holds the suite-wide ones)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from websockets.frames import Frame


@pytest.fixture
def library_frames(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Frame]]:
    """Every frame websockets' own send serializes, on both ends of a test's connections (wireio/wsmask.py writes
    its frames past the library: test_wsmask, test_wsmask_server)."""
    serialized: list[Frame] = []
    real = Frame.serialize

    def counting(self: Frame, **kwargs: Any) -> bytes:
        serialized.append(self)
        return real(self, **kwargs)

    monkeypatch.setattr(Frame, "serialize", counting)
    yield serialized
