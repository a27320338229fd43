"""The front door reader's cost per websocket frame, in callgrind instructions (issue #30, #29).

One process: a websockets server whose session is read by coordinator/io/frontdoor/reader.py
``read_frames`` with a handler that answers each frame with a 3-byte frame written straight to the
transport, and a client that sends one tiny frame and waits for that answer, ``N`` times. Run under
callgrind twice (``--small`` and ``--large`` round trips), the difference over the extra round trips
is the instructions one round trip costs: both sides' websocket work plus the reader's (the task it
wakes per frame, or none when the frame goes to the handler from ``data_received``). Compare trees
by running this file of each with its tree first on ``PYTHONPATH``.

    python bench/reader_hop.py            # instructions per round trip (needs valgrind)
    python bench/reader_hop.py --run 500  # one run, no callgrind (what is measured)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

ANSWER = b"\x82\x01x"  # one unmasked binary frame of one byte: the server's answer


class Answering:
    """A handler that answers each frame at once (``take``: from ``data_received``; ``received``: the task's path)."""

    def __init__(self) -> None:
        self.ws: Any = None

    def opened(self, now: float) -> None:
        pass

    async def received(self, msgs: list[Any], frame_bytes: int, now: float) -> int:
        self.ws.transport.write(ANSWER)
        return 0

    def take(self, msgs: list[Any], frame_bytes: int, now: float) -> tuple[int, int]:
        self.ws.transport.write(ANSWER)
        return len(msgs), 0

    async def finish(self, msgs: list[Any], index: int, frame_bytes: int) -> int:
        return 0

    def closed(self, now: float, code: int | None) -> None:
        pass


async def run(round_trips: int) -> None:
    from websockets.asyncio.client import connect
    from websockets.asyncio.server import ServerConnection, serve

    from coordinator.io.frontdoor.connection import FailFastConnection, Session
    from coordinator.io.frontdoor.reader import read_frames
    from coordinator.limits import Limits
    from coordinator.read_policy import ReadPolicy
    from protocol import Codec
    from protocol.messages import FromClient, ListWorkers

    codec = Codec("msgpack", FromClient, "client")
    policy = ReadPolicy(Limits(client_rate=1e9, client_burst=10**9))
    handler = Answering()

    async def session(ws: ServerConnection) -> None:
        handler.ws = ws
        await read_frames(Session(1, ws, codec, role="client"), handler,
                          policy.connection("client", "bench", time.monotonic()), kill=lambda *_: None,
                          store=None, clock=time.monotonic)  # fmt: skip

    async with serve(session, "127.0.0.1", 0, create_connection=FailFastConnection, compression=None) as server:
        port = server.sockets[0].getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}/", compression=None) as client:
            frame = codec.encode([ListWorkers(req_id=1)])
            for _ in range(round_trips):
                await client.send(frame)
                await client.recv()


def instructions(round_trips: int, out: str) -> int:
    """The whole process's callgrind instructions for ``round_trips``."""
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
                    "--run", str(round_trips)], check=True, capture_output=True)  # fmt: skip
    with open(out) as f:
        for line in f:
            if line.startswith("summary:") or line.startswith("totals:"):
                return int(line.split()[1])
    raise RuntimeError(f"no totals in {out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=200, help="round trips of the first run (200)")
    parser.add_argument("--large", type=int, default=2200, help="round trips of the second run (2200)")
    parser.add_argument("--run", type=int, metavar="N", help="just run N round trips (what callgrind measures)")
    ns = parser.parse_args()
    if ns.run is not None:
        asyncio.run(run(ns.run))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        small = instructions(ns.small, os.path.join(tmp, "small"))
        large = instructions(ns.large, os.path.join(tmp, "large"))
    per = (large - small) // (ns.large - ns.small)
    print(f"callgrind instructions per websocket round trip through read_frames ({ns.small} and {ns.large} round "
          f"trips, the difference): {per:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
