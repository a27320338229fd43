"""End to end: plans' inputs and outputs between real client, coordinator and worker processes (direct path)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fleetwire import Client, SyncClient
from fleetwire.data import Grant, OutputMismatch
from fleetwire.direct import DirectTransport
from fleetwire.inputs import InputSource
from tests.e2e.conftest import CLIENT_TOKEN, Cluster
from tests.e2e.module_fleet import ON_THE_FLEETS_LOOP, module_fleet

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SIZE = 3 << 20  # 3 MiB

# The tests that only move their own plans' bytes share one coordinator and worker (tests/e2e/module_fleet.py).
fleet = module_fleet("--allow-shell", "--data-listen", "127.0.0.1:0")


@ON_THE_FLEETS_LOOP
async def test_cli_input_file_shell_output_fetched(fleet: Cluster, tmp_path: Path) -> None:
    """submit --input name=@file: the shell handler reads it from $FLEETWIRE_INPUT_DATA and its output file
    comes back with `fleetwire output`."""
    source = tmp_path / "input.bin"
    data = os.urandom(SIZE)
    source.write_bytes(data)
    cmd = 'sha256sum "$FLEETWIRE_INPUT_DATA" | cut -c1-64 > "$FLEETWIRE_OUTPUT_DIR/sum"'
    args = json.dumps({"cmd": cmd, "outputs": {"sum": "sum"}})
    submit = await fleet.run("submit", "shell", "--args", args, "--input", f"data=@{source}", "--follow", "--json")
    assert await submit.wait(60) == 0, submit.lines
    events = [json.loads(line) for line in submit.lines]
    received = [e for e in events if e.get("kind") == "input_received"]
    assert received and received[0]["data"]["size"] == SIZE
    plan_id = events[0]["plan_id"]
    out = tmp_path / "sum.txt"
    fetch = await fleet.run("output", plan_id, "sum", "-o", str(out))
    assert await fetch.wait(30) == 0
    assert out.read_text().strip() == hashlib.sha256(data).hexdigest()


class _StallFirstAttempt(DirectTransport):
    """Uploads attempt 1 only partly (then hangs, as a worker dying mid-upload leaves it); later attempts whole."""

    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()

    async def upload(self, grant: Grant, source: InputSource) -> None:
        if grant.attempt > 1:
            await super().upload(grant, source)
            return
        started = self.started

        async def part() -> AsyncIterator[bytes]:
            async for chunk in source.chunks(0):
                yield chunk
                started.set()
                await asyncio.Event().wait()  # the rest never comes on this attempt

        headers = {"Authorization": f"Bearer {grant.ticket}", "Content-Length": str(source.size)}
        await self._http.put(grant.resource("inputs", source.name), content=part(), headers=headers)


async def test_worker_killed_mid_upload_retry_reuploads_to_the_new_worker(cluster: Cluster) -> None:
    """kill -9 of the worker while the SDK uploads a 3 MiB input: the next attempt's worker gets it again, whole."""
    await cluster.coordinator("--heartbeat-interval", "0.3", "--heartbeat-timeout", "1.2")
    handler = ("--handler", "digest=tests.e2e.data_handlers:digest")
    doomed = await cluster.worker("doomed", "--data-listen", "127.0.0.1:0", *handler)
    data = os.urandom(SIZE)
    async with Client(cluster.url, token=CLIENT_TOKEN) as client:
        transport = _StallFirstAttempt()
        client.transport = transport
        plan = await client.submit("digest", inputs={"data": data})
        await asyncio.wait_for(transport.started.wait(), 30)
        await cluster.worker("survivor", "--data-listen", "127.0.0.1:0", *handler)
        doomed.stop(signal.SIGKILL)
        result = await asyncio.wait_for(plan.result(), 60)
        assert plan.worker_id == "survivor"
    assert result == {"size": SIZE, "digest": f"sha256:{hashlib.sha256(data).hexdigest()}"}


