"""``--openai-durable``: whether the OpenAI door's plans are written to the store (docs/OPENAI.md §Durability).

A real coordinator on SQLite with one worker agent fronting a fake engine, over loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

from coordinator.io.frontdoor.server import ServerSettings
from coordinator.io.stores.sqlite import SQLiteStore
from fleetwire import Client
from tests.integration.test_openai_door import CLIENT_TOKEN, MODEL, SETTINGS, start_fleet, stop_fleet
from tests.waiting import until as wait_until

pytestmark = pytest.mark.timeout(60)


async def streamed(port: int, text: str) -> tuple[str, str]:
    """One streamed chat request by raw HTTP: the plan id of its answer and the answer's text."""
    body = json.dumps({"model": MODEL, "stream": True, "messages": [{"role": "user", "content": text}]}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                     b"Authorization: Bearer " + CLIENT_TOKEN.encode() + b"\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
        answer = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), answer[:300]
    plan_id = next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                   if line.lower().startswith(b"x-fleetwire-plan-id:"))  # fmt: skip
    return plan_id, rest.decode()


async def door_and_sdk_plans(settings: ServerSettings) -> tuple[str, str, int, int]:
    """A streamed door request and an SDK plan: their plan ids, and the commit batches each one's steps made."""
    fleet = await start_fleet(settings, engines=1)
    try:
        committer = fleet.server.driver.committer
        before = committer.submitted
        door_plan, text = await streamed(fleet.server.port, "one two")
        assert "data: [DONE]" in text
        door_batches = committer.submitted - before
        async with Client(fleet.server.url, token=CLIENT_TOKEN) as client:
            before = committer.submitted
            plan = await client.submit("generate", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                                       requirements={"model": MODEL})  # fmt: skip
            await plan.result()
            sdk_batches = committer.submitted - before
    finally:
        await stop_fleet(fleet)
    return door_plan, plan.id, door_batches, sdk_batches


def stored_ids(data_dir: Path) -> set[str]:
    store = SQLiteStore(data_dir / "coordinator.sqlite3")
    try:
        return {stored.created.plan_id for stored in store.load()}
    finally:
        store.close()


def sqlite_settings(tmp_path: Path, **changes: object) -> ServerSettings:
    # No reaper tick in the test's time: a tick's usage rows would be a commit batch of their own.
    return replace(SETTINGS, store="sqlite", data_dir=str(tmp_path), reaper_interval_s=3600.0, **changes)


async def test_durable_off_writes_no_door_plan_and_its_steps_wait_for_no_commit(tmp_path: Path) -> None:
    """--openai-durable off: a door request's plan makes no commit batch and is not in the store; an SDK plan is."""
    door_plan, sdk_plan, door_batches, sdk_batches = await door_and_sdk_plans(
        sqlite_settings(tmp_path, openai_durable=False))
    assert door_batches == 0
    assert sdk_batches > 0
    ids = stored_ids(tmp_path)
    assert sdk_plan in ids and door_plan not in ids


async def test_durable_on_records_the_door_plan_before_it_is_answered(tmp_path: Path) -> None:
    """--openai-durable on (the default): the door's plan is committed as any plan's and is in the store."""
    door_plan, sdk_plan, door_batches, _ = await door_and_sdk_plans(sqlite_settings(tmp_path))
    assert door_batches > 0
    assert {door_plan, sdk_plan} <= stored_ids(tmp_path)


async def test_durable_off_a_stream_cut_mid_way_leaves_no_plan_and_the_store_writes_on(tmp_path: Path) -> None:
    """--openai-durable off: a client gone mid-stream cancels its plan and the id is let go; the next request
    is answered, and neither plan is stored."""
    fleet = await start_fleet(sqlite_settings(tmp_path, openai_durable=False), engines=1, token_delay_s=0.05)
    try:
        port, core = fleet.server.port, fleet.server.core
        body = json.dumps({"model": MODEL, "stream": True,
                           "messages": [{"role": "user", "content": " ".join(["w"] * 200)}]}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                     + CLIENT_TOKEN.encode() + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        head = await reader.readuntil(b"\r\n\r\n")
        cut = next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                   if line.lower().startswith(b"x-fleetwire-plan-id:"))  # fmt: skip
        writer.close()
        await wait_until(lambda: core.plans[cut].state == "cancelled", timeout_s=10)
        await wait_until(lambda: fleet.engines[0].running == 0, timeout_s=10)
        assert not fleet.server.driver.volatile
        fleet.engines[0].token_delay_s = 0.0
        answered, text = await streamed(port, "after")
        assert "data: [DONE]" in text
    finally:
        await stop_fleet(fleet)
    assert not {cut, answered} & stored_ids(tmp_path)
