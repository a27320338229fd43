"""End to end: plan graphs between real coordinator, worker and client processes (issue #28): the example, the
bytes staying on the workers, failure at once, a chain that survives the death of a worker holding its data, and a
replicated output that outlives it with nothing run again."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import urllib.request

import pytest

from fleetwire import Client, PlanCancelled
from tests.e2e.conftest import CLIENT_TOKEN, ROOT, Cluster
from tests.e2e.module_fleet import ON_THE_FLEETS_LOOP, module_fleet

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

DATA = ("--allow-shell", "--data-listen", "127.0.0.1:0")
MIB = 1 << 20

# One coordinator and worker w1 (DATA) for the tests that look only at their own plans and kill nothing
# (tests/e2e/module_fleet.py); the others start a fleet of their own.
fleet = module_fleet(*DATA)


def _metric(cluster: Cluster, name: str) -> float:
    """The sum of a counter's series on the coordinator's /metrics."""
    with urllib.request.urlopen(cluster.url.replace("ws://", "http://") + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _sha_cmd(name: str) -> str:
    return f'sha256sum "$FLEETWIRE_INPUT_{name.upper()}" | cut -c1-64 > "$FLEETWIRE_OUTPUT_DIR/sum"'


@ON_THE_FLEETS_LOOP
async def test_the_pipeline_example_runs(fleet: Cluster) -> None:
    """examples/pipeline.py: the second plan sums the first one's output, an order is kept, and a consumer of a
    failing plan fails upstream_failed."""
    proc = await fleet.script(ROOT / "examples" / "pipeline.py")
    assert await proc.wait(90) == 0, proc.lines
    out = "\n".join(proc.lines)
    assert "sum: 500500" in out and "failed: upstream_failed" in out, out


async def test_b_on_as_64_mib_output_runs_where_it_is_and_elsewhere_pulls_it_worker_to_worker(cluster: Cluster) -> None:
    """B on A's 64 MiB output runs on A's worker (a local copy); B2, which only the other worker can run, fetches
    it from A's worker's data endpoint. Neither the client nor the coordinator carries a byte of it."""
    await cluster.coordinator("--heartbeat-interval", "0.3")  # loads (the data endpoints' counts) come often
    await cluster.worker("w1", *DATA, "--tags", "first")
    await cluster.worker("w2", *DATA, "--tags", "second")
    async with Client(cluster.url, token=CLIENT_TOKEN) as client:
        a = await client.submit("shell", args={"cmd": f'head -c {64 * MIB} /dev/urandom > "$FLEETWIRE_OUTPUT_DIR/y"'},
                                outputs=["y"], tags=["first"])  # fmt: skip
        b = await client.submit("shell", args={"cmd": _sha_cmd("x")}, inputs={"x": a.ref("y")}, outputs=["sum"])
        b2 = await client.submit("shell", args={"cmd": _sha_cmd("x")}, inputs={"x": a.ref("y")}, outputs=["sum"],
                                 tags=["second"])  # fmt: skip
        await b.result()
        await b2.result()
        assert a.worker_id == b.worker_id == "w1" and b2.worker_id == "w2"
        assert _metric(cluster, "fleetwire_relay_bytes_total") == 0  # nothing through the coordinator
        sent: list[int] = [0]

        async def w1_sent() -> None:  # B2's copy left w1's endpoint, to w2 (reported in w1's next load)
            while sent[0] < 64 * MIB:
                load = {w.id: w.load for w in (await client.workers()).workers}["w1"]
                sent[0] = load.data_bytes_out if load is not None else 0
                if sent[0] < 64 * MIB:
                    await asyncio.sleep(0.05)  # as tests/waiting.py until(): a count with no event to wait on

        await asyncio.wait_for(w1_sent(), 30)
        expected = hashlib.sha256(await a.output("y")).hexdigest()  # only now does the client read the bytes
        assert (await b.output("sum")).decode().strip() == expected == (await b2.output("sum")).decode().strip()


async def test_b_on_the_output_of_a_worker_without_a_data_endpoint_gets_it_through_the_relay(cluster: Cluster) -> None:
    """A on w1, which has no data endpoint (as behind NAT): B on w2 gets A's 8 MiB output through the
    coordinator's relay over w2's own session (input_received via relay), the same bytes."""
    await cluster.coordinator()
    await cluster.worker("w1", "--allow-shell", "--tags", "first")
    await cluster.worker("w2", *DATA, "--tags", "second")
    async with Client(cluster.url, token=CLIENT_TOKEN) as client:
        a = await client.submit("shell", args={"cmd": f'head -c {8 * MIB} /dev/urandom > "$FLEETWIRE_OUTPUT_DIR/y"'},
                                outputs=["y"], tags=["first"])  # fmt: skip
        b = await client.submit("shell", args={"cmd": _sha_cmd("x")}, inputs={"x": a.ref("y")}, outputs=["sum"],
                                tags=["second"])  # fmt: skip
        await asyncio.wait_for(b.result(), 60)
        assert [e.data["via"] for e in b._stream.events if e.kind == "input_received"] == ["relay"]
        assert _metric(cluster, "fleetwire_relay_bytes_total") >= 8 * MIB
        expected = hashlib.sha256(await a.output("y")).hexdigest()
        assert (await b.output("sum")).decode().strip() == expected


@ON_THE_FLEETS_LOOP
async def test_b_on_a_failing_a_fails_fast_naming_a(fleet: Cluster) -> None:
    """A fails: B, waiting for A's output, fails upstream_failed at once, naming A (the CLI's references too)."""
    submit = await fleet.run("submit", "shell", "--args", json.dumps({"cmd": "sleep 1; exit 3"}), "--output", "y",
                               "--detach", "--json")  # fmt: skip
    assert await submit.wait(30) == 0, submit.lines
    a = json.loads(submit.lines[-1])["plan_id"]
    after = await fleet.run("submit", "shell", "--args", json.dumps({"cmd": "true"}), "--input",
                              f"x=plan:{a}/y", "--json")  # fmt: skip
    assert await after.wait(30) != 0
    failed = [json.loads(line) for line in after.lines if '"failed"' in line][-1]
    assert "upstream_failed" in json.dumps(failed) and a in json.dumps(failed)


async def test_a_chain_survives_the_death_of_the_worker_holding_a_mid_chain_output(cluster: Cluster) -> None:
    """kill -9 of the worker holding A's output while B (which needs it) waits: A is made again once on the
    other worker (A.r1; A stays succeeded), B then runs once and gets the same bytes."""
    await cluster.coordinator("--heartbeat-interval", "0.3", "--heartbeat-timeout", "1.5",
                              "--worker-reconnect-grace-s", "1")  # fmt: skip
    holder = await cluster.worker("w1", *DATA)
    async with Client(cluster.url, token=CLIENT_TOKEN) as client:
        cmd = 'seq 1 200000 > "$FLEETWIRE_OUTPUT_DIR/y"'  # deterministic: the same bytes again
        a = await client.submit("shell", args={"cmd": cmd}, outputs=["y"])
        await a.result()
        await cluster.worker("w2", *DATA)
        gate = await client.submit("shell", args={"cmd": "sleep 5"})
        b = await client.submit("shell", args={"cmd": _sha_cmd("x")}, inputs={"x": a.ref("y")}, outputs=["sum"],
                                after=[gate])  # fmt: skip
        holder.stop(signal.SIGKILL)
        await asyncio.wait_for(b.result(), 60)
        assert b.attempt == 1 and b.worker_id == "w2"
        listed = {p.id: p for p in (await client.plans()).plans}
        rebuilds = sorted(key for key in listed if key.startswith(f"{a.id}.r"))
        assert rebuilds == [f"{a.id}.r1"] and listed[a.id].state == "succeeded"
        digest = hashlib.sha256("".join(f"{n}\n" for n in range(1, 200001)).encode()).hexdigest()
        assert (await b.output("sum")).decode().strip() == digest


async def test_a_replicated_output_outlives_the_kill_of_its_worker_with_nothing_run_again(cluster: Cluster) -> None:
    """A (replicas y=2) succeeds once copy plan A.c1 holds y on w2; kill -9 of w1 while B waits: B runs once on
    w2 with A's bytes from the copy, and A is never made again."""
    await cluster.coordinator("--heartbeat-interval", "0.3", "--heartbeat-timeout", "1.5",
                              "--worker-reconnect-grace-s", "1")  # fmt: skip
    holder = await cluster.worker("w1", *DATA, "--tags", "first")
    await cluster.worker("w2", *DATA)
    async with Client(cluster.url, token=CLIENT_TOKEN) as client:
        a = await client.submit("shell", args={"cmd": 'seq 1 200000 > "$FLEETWIRE_OUTPUT_DIR/y"'},
                                outputs={"y": {"replicas": 2}}, tags=["first"])  # fmt: skip
        await asyncio.wait_for(a.result(), 60)
        assert [e.data["copies"] for e in a._stream.events if e.kind == "succeeded"] == [{"y": ["w1", "w2"]}]
        gate = await client.submit("shell", args={"cmd": "sleep 3"})
        b = await client.submit("shell", args={"cmd": _sha_cmd("x")}, inputs={"x": a.ref("y")}, outputs=["sum"],
                                after=[gate])  # fmt: skip
        holder.stop(signal.SIGKILL)
        await asyncio.wait_for(b.result(), 60)
        assert b.attempt == 1 and b.worker_id == "w2"
        listed = {p.id: p for p in (await client.plans()).plans}
        assert not [key for key in listed if key.startswith(f"{a.id}.r")] and listed[f"{a.id}.c1"].worker_id == "w2"
        digest = hashlib.sha256("".join(f"{n}\n" for n in range(1, 200001)).encode()).hexdigest()
        assert (await b.output("sum")).decode().strip() == digest


