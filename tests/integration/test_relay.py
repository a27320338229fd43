"""The relay over loopback: a real coordinator and agent in this process, inputs and outputs carried through
the coordinator (docs/PROTOCOL.md §11 Relay), and args and results over the frame limit."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import threading
from pathlib import Path
from typing import Any

import pytest
import trustme

from coordinator.io.frontdoor.server import CoordinatorServer
from fleetwire import Client, FleetwireConnectionError
from fleetwire.data import DataTransferError, Grant
from fleetwire.direct import DirectTransport
from fleetwire.inputs import prepare_inputs
from protocol import errors
from tests.integration.data_helpers import CLIENT_TOKEN, coordinator_and_data_worker, digest
from worker_agent.agent import Agent

pytestmark = pytest.mark.timeout(60)

SIZE = 3 << 20  # 3 MiB



async def reverse(ctx: Any, args: Any) -> dict[str, Any]:
    data = ctx.inputs["data"].path.read_bytes()
    ctx.output("reversed", data[::-1])
    return {"size": len(data), "digest": digest(data), "inputs": sorted(ctx.inputs)}


async def measure(ctx: Any, args: Any) -> dict[str, Any]:
    return {"blob": len(args["blob"]), "digest": digest(args["blob"]), "inputs": sorted(ctx.inputs)}


async def produce(ctx: Any, args: Any) -> Any:
    return bytes(range(256)) * (args["size"] // 256)


def running(tmp_path: Path, server_options: dict[str, Any] | None = None,
            **agent_options: Any) -> contextlib.AbstractAsyncContextManager[tuple[CoordinatorServer, Agent]]:
    """The relay's fleet: worker w1 with no data endpoint unless ``agent_options`` give it one."""
    options = {"data_listen": None, "input_timeout_s": 10.0, **agent_options}
    handlers = {"reverse": reverse, "measure": measure, "produce": produce}
    return coordinator_and_data_worker(tmp_path, handlers, server_options=server_options, **options)


def received_via(plan: Any) -> dict[str, str]:
    return {e.data["name"]: e.data["via"] for e in plan._stream.events if e.kind == "input_received"}


async def test_worker_without_data_endpoint_gets_inputs_and_returns_outputs_relayed(tmp_path: Path) -> None:
    """No --data-listen: a 3 MiB input reaches the handler through the coordinator and a 3 MiB output comes back."""
    data = bytes(range(256)) * (SIZE // 256)
    async with running(tmp_path) as (server, agent), Client(server.url, token=CLIENT_TOKEN) as client:
        assert agent.data_server is None
        plan = await client.submit("reverse", inputs={"data": data}, outputs=["reversed"])
        result = await asyncio.wait_for(plan.result(), 30)
        assert result == {"size": SIZE, "digest": digest(data), "inputs": ["data"]}
        assert await asyncio.wait_for(plan.output("reversed"), 30) == data[::-1]
        target = await asyncio.wait_for(plan.output_to("reversed", tmp_path / "out.bin"), 30)
        assert target.read_bytes() == data[::-1]
        assert received_via(plan) == {"data": "relay"}
        assert plan.uploads is not None
        await asyncio.wait_for(plan.uploads.task, 10)
        assert plan.transfers == {("put", "data"): "relay", ("get", "reversed"): "relay"}
        relay = server.core.relay
        assert relay.streams == {} and relay.reserved == 0 and relay.bytes_relayed >= 3 * SIZE


async def test_relayed_bytes_over_wss_arrive_whole_both_ways(tmp_path: Path) -> None:
    """TLS on both of the relay's hops: random bytes in 512 KiB chunk frames (written past the websockets
    library's serializer, wireio/wsbulk.py) go client -> coordinator -> worker and back, intact."""
    ca = trustme.CA()
    cert, ca_file = tmp_path / "server.pem", tmp_path / "ca.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(cert))
    ca.cert_pem.write_to_path(str(ca_file))
    data = os.urandom(SIZE + 12345)
    tls = {"tls_cert": str(cert), "tls_key": str(cert)}
    async with running(tmp_path, tls, ca_file=str(ca_file)) as (server, _agent):
        assert server.url.startswith("wss://")
        async with Client(server.url, token=CLIENT_TOKEN, ca_file=str(ca_file)) as client:
            plan = await client.submit("reverse", inputs={"data": data}, outputs=["reversed"])
            result = await asyncio.wait_for(plan.result(), 30)
            assert result == {"size": len(data), "digest": digest(data), "inputs": ["data"]}
            assert await asyncio.wait_for(plan.output("reversed"), 30) == data[::-1]
            assert received_via(plan) == {"data": "relay"}


async def test_direct_path_over_https_with_the_clients_ca_file(tmp_path: Path) -> None:
    """--data-tls-cert: the worker's data endpoint serves https, advertised as such; a client that trusts the CA
    (``ca_file``, as for wss://) uploads and downloads direct, intact; one that does not falls back to the relay."""
    ca = trustme.CA()
    cert, ca_file = tmp_path / "data.pem", tmp_path / "ca.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(cert))
    ca.cert_pem.write_to_path(str(ca_file))
    data = os.urandom(SIZE + 12345)
    options = {"data_listen": "127.0.0.1:0", "data_tls_cert": str(cert), "data_tls_key": str(cert)}
    async with running(tmp_path, None, **options) as (server, agent):
        assert agent.data_server is not None and agent.data_server.url.startswith("https://127.0.0.1:")
        async with Client(server.url, token=CLIENT_TOKEN, ca_file=str(ca_file)) as client:
            plan = await client.submit("reverse", inputs={"data": data}, outputs=["reversed"])
            assert (await asyncio.wait_for(plan.result(), 30))["digest"] == digest(data)
            assert await asyncio.wait_for(plan.output("reversed"), 30) == data[::-1]
            assert plan.transfers == {("put", "data"): "direct", ("get", "reversed"): "direct"}
        async with Client(server.url, token=CLIENT_TOKEN) as untrusting:  # the system CAs: not this one
            plan = await untrusting.submit("reverse", inputs={"data": data[:1000]}, outputs=["reversed"])
            assert (await asyncio.wait_for(plan.result(), 30))["digest"] == digest(data[:1000])
            assert received_via(plan) == {"data": "relay"}


async def test_an_untrusted_data_certificate_fails_the_direct_path_at_once(tmp_path: Path) -> None:
    """A certificate that does not verify is not retried with backoff (nine tries, ~8 s, before the relay took
    over): one TLS handshake, then DataTransferError, for an upload and for a download."""
    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_tls)
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = 0

    def serve() -> None:  # counts TCP connections; each handshake fails on the client's side
        nonlocal accepted
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted += 1
            with contextlib.suppress(OSError), conn, server_tls.wrap_socket(conn, server_side=True):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    grant = Grant("p1", 1, f"https://127.0.0.1:{listener.getsockname()[1]}", "ticket", "ticket")
    transport = DirectTransport()  # the system CAs: not this one
    try:
        source = (await prepare_inputs({"x": b"abc"}))["x"]
        with pytest.raises(DataTransferError, match="CERTIFICATE_VERIFY_FAILED"):
            await transport.upload(grant, source)
        assert accepted == 1
        with pytest.raises(DataTransferError, match="CERTIFICATE_VERIFY_FAILED"):
            await transport.download_to(grant, "out", tmp_path / "out.bin")
        assert accepted == 2
    finally:
        await transport.aclose()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not)
        listener.close()
        thread.join(10)
        assert not thread.is_alive()


