"""Repeated 401s and /metrics scrapes from one address (issue 17 #9, #10; coordinator/io/frontdoor/admission.py)."""

from __future__ import annotations

from coordinator.io.frontdoor.admission import Repeats


class Clock:
    """A settable monotonic clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_past_the_burst_each_further_event_in_the_window_is_over() -> None:
    """The first ``burst`` events of an address in a window pass; the rest are over, and counted."""
    clock = Clock()
    repeats = Repeats(burst=3, interval_s=10.0, clock=clock)
    assert [repeats.over("10.0.0.1:4000") for _ in range(5)] == [False, False, False, True, True]
    assert repeats.over_count == 2


def test_a_new_window_starts_again_from_the_burst() -> None:
    """After the interval the address gets its burst back."""
    clock = Clock()
    repeats = Repeats(burst=1, interval_s=10.0, clock=clock)
    assert [repeats.over("10.0.0.1:1"), repeats.over("10.0.0.1:2")] == [False, True]
    clock.now = 10.0
    assert not repeats.over("10.0.0.1:3")


def test_addresses_are_counted_apart_by_host_not_port() -> None:
    """Another host keeps its own burst; another port of the same host does not."""
    repeats = Repeats(burst=1, interval_s=10.0, clock=Clock())
    assert not repeats.over("10.0.0.1:1") and repeats.over("10.0.0.1:2")
    assert not repeats.over("10.0.0.2:1") and not repeats.over("[::1]:5")


def test_the_table_stays_bounded_under_many_addresses() -> None:
    """Past max_addresses the table is cleared: memory stays bounded under a spoofed flood."""
    repeats = Repeats(burst=1, interval_s=60.0, max_addresses=100, clock=Clock())
    for i in range(10_000):
        repeats.over(f"10.{i // 256 % 256}.{i % 256}.1:1")
    assert len(repeats._windows) <= 100  # the bound itself is what is tested
