"""The worker's relay end and stream ids (issue #25 part 12): it echoes each stream's id and drops an older one's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from protocol.messages import DataChunk, DataCredit, DataEnd, DataOpen
from protocol.relay import MAX_CHUNK_BYTES
from tests.integration.data_helpers import digest
from tests.unit.test_relay_worker import relay_endpoint, ticket

DATA = bytes(range(256)) * (3 * MAX_CHUNK_BYTES // 256)


async def test_an_upload_echoes_its_stream_id_on_every_credit_and_its_end(tmp_path: Path) -> None:
    """The first credit, the quarter-window credits and the end name the id the open gave."""
    relay = relay_endpoint(tmp_path)
    data = b"a" * 100
    relay.on_message(DataOpen(plan_id="p1", attempt=1, name="x", ticket=ticket("x", len(data), digest(data)),
                              stream=9))
    relay.on_message(DataChunk(plan_id="p1", attempt=1, name="x", offset=0, data=data, stream=9))
    sent: list[Any] = relay.sent
    assert [type(m) for m in sent] == [DataCredit, DataEnd] and {m.stream for m in sent} == {9}
    assert sent[-1].code == ""


async def test_a_download_echoes_its_stream_id_and_ignores_an_older_streams_credit_and_end(tmp_path: Path) -> None:
    """Reopened at once: the old stream's late credit and end do not move or close the new one."""
    relay = relay_endpoint(tmp_path)
    relay.spool.add_output("p1", 1, "out", DATA)
    get = ticket("out", -1, "", direction="get")
    relay.on_message(DataOpen(plan_id="p1", attempt=1, name="out", direction="get", ticket=get,
                              credit=MAX_CHUNK_BYTES, stream=1))
    relay.on_message(DataOpen(plan_id="p1", attempt=1, name="out", direction="get", ticket=get,
                              credit=MAX_CHUNK_BYTES, offset=MAX_CHUNK_BYTES, stream=2))
    sent: list[Any] = relay.sent
    assert [(m.offset, m.stream) for m in sent] == [(0, 1), (MAX_CHUNK_BYTES, 2)]
    sent.clear()
    relay.on_message(DataEnd(plan_id="p1", attempt=1, name="out", direction="get", code="cancelled", stream=1))
    relay.on_message(DataCredit(plan_id="p1", attempt=1, name="out", direction="get", offset=2 * MAX_CHUNK_BYTES,
                                stream=1))
    assert sent == []  # nothing moved on the old stream's word
    relay.on_message(DataCredit(plan_id="p1", attempt=1, name="out", direction="get", offset=2 * MAX_CHUNK_BYTES,
                                stream=2))
    assert [(m.offset, m.stream, m.last) for m in sent] == [(2 * MAX_CHUNK_BYTES, 2, True)]