async def test_relay_on_request_even_with_a_data_endpoint(tmp_path: Path) -> None:
    """submit(relay=True) carries the bytes through the coordinator though the worker could be dialled."""
    data = b"abc" * 1000
    async with running(tmp_path, data_listen="127.0.0.1:0") as (server, _agent):
        async with Client(server.url, token=CLIENT_TOKEN) as client:
            plan = await client.submit("reverse", inputs={"data": data}, outputs=["reversed"], relay=True)
            await asyncio.wait_for(plan.result(), 30)
            assert await plan.output("reversed") == data[::-1]
            assert received_via(plan) == {"data": "relay"}
            direct = await client.submit("reverse", inputs={"data": data}, outputs=["reversed"])
            await asyncio.wait_for(direct.result(), 30)
            assert await direct.output("reversed") == data[::-1]
            assert received_via(direct) == {"data": "direct"}
            assert direct.uploads is not None
            await asyncio.wait_for(direct.uploads.task, 10)  # its upload may finish after the plan does
            assert direct.transfers == {("put", "data"): "direct", ("get", "reversed"): "direct"}


async def test_unreachable_data_endpoint_falls_back_to_the_relay(tmp_path: Path) -> None:
    """A worker advertising an address nobody listens on: the SDK's dial fails and the relay carries the bytes."""
    data = b"xyz" * 50_000
    options = {"data_listen": "127.0.0.1:0", "data_advertise": "http://127.0.0.1:9"}  # port 9: nothing there
    async with running(tmp_path, None, **options) as (server, _agent), Client(server.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("reverse", inputs={"data": data}, outputs=["reversed"])
        assert (await asyncio.wait_for(plan.result(), 30))["digest"] == digest(data)
        assert await plan.output("reversed") == data[::-1]
        assert received_via(plan) == {"data": "relay"}
        assert plan.uploads is not None
        await asyncio.wait_for(plan.uploads.task, 10)
        assert plan.transfers == {("put", "data"): "relay", ("get", "reversed"): "relay"}


async def test_oversize_args_move_to_the_data_plane_instead_of_closing_the_session(tmp_path: Path) -> None:
    """A 2 MiB args submit succeeds, the handler sees the args as given, and the session stays up."""
    blob = bytes(range(256)) * (8 << 10)  # 2 MiB
    async with running(tmp_path) as (server, _agent), Client(server.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("measure", args={"blob": blob})
        result = await asyncio.wait_for(plan.result(), 30)
        assert result == {"blob": len(blob), "digest": digest(blob), "inputs": []}
        assert not client.closed
        assert (await client.submit("echo", args=1)).id  # the same session goes on
        assert server.core.plans[plan.id].args is None


async def test_oversize_submit_without_the_move_closes_the_session_1009(tmp_path: Path) -> None:
    """What a raw peer still gets (and the SDK did before): the 2 MiB frame closes the session with 1009."""
    blob = b"b" * (2 << 20)
    async with running(tmp_path) as (server, _agent):
        client = Client(server.url, token=CLIENT_TOKEN, reconnect=False)
        await client.connect()
        client.max_inline_bytes = 1 << 30  # as if the SDK did not move the args
        with pytest.raises(FleetwireConnectionError) as closed:
            await asyncio.wait_for(client.submit("measure", args={"blob": blob}), 30)
        await client.close()
    assert str(errors.CLOSE_TOO_BIG) in str(closed.value)


async def test_oversize_result_is_fetched_by_result(tmp_path: Path) -> None:
    """A handler returning 2 MiB: the plan succeeds and plan.result() fetches it from the worker (relayed here)."""
    size = 2 << 20
    async with running(tmp_path) as (server, _agent), Client(server.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("produce", args={"size": size})
        result = await asyncio.wait_for(plan.result(), 30)
        assert result == bytes(range(256)) * (size // 256)
        assert await plan.result() is result  # fetched once
        assert server.core.plans[plan.id].result is None
