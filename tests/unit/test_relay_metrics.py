"""The relay's counters in the core (bytes by direction, credit stalls, refusals) and their /metrics families."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from coordinator.io.ops.metrics import build_registry, render
from protocol.messages import DataChunk, DataCredit, DataOpen
from protocol.relay import MAX_CHUNK_BYTES
from tests.unit.test_core import Harness
from tests.unit.test_relay_core import CHUNK, WINDOW, chunk, placed, put_open


def scrape(h: Harness) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = render(build_registry(h.core, process=False)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_relayed_input_counts_bytes_in_and_a_stall_each_time_the_window_fills() -> None:
    """Four chunks fill the window (one stall); credit for two and two more fill it again (a second)."""
    h = Harness(relay_window_bytes=WINDOW)  # four chunks
    client = h.client()
    worker, plan_id = placed(h, "w1", client)
    put_open(h, client, worker, plan_id)
    for i in range(3):
        h.send(client, chunk(plan_id, i * MAX_CHUNK_BYTES))
    assert h.core.relay.credit_stalls == 0  # room for one more chunk
    h.send(client, chunk(plan_id, 3 * MAX_CHUNK_BYTES))
    assert h.core.relay.credit_stalls == 1
    h.send(worker, DataCredit(plan_id=plan_id, attempt=1, name="x", offset=2 * MAX_CHUNK_BYTES))
    h.send(client, chunk(plan_id, WINDOW))
    h.send(client, chunk(plan_id, WINDOW + MAX_CHUNK_BYTES))
    relay = h.core.relay
    assert (relay.bytes_in, relay.bytes_out, relay.credit_stalls) == (6 * MAX_CHUNK_BYTES, 0, 2)
    samples = scrape(h)
    assert samples[("fleetwire_relay_bytes_total", (("direction", "in"),))] == 6 * MAX_CHUNK_BYTES
    assert samples[("fleetwire_relay_bytes_total", (("direction", "out"),))] == 0
    assert samples[("fleetwire_relay_streams", ())] == 1
    assert samples[("fleetwire_relay_in_flight_bytes", ())] == WINDOW
    assert samples[("fleetwire_relay_credit_stalls_total", ())] == 2


def test_relayed_output_counts_bytes_out_and_the_stream_closes_after_the_last_chunk() -> None:
    """A get's chunks count as bytes out; its last chunk is no stall; the open-streams gauge goes back to 0."""
    h = Harness()
    client = h.client()
    worker, plan_id = placed(h, "w1", client, outputs=["out"])
    h.send(client, DataOpen(plan_id=plan_id, attempt=1, name="out", direction="get", offset=0))
    size = 2 * MAX_CHUNK_BYTES
    h.send(worker, DataChunk(plan_id=plan_id, attempt=1, name="out", offset=0, data=CHUNK, direction="get",
                             size=size))
    h.send(worker, DataChunk(plan_id=plan_id, attempt=1, name="out", offset=MAX_CHUNK_BYTES, data=CHUNK,
                             direction="get", size=size, last=True))
    samples = scrape(h)
    assert samples[("fleetwire_relay_bytes_total", (("direction", "out"),))] == size
    assert samples[("fleetwire_relay_bytes_total", (("direction", "in"),))] == 0
    assert samples[("fleetwire_relay_streams", ())] == 0
    assert samples[("fleetwire_relay_credit_stalls_total", ())] == 0


def test_refused_open_is_counted() -> None:
    """An open for an input the plan never declared is refused and counted in fleetwire_relay_refused_total."""
    h = Harness()
    client = h.client()
    _worker, plan_id = placed(h, "w1", client)
    h.send(client, DataOpen(plan_id=plan_id, attempt=1, name="nope", ticket="t"))
    assert scrape(h)[("fleetwire_relay_refused_total", ())] == 1


def test_streams_in_line_and_idle_ends_are_exported() -> None:
    """fleetwire_relay_waiting_streams counts the streams in line; fleetwire_relay_idle_ends_total the idle ends."""
    h = Harness(relay_window_bytes=WINDOW, relay_session_bytes=WINDOW, relay_idle_s=5.0)
    client = h.client()
    (w1, p1), (w2, p2) = placed(h, "w1", client), placed(h, "w2", client)
    put_open(h, client, w1, p1)
    h.send(client, DataOpen(plan_id=p2, attempt=1, name="x"))
    h.send(w2, DataCredit(plan_id=p2, attempt=1, name="x", offset=0, size=8 * MAX_CHUNK_BYTES))
    assert scrape(h)[("fleetwire_relay_waiting_streams", ())] == 1
    h.tick(1.0)
    h.tick(6.0)  # the first stream idle: its window goes to the second
    samples = scrape(h)
    assert samples[("fleetwire_relay_waiting_streams", ())] == 0
    assert samples[("fleetwire_relay_idle_ends_total", ())] == 1
