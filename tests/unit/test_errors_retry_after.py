"""Retry-After parsing shared by the SDK and the worker agent (protocol/errors.py)."""

from __future__ import annotations

import pytest

from protocol.errors import retry_after_seconds


@pytest.mark.parametrize(
    ("value", "expected"),
    [("30", 30.0), ("0.5", 0.5), ("0", 0.0), (None, None), ("soon", None), ("-1", None), ("99999", None),
     ("Wed, 21 Oct 2026 07:28:00 GMT", None)],
)
def test_retry_after_takes_delay_seconds_and_ignores_the_rest(value: str | None, expected: float | None) -> None:
    """Delay-seconds within an hour are a hint; a date, garbage or an absurd value is no hint."""
    assert retry_after_seconds(value) == expected
