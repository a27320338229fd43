"""The SDK's client keeps a coordinator whose reply waits on others, past the first reply's bound (loopback).

A cluster's view session (a main port's client session naming no pool: coordinator/io/cluster/sessions.py) answers
``list_workers`` only once the owners wrote fresh registry rows (up to 3 x ``--lease-renew``) and a ``cancel`` only
once the shard's owner answered the forward, in the order its requests came. The client bounds the first reply on a
connection by the dial's timeout (fleetwire/connection.py ``FirstReply``): the first frame on a connection is a probe
(an ``unsubscribe`` of nothing) that the view session answers at once, so a healthy coordinator that takes longer than
the bound over a request is not left (and the next one after it, again and again).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from fleetwire import Client
from fleetwire.connection import first_probe
from protocol import ENCODING_SUBPROTOCOL
from protocol.messages import FromClient, ListWorkers, Ok, Unsubscribe, Workers

pytestmark = pytest.mark.timeout(60)

SHORT_S = 0.5  # the first reply's bound here (open_timeout_s, reconnect_dial_timeout_s)
WAIT_S = 3 * SHORT_S  # a list_workers' answer: the registry rows' wait, past the bound


class SlowView:
    """A view session: frames handled in order, ``unsubscribe`` answered at once, ``list_workers`` after WAIT_S; the
    first ``drop_first`` connections are cut when their ``list_workers`` comes (a network cut with it pending)."""

    def __init__(self, drop_first: int = 0) -> None:
        self.upgrades = 0
        self.probes = 0
        self.drop_first = drop_first
        self.url = ""
        self._decode = msgspec.msgpack.Decoder(list[FromClient] | FromClient).decode  # an array, or one message

    async def session(self, ws: ServerConnection) -> None:
        self.upgrades += 1
        upgrade = self.upgrades
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                assert isinstance(frame, bytes)
                msgs = self._decode(frame)
                for msg in msgs if isinstance(msgs, list) else [msgs]:
                    if type(msg) is Unsubscribe:
                        self.probes += 1
                        await ws.send(msgspec.msgpack.encode([Ok(req_id=msg.req_id)]))
                    elif type(msg) is ListWorkers:
                        if upgrade <= self.drop_first:
                            ws.transport.abort()
                            return
                        await asyncio.sleep(WAIT_S)  # the owners' registry rows, as a view session waits for them
                        await ws.send(msgspec.msgpack.encode([Workers(req_id=msg.req_id, summary="slow view")]))


@contextlib.asynccontextmanager
async def slow_view(drop_first: int = 0) -> AsyncIterator[SlowView]:
    coordinator = SlowView(drop_first)
    subprotocols = [ENCODING_SUBPROTOCOL["msgpack"]]
    async with serve(coordinator.session, "127.0.0.1", 0, subprotocols=subprotocols,  # type: ignore[arg-type]
                     compression=None) as server:  # fmt: skip
        coordinator.url = f"ws://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
        yield coordinator


async def test_a_first_list_workers_answered_past_the_bound_keeps_its_connection() -> None:
    """Client(view).workers() against a view session that answers list_workers 3x the first reply's bound later:
    the probe's ok comes at once, so the one connection is kept and the answer comes on it (without the probe the
    client leaves it at the bound and redials, each connection left before its answer, until it gives up)."""
    async with slow_view() as view:
        client = Client(view.url, token="", open_timeout_s=SHORT_S, reconnect_base_s=0.01, reconnect_cap_s=0.05,
                        reconnect_give_up_s=4 * WAIT_S)  # fmt: skip
        async with client:
            reply = await asyncio.wait_for(client.workers(), 6 * WAIT_S)
            assert reply.summary == "slow view"
            assert client.session.resumed == 0
        assert (view.upgrades, view.probes) == (1, 1)


async def test_a_list_workers_resent_on_a_resume_is_answered_past_the_reconnect_bound() -> None:
    """A list_workers pending when the connection drops is sent again on the resume (cluster mode: two URLs, the
    reconnect's bound reconnect_dial_timeout_s): the probe goes first, and the answer that comes 3x that bound later
    is taken on the second connection, not left for a third."""
    async with slow_view(drop_first=1) as first, slow_view() as second:
        client = Client([first.url, second.url], token="", reconnect_dial_timeout_s=SHORT_S, reconnect_base_s=0.01,
                        reconnect_cap_s=0.05, reconnect_give_up_s=4 * WAIT_S)  # fmt: skip
        async with client:
            reply = await asyncio.wait_for(client.workers(), 6 * WAIT_S)
            assert reply.summary == "slow view"
            assert client.session.resumed == 1
        assert (first.upgrades, second.upgrades) == (1, 1)
        assert (first.probes, second.probes) == (1, 1)


def test_no_probe_goes_to_a_url_naming_a_pool_or_shard() -> None:
    """The probe is for URLs a view session may serve: a main port moves a session naming a pool by its first message
    (a submit by its partition), so none goes there; JSON connections get it as text."""
    assert first_probe("ws://h:1/v1/client?pool=gpu", False) is None
    assert first_probe("ws://h:1/v1/client?shard=3", True) is None
    assert first_probe("ws://h:1/v1/client", False) == msgspec.msgpack.encode([Unsubscribe()])
    assert first_probe("ws://h:1/v1/client", True) == b'[{"type":"unsubscribe"}]'
