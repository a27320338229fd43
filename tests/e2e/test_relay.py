"""End to end: plans' inputs and outputs relayed through a real coordinator process (docs/PROTOCOL.md §11 Relay)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from tests.e2e.conftest import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SIZE = 3 << 20  # 3 MiB


async def test_cli_relay_to_a_worker_without_data_endpoint(cluster: Cluster, tmp_path: Path) -> None:
    """submit --relay --input to a worker with no --data-listen: the shell handler gets the file, its event says
    "via": "relay", and `fleetwire output --relay` brings its output back through the coordinator."""
    await cluster.coordinator("--relay-max-bytes", str(8 << 20))
    await cluster.worker("w1", "--allow-shell")
    source = tmp_path / "input.bin"
    data = os.urandom(SIZE)
    source.write_bytes(data)
    cmd = ('sha256sum "$FLEETWIRE_INPUT_DATA" | cut -c1-64 > "$FLEETWIRE_OUTPUT_DIR/sum"; '
           'cp "$FLEETWIRE_INPUT_DATA" "$FLEETWIRE_OUTPUT_DIR/copy"')
    args = json.dumps({"cmd": cmd, "outputs": {"sum": "sum", "copy": "copy"}})
    submit = await cluster.run("submit", "shell", "--args", args, "--input", f"data=@{source}", "--relay",
                               "--follow", "--json")
    assert await submit.wait(60) == 0, submit.lines
    events = [json.loads(line) for line in submit.lines]
    received = [e for e in events if e.get("kind") == "input_received"]
    assert received and received[0]["data"]["size"] == SIZE and received[0]["data"]["via"] == "relay"
    plan_id = events[0]["plan_id"]
    out = tmp_path / "sum.txt"
    fetch = await cluster.run("output", plan_id, "sum", "-o", str(out), "--relay")
    assert await fetch.wait(30) == 0
    assert out.read_text().strip() == hashlib.sha256(data).hexdigest()
    copy = tmp_path / "copy.bin"
    fetch = await cluster.run("output", plan_id, "copy", "-o", str(copy))  # no endpoint: relayed without asking
    assert await fetch.wait(30) == 0
    assert copy.read_bytes() == data