async def test_a_clients_fetch_of_an_output_whose_worker_died_gets_it_made_again(cluster: Cluster) -> None:
    """kill -9 of the worker holding A's output, which no plan needs: A's client fetching it gets the same bytes
    from A.r1 on the other worker (A stays succeeded), not relay_closed after the relay's retries."""
    await cluster.coordinator("--heartbeat-interval", "0.3", "--heartbeat-timeout", "1.5",
                              "--worker-reconnect-grace-s", "1")  # fmt: skip
    holder = await cluster.worker("w1", *DATA)
    async with Client(cluster.url, token=CLIENT_TOKEN) as client:
        a = await client.submit("shell", args={"cmd": 'seq 1 100000 > "$FLEETWIRE_OUTPUT_DIR/y"'}, outputs=["y"])
        await a.result()
        await cluster.worker("w2", *DATA)
        holder.stop(signal.SIGKILL)
        data = await asyncio.wait_for(a.output("y"), 30)
        assert data == "".join(f"{n}\n" for n in range(1, 100001)).encode()
        listed = {p.id: p for p in (await client.plans()).plans}
        assert sorted(key for key in listed if key.startswith(f"{a.id}.r")) == [f"{a.id}.r1"]
        assert listed[f"{a.id}.r1"].worker_id == "w2" and listed[a.id].state == "succeeded"


@ON_THE_FLEETS_LOOP
async def test_a_plan_after_a_cancelled_one_is_cancelled_with_it_from_the_cli(fleet: Cluster) -> None:
    """cancel --with-dependants cancels the plan and the plan after it; both end cancelled."""
    async with Client(fleet.url, token=CLIENT_TOKEN) as client:
        first = await client.submit("nobody-runs-this")
        second = await client.submit("echo", after=[first])
        cancel = await fleet.run("cancel", first.id, "--with-dependants")
        assert await cancel.wait(30) == 0, cancel.lines
        with pytest.raises(PlanCancelled):
            await second.result()
        assert (await client.get_plan(second.id)).state == "cancelled"

