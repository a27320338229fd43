"""The data plane over loopback: the worker's data endpoint (real sockets, real spool) and the
SDK's direct transfers through a real coordinator and agent in this process."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from coordinator.io.frontdoor.server import CoordinatorServer
from fleetwire import Client, PlanFailed
from protocol.messages import DataKey
from protocol.tickets import FileClaim, TicketClaims, sign, worker_key
from tests.integration.data_helpers import CLIENT_TOKEN, coordinator_and_data_worker, digest
from worker_agent.agent import Agent
from worker_agent.dataplane import DataServer
from worker_agent.spool import Spool

pytestmark = pytest.mark.timeout(60)

MASTER = b"m" * 32
WORKER = "w1"



def ticket(name: str, size: int, digest: str, *, direction: str = "put", plan: str = "p1", attempt: int = 1,
           worker: str = WORKER, exp: float | None = None, key: bytes = MASTER, signer: str = WORKER) -> str:
    claims = TicketClaims(plan, attempt, worker, direction, {name: FileClaim(size, digest)},  # type: ignore[arg-type]
                          exp if exp is not None else time.time() + 60)
    return sign(claims, "k1", worker_key(key, signer))


@pytest.fixture
async def endpoint(tmp_path: Path) -> AsyncIterator[DataServer]:
    spool = Spool(tmp_path / "spool", memory_bytes=1024, capacity_bytes=64 << 20)
    server = DataServer(spool, worker_id=WORKER, stall_timeout_s=0.5)
    server.set_keys([DataKey(kid="k1", key=worker_key(MASTER, WORKER))])
    await server.start()
    yield server
    await server.close()


def input_url(server: DataServer, name: str, plan: str = "p1", attempt: int = 1) -> str:
    return f"{server.url}/v1/data/{plan}/{attempt}/inputs/{name}"


async def raw_request(server: DataServer, head: str, body: bytes = b"") -> tuple[str, bytes]:
    """Send a request head (and maybe part of a body) on a fresh socket; the status line and the rest."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(head.encode() + body)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    return answer.split(b"\r\n", 1)[0].decode(), answer


# --------------------------------------------------------------------------- the endpoint


async def test_upload_without_ticket_is_401_before_the_body_is_read(endpoint: DataServer) -> None:
    """A PUT with no ticket is answered 401 from its head alone, although the body never comes."""
    head = f"PUT /v1/data/p1/1/inputs/x HTTP/1.1\r\nHost: h\r\nContent-Length: {1 << 30}\r\n\r\n"
    status, _ = await raw_request(endpoint, head)
    assert status.startswith("HTTP/1.1 401")
    assert endpoint.spool.input("p1", 1, "x") is None


@pytest.mark.parametrize(
    ("kwargs", "status"),
    [
        ({"key": b"forged-key-000000000000000000000"}, 401),
        ({"exp": 1.0}, 401),
        ({"plan": "other"}, 403),
        ({"attempt": 2}, 403),
        ({"worker": "w2", "signer": "w2"}, 401),  # another worker's key
        ({"worker": "w2"}, 403),
        ({"direction": "get"}, 403),
    ],
)
async def test_bad_tickets_are_refused_without_reading_the_body(
    endpoint: DataServer, kwargs: dict[str, Any], status: int
) -> None:
    """Forged, expired and foreign tickets get 401/403 while a 1 GiB body is still unsent."""
    t = ticket("x", 1 << 30, digest(b""), **kwargs)
    head = (f"PUT /v1/data/p1/1/inputs/x HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer {t}\r\n"
            f"Content-Length: {1 << 30}\r\n\r\n")
    line, _ = await raw_request(endpoint, head)
    assert line.startswith(f"HTTP/1.1 {status}")
    assert endpoint.spool.input("p1", 1, "x") is None


