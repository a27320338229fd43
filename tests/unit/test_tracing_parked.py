"""The tracer's exporter thread (wireio/tracing.py ``Tracing._run``) parks while nothing is queued: no timer wake-up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.unit.test_tracing import _Counting
from tests.waiting import until
from wireio.tracing import SERVICE_COORDINATOR, Tracing

SAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def counted() -> Iterator[tuple[Tracing, _Counting, list[int]]]:
    """A tracer exporting every 1 ms while spans come, and the exporter thread's exports (each span count)."""
    exporter = _Counting()
    tracing = Tracing(SERVICE_COORDINATOR, exporter=exporter, environ={"OTEL_BSP_SCHEDULE_DELAY": "1"})
    exports: list[int] = []
    export_queued = tracing._export_queued

    def counting() -> bool:
        exports.append(len(tracing._queue))
        return export_queued()

    tracing._export_queued = counting  # type: ignore[method-assign]  # the thread's next call on
    try:
        yield tracing, exporter, exports
    finally:
        tracing.shutdown()


async def test_with_nothing_queued_the_exporter_thread_waits_for_a_span_not_for_the_delay(
    counted: tuple[Tracing, _Counting, list[int]],
) -> None:
    """Nothing noted: the thread parks (no export every 1 ms delay, as it did before); a span wakes it, goes out
    after the delay in one export, and the thread parks again."""
    tracing, exporter, exports = counted
    await until(lambda: tracing._parked)
    exports.clear()  # a wake before the wrapper was in place (the thread's first look) is not this test's
    tracing.record("fleetwire.queue", SAMPLED, 1, 2)
    await until(lambda: len(exporter.spans) == 1)
    await until(lambda: tracing._parked)
    assert exports == [1]


async def test_a_parked_thread_wakes_for_a_commit_record_alone(counted: tuple[Tracing, _Counting, list[int]]) -> None:
    """A step's commit record noted after its step record went out (the coordinator's commit comes later) wakes the
    parked thread: it is exported, not left queued until the next span."""
    tracing, _exporter, _exports = counted
    tracing.add_step(1, 10, [])
    await until(lambda: tracing._parked and not tracing._queue)
    tracing.add_commit(1, 20)
    await until(lambda: tracing._parked and not tracing._queue)


async def test_a_full_batch_goes_at_once_even_from_a_parked_thread() -> None:
    """OTEL_BSP_MAX_EXPORT_BATCH_SIZE 1 and a 600 s delay: the first span noted is a full batch, exported at once
    (waking the parked thread does not start the delay for it)."""
    exporter = _Counting()
    environ = {"OTEL_BSP_SCHEDULE_DELAY": "600000", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1"}
    tracing = Tracing(SERVICE_COORDINATOR, exporter=exporter, environ=environ)
    try:
        await until(lambda: tracing._parked)
        tracing.record("fleetwire.queue", SAMPLED, 1, 2)
        await until(lambda: len(exporter.spans) == 1, timeout_s=10.0)
    finally:
        tracing.shutdown()


def test_shutdown_stops_a_parked_thread_and_exports_what_is_queued() -> None:
    """A tracer whose thread is parked shuts down at once; a span noted just before is exported."""
    exporter = _Counting()
    tracing = Tracing(SERVICE_COORDINATOR, exporter=exporter, environ={"OTEL_BSP_SCHEDULE_DELAY": "600000"})
    tracing.record("fleetwire.queue", SAMPLED, 1, 2)
    tracing.shutdown()
    assert not tracing._thread.is_alive() and len(exporter.spans) == 1
