"""Refusals repeated by one host at the worker's data endpoint (worker_agent/http_conn.py ``Repeats``), on a fake
clock: past the burst of a window they are over (held), each host counted apart, a new window starts afresh."""

from __future__ import annotations

from worker_agent.http_conn import Repeats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_refusals_past_the_burst_of_a_window_are_over_and_each_host_counts_apart() -> None:
    """The first ``burst`` refusals to a host in a window are not over, the next are; another host has its own."""
    repeats = Repeats(burst=3, interval_s=10.0, clock=Clock())
    assert [repeats.over("10.0.0.1") for _ in range(5)] == [False, False, False, True, True]
    assert repeats.over("10.0.0.2") is False
    assert repeats.over_count == 2


def test_a_new_window_starts_the_count_again() -> None:
    """Once the window's interval passed, a host's refusals are counted from zero again."""
    clock = Clock()
    repeats = Repeats(burst=1, interval_s=10.0, clock=clock)
    assert [repeats.over("h"), repeats.over("h")] == [False, True]
    clock.now += 10.0
    assert [repeats.over("h"), repeats.over("h")] == [False, True]


def test_the_table_of_hosts_is_bounded() -> None:
    """Past max_hosts, a new host clears the table (at worst a loop gets one more burst)."""
    repeats = Repeats(burst=1, interval_s=10.0, max_hosts=2, clock=Clock())
    for host in ("a", "b"):
        repeats.over(host)
    assert repeats.over("a") is True
    assert repeats.over("c") is False and len(repeats._windows) == 1