async def test_output_damaged_in_the_workers_spool_is_refused_by_the_sdk_and_the_cli(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A shell output whose spool file is damaged on a real worker: `fleetwire output` fails and writes nothing,
    plan.output_to raises OutputMismatch naming the output."""
    await cluster.coordinator()
    spool = tmp_path / "spool"
    await cluster.worker("w1", "--allow-shell", "--data-listen", "127.0.0.1:0", "--spool-dir", str(spool))
    args = json.dumps({"cmd": 'head -c 3000000 /dev/zero > "$FLEETWIRE_OUTPUT_DIR/blob"',
                       "outputs": {"blob": "blob"}})
    async with Client(cluster.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("shell", args=json.loads(args), outputs=["blob"])
        await asyncio.wait_for(plan.result(), 60)
        spool.chmod(0o700)  # the spool's root is never listed (0311): an operator's chmod
        # The worker's copy of the output, in its plan's directory (not rglob: the worker removes the plan's
        # work directory meanwhile, and a scan that met it going raised FileNotFoundError).
        [kept] = list(spool.glob("*/out-blob"))
        with open(kept, "r+b") as file:  # noqa: ASYNC230  (one byte of a local file)
            file.seek(1234)
            file.write(b"\x01")
        fetch = await cluster.run("output", plan.id, "blob", "-o", str(tmp_path / "blob.bin"))
        assert await fetch.wait(30) != 0
        assert not (tmp_path / "blob.bin").exists()
        with pytest.raises(OutputMismatch, match="output 'blob'"):
            await plan.output_to("blob", tmp_path / "blob.bin")


async def test_cli_args_from_a_file_past_the_frame_limit_travel_by_the_data_plane(cluster: Cluster,
                                                                                  tmp_path: Path) -> None:
    """`submit --args @PATH` with 3 MiB of JSON (past the 1 MiB frame limit, and past what one command-line
    argument may hold): the args go to the worker by the data plane, and echo's 3 MiB result comes back."""
    await cluster.coordinator()
    await cluster.worker("w1", "--data-listen", "127.0.0.1:0")
    blob = os.urandom(3 << 19).hex()  # 3 MiB of text
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"blob": blob}))
    submit = await cluster.run("submit", "echo", "--args", f"@{args}", "--json", "--detach")
    assert await submit.wait(60) == 0, submit.lines  # --detach: once the worker has the args
    plan_id = json.loads(submit.lines[0])["plan_id"]
    async with Client(cluster.url, token=CLIENT_TOKEN) as client:
        plan = await client.watch(plan_id)
        assert await asyncio.wait_for(plan.result(), 30) == {"blob": blob}


def _sync_round_trip(url: str, source: Path, target: Path, relay: bool) -> dict[str, Any]:
    """SyncClient (no event loop of the caller's): a file in, a shell copy of it out by output, output_to and
    output_chunks."""
    with SyncClient(url, token=CLIENT_TOKEN) as client:
        args = {"cmd": 'cp "$FLEETWIRE_INPUT_DATA" "$FLEETWIRE_OUTPUT_DIR/copy"', "outputs": {"copy": "copy"}}
        plan = client.submit("shell", args=args, inputs={"data": source}, outputs=["copy"], relay=relay)
        plan.result(timeout=60)
        return {"output": plan.output("copy", timeout=60), "output_to": plan.output_to("copy", target, timeout=60),
                "chunks": b"".join(plan.output_chunks("copy", timeout=60))}


@pytest.mark.parametrize("relay", [False, True])
@ON_THE_FLEETS_LOOP
async def test_sync_client_moves_inputs_and_outputs(fleet: Cluster, tmp_path: Path, relay: bool) -> None:
    """SyncClient has the data plane too, direct and relayed: an input file in, an output back three ways."""
    source, target = tmp_path / "input.bin", tmp_path / "copy.bin"
    data = os.urandom(SIZE)
    source.write_bytes(data)
    got = await asyncio.to_thread(_sync_round_trip, fleet.url, source, target, relay)
    assert got["output"] == data and got["chunks"] == data
    assert got["output_to"] == target and target.read_bytes() == data


@ON_THE_FLEETS_LOOP
async def test_cli_input_from_stdin(fleet: Cluster, tmp_path: Path) -> None:
    """`submit --input data=-` reads the input from stdin (a pipe: copied aside while hashed, so a retry could
    upload it again); the shell handler gets it whole; `output PLAN NAME` without -o writes it to stdout."""
    data = os.urandom(SIZE)
    args = json.dumps({"cmd": 'cp "$FLEETWIRE_INPUT_DATA" "$FLEETWIRE_OUTPUT_DIR/copy"', "outputs": {"copy": "copy"}})
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetwire", "submit", "shell", "--args", args, "--input", "data=-", "--json",
        "--follow", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=fleet.env(),
    )
    out, _ = await asyncio.wait_for(proc.communicate(data), 60)
    assert proc.returncode == 0, out[-500:]
    plan_id = json.loads(out.splitlines()[0])["plan_id"]
    copy = tmp_path / "copy.bin"
    fetch = await fleet.run("output", plan_id, "copy", "-o", str(copy))
    assert await fetch.wait(30) == 0
    assert copy.read_bytes() == data
    to_stdout = await asyncio.create_subprocess_exec(  # no -o: the bytes on stdout, as they are
        sys.executable, "-m", "fleetwire", "output", plan_id, "copy", stdout=asyncio.subprocess.PIPE, env=fleet.env(),
    )
    out, _ = await asyncio.wait_for(to_stdout.communicate(), 60)
    assert to_stdout.returncode == 0 and out == data