@pytest.mark.parametrize("name", ["a%2Fb", "..", "a..b", "a%00b", "x" * 256])
async def test_bad_names_are_refused(endpoint: DataServer, name: str) -> None:
    """Names with '/', '..', NUL or over 255 bytes are refused with 400."""
    head = f"GET /v1/data/p1/1/inputs/{name} HTTP/1.1\r\nHost: h\r\n\r\n"
    line, answer = await raw_request(endpoint, head)
    assert line.startswith("HTTP/1.1 400"), answer


async def test_upload_resumes_from_the_acknowledged_offset(endpoint: DataServer) -> None:
    """A dropped upload keeps what arrived; HEAD tells the offset and a PUT from there completes it."""
    data = bytes(range(256)) * 8192  # 2 MiB: spooled to a file
    t = ticket("x", len(data), digest(data))
    head = (f"PUT /v1/data/p1/1/inputs/x HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer {t}\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    _reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    writer.write(head.encode() + data[: 1 << 20])
    await writer.drain()
    entry = None
    for _ in range(200):  # wait for the server to take the first MiB
        entry = endpoint.spool.input("p1", 1, "x")
        if entry is not None and entry.received == 1 << 20:
            break
        await asyncio.sleep(0.01)
    writer.close()  # the connection drops mid-upload
    async with httpx.AsyncClient() as http:
        auth = {"Authorization": f"Bearer {t}"}
        await endpoint.wait_no_uploads(2.0)
        head_answer = await http.head(input_url(endpoint, "x"), headers=auth)
        offset = int(head_answer.headers["upload-offset"])
        assert offset == 1 << 20
        wrong = await http.put(input_url(endpoint, "x"), content=data[5:10], headers={
            **auth, "Content-Range": f"bytes 5-9/{len(data)}"})
        assert wrong.status_code == 409
        done = await http.put(input_url(endpoint, "x"), content=data[offset:], headers={
            **auth, "Content-Range": f"bytes {offset}-{len(data) - 1}/{len(data)}"})
        assert done.status_code == 201, done.text
    entry = endpoint.spool.input("p1", 1, "x")
    assert entry is not None and entry.state == "verified"
    assert entry.path is not None and entry.path.read_bytes() == data


async def test_digest_mismatch_fails_the_input_naming_it(endpoint: DataServer) -> None:
    """Bytes whose digest differs from the declared one: 409 from offset 0 (taken for damage in transit) twice,
    then 422, and the input fails naming it."""
    t = ticket("weights", 4, digest(b"abcd"))
    async with httpx.AsyncClient() as http:
        auth = {"Authorization": f"Bearer {t}"}
        for retry in (1, 2):
            again = await http.put(input_url(endpoint, "weights"), content=b"abce", headers=auth)
            assert again.status_code == 409 and again.headers["upload-offset"] == "0"
            assert again.json()["restart"] == retry and "weights" in again.json()["error"]
        answer = await http.put(input_url(endpoint, "weights"), content=b"abce", headers=auth)
    assert answer.status_code == 422
    assert "weights" in answer.json()["error"]
    entry = endpoint.spool.input("p1", 1, "weights")
    assert entry is not None and entry.state == "failed" and entry.error is not None
    assert entry.error.code == "input_mismatch"


async def test_size_mismatch_is_refused(endpoint: DataServer) -> None:
    """A body longer than the declared size is refused 413 before it is read; a wrong total 422."""
    t = ticket("x", 4, digest(b"abcd"))
    async with httpx.AsyncClient() as http:
        auth = {"Authorization": f"Bearer {t}"}
        long = await http.put(input_url(endpoint, "x"), content=b"abcdef", headers=auth)
        wrong_total = {**auth, "Content-Range": "bytes 0-1/9"}
        total = await http.put(input_url(endpoint, "x"), content=b"ab", headers=wrong_total)
    assert long.status_code == 413
    assert total.status_code == 422


async def test_stalled_upload_is_dropped_and_its_memory_freed(endpoint: DataServer) -> None:
    """An upload that stops sending is dropped after the stall timeout, keeping its acknowledged bytes."""
    data = b"z" * 4096
    t = ticket("x", len(data), digest(data))
    head = (f"PUT /v1/data/p1/1/inputs/x HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer {t}\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    writer.write(head.encode() + data[:100])
    await writer.drain()
    closed = await asyncio.wait_for(reader.read(), 5)  # the server closes the stalled connection
    assert closed == b""
    assert endpoint.open_uploads == 0
    entry = endpoint.spool.input("p1", 1, "x")
    assert entry is not None and entry.received == 100 and entry.state == "receiving"
    writer.close()


async def test_disk_full_while_spooling_fails_the_input_not_the_worker(endpoint: DataServer) -> None:
    """An input over the spool's room fails worker_disk_full (507); the endpoint keeps serving."""
    size = 128 << 20  # over the 64 MiB capacity
    t = ticket("big", size, digest(b""))
    async with httpx.AsyncClient() as http:
        auth = {"Authorization": f"Bearer {t}"}
        answer = await http.put(input_url(endpoint, "big"), content=b"x" * 10,
                                headers={**auth, "Content-Range": f"bytes 0-9/{size}"})
        assert answer.status_code == 507
        small = ticket("small", 3, digest(b"abc"))
        ok = await http.put(input_url(endpoint, "small"), content=b"abc", headers={"Authorization": f"Bearer {small}"})
    assert ok.status_code == 201
    entry = endpoint.spool.input("p1", 1, "big")
    assert entry is not None and entry.error is not None and entry.error.code == "worker_disk_full"


async def test_output_download_with_range(endpoint: DataServer) -> None:
    """An output is served whole (200) and from an offset (206), and only with a get ticket."""
    endpoint.spool.add_output("p1", 1, "out", b"0123456789")
    t = ticket("out", -1, "", direction="get")
    url = f"{endpoint.url}/v1/data/p1/1/outputs/out"
    async with httpx.AsyncClient() as http:
        whole = await http.get(url, headers={"Authorization": f"Bearer {t}"})
        part = await http.get(url, headers={"Authorization": f"Bearer {t}", "Range": "bytes=4-"})
        put_ticket = await http.get(url, headers={"Authorization": f"Bearer {ticket('out', 10, digest(b''))}"})
    assert whole.status_code == 200 and whole.content == b"0123456789"
    assert part.status_code == 206 and part.content == b"456789"
    assert put_ticket.status_code == 403


# --------------------------------------------------------------------------- SDK <-> coordinator <-> agent


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[CoordinatorServer, Agent]]:
    async with coordinator_and_data_worker(tmp_path, {"digest": sha256_of_data}, python_allow=["tests.*"]) as fleet:
        yield fleet


async def sha256_of_data(ctx: Any, args: Any) -> dict[str, Any]:
    """Input ``data`` read chunk by chunk and hashed (sha256) by the handler itself; its first 16 bytes upper-cased
    as output ``upper``."""
    source = ctx.inputs["data"]
    hasher, size = hashlib.sha256(), 0
    async for chunk in source:
        hasher.update(chunk)
        size += len(chunk)
    ctx.output("upper", source.path.read_bytes()[:16].upper())
    return {"size": size, "digest": f"sha256:{hasher.hexdigest()}", "declared": source.digest}


async def test_sdk_uploads_inputs_and_fetches_outputs_direct(cluster: tuple[CoordinatorServer, Agent]) -> None:
    """A 3 MiB input goes client -> worker direct, is verified before the handler, and an output comes back."""
    server, _agent = cluster
    data = bytes(range(256)) * (3 * 4096)
    async with Client(server.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("digest", inputs={"data": data}, outputs=["upper"])
        result = await asyncio.wait_for(plan.result(), 20)
        kinds = [event.kind async for event in plan.events()]
        assert await plan.output("upper") == data[:16].upper()
    # the handler's own sha256 of what it read, beside the (blake3) digest the SDK declared
    own = f"sha256:{hashlib.sha256(data).hexdigest()}"
    assert result == {"size": len(data), "digest": own, "declared": digest(data)}
    assert kinds.index("data_ready") < kinds.index("input_received") < kinds.index("succeeded")


async def test_bad_input_name_is_refused_at_submit(cluster: tuple[CoordinatorServer, Agent]) -> None:
    """A name with '/' is refused by the SDK before anything is sent."""
    server, _agent = cluster
    async with Client(server.url, token=CLIENT_TOKEN) as client:
        with pytest.raises(ValueError, match="plain file name"):
            await client.submit("digest", inputs={"a/b": b"x"})


async def test_python_op_gets_inputs_as_a_keyword_and_leaves_outputs(cluster: tuple[CoordinatorServer, Agent],
                                                                     tmp_path: Path) -> None:
    """The python op passes the plan's inputs to a function with an ``inputs`` parameter, verified before the call;
    what it leaves with ``ctx.output`` comes back."""
    server, _agent = cluster
    data = bytes(range(256)) * 4096
    source = tmp_path / "input.bin"
    source.write_bytes(data)
    args = {"function": "tests.integration.data_helpers:python_reverse", "args": ["!"]}
    async with Client(server.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("python", args, inputs={"data": source}, outputs=["reversed"])
        result = await asyncio.wait_for(plan.result(), 20)
        assert result == {"names": ["data"], "size": len(data), "digest": digest(data)}
        assert await plan.output("reversed") == data[::-1] + b"!"


async def test_input_never_uploaded_fails_inputs_unavailable(tmp_path: Path) -> None:
    """A plan whose inputs never arrive fails inputs_unavailable after the worker's input timeout."""
    fleet = coordinator_and_data_worker(tmp_path, {"digest": sha256_of_data}, input_timeout_s=1.0)  # not the 5 s
    async with fleet as (server, _agent), Client(server.url, token=CLIENT_TOKEN) as client:
        client.transport = NeverUploads()
        plan = await client.submit("digest", inputs={"data": b"abc"})
        with pytest.raises(PlanFailed) as failed:
            await asyncio.wait_for(plan.result(), 20)
    assert failed.value.code == "inputs_unavailable"
    assert "data" in failed.value.message


async def test_a_stopping_worker_hands_back_a_plan_no_input_byte_reached(tmp_path: Path) -> None:
    """Stopping (a 60 s drain), the worker does not wait for a plan whose inputs never began to arrive: it hands
    the plan back at once (requeued, its handler never started) and leaves."""
    started = asyncio.Event()

    async def never_runs(ctx: Any, args: Any) -> None:
        started.set()

    fleet = coordinator_and_data_worker(tmp_path, {"digest": never_runs}, input_timeout_s=60.0, drain_timeout_s=60.0)
    async with fleet as (server, agent), Client(server.url, token=CLIENT_TOKEN) as client:
        client.transport = NeverUploads()
        plan = await client.submit("digest", inputs={"data": b"abc"})
        async for event in plan.events():
            if event.kind == "running":
                break
        agent.stop()

        async def requeued() -> str:
            async for event in plan.events():
                if event.kind == "requeued":
                    return str(event.data["reason"])
            return ""

        # well inside the drain timeout: nothing held the stop, and the worker left
        assert "w1 left and handed it back" in await asyncio.wait_for(requeued(), 10)
        assert server.core.plans[plan.id].state == "queued" and not started.is_set()


class NeverUploads:
    """A client's transport that never delivers: its uploads cannot get through, or it went away before them."""

    async def upload(self, grant: Any, source: Any) -> None:
        await asyncio.Event().wait()

    async def download(self, grant: Any, name: str) -> AsyncIterator[bytes]:
        raise AssertionError("not used")
        yield b""

    async def aclose(self) -> None:
        pass
