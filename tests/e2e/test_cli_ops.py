"""End to end, the operator's CLI (issue #15 item 7): status, Ctrl-C during submit, op hints, cancel of many."""

from __future__ import annotations

import asyncio
import json
import signal
import sys

import pytest

from tests.e2e.conftest import ADMIN_TOKEN, ROOT, Cluster
from tests.e2e.module_fleet import ON_THE_FLEETS_LOOP, module_fleet

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

# One coordinator and worker w1 for the Ctrl-C and op-hint tests (tests/e2e/module_fleet.py): each looks only
# at its own plan (the first leaves its plan running, in one of w1's 4 slots).
fleet = module_fleet()


class Cli:
    """A ``fleetwire`` client command with stdout and stderr read as they come."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.err: list[str] = []
        self._err_line = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read_err())

    async def _read_err(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.err.append(line.decode().rstrip("\n"))
            self._err_line.set()
        self._err_line.set()

    async def stderr_has(self, text: str, timeout_s: float = 30.0) -> None:
        async def scan() -> None:
            while not any(text in line for line in self.err):
                if self._reader.done():
                    raise AssertionError(f"exited without printing {text!r} on stderr: {self.err}")
                self._err_line.clear()
                await self._err_line.wait()

        await asyncio.wait_for(scan(), timeout_s)

    async def finish(self, timeout_s: float = 30.0) -> tuple[int, str, str]:
        assert self.proc.stdout is not None
        out = await asyncio.wait_for(self.proc.stdout.read(), timeout_s)
        rc = await asyncio.wait_for(self.proc.wait(), timeout_s)
        await self._reader
        return rc, out.decode(), "\n".join(self.err)


async def _cli(cluster: Cluster, *args: str, **env: str) -> Cli:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetwire", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=cluster.env(**env), cwd=ROOT,
    )  # fmt: skip
    return Cli(proc)


async def _run(cluster: Cluster, *args: str, **env: str) -> tuple[int, str, str]:
    return await (await _cli(cluster, *args, **env)).finish()


@ON_THE_FLEETS_LOOP
async def test_ctrl_c_during_submit_follow_says_the_plan_keeps_running(fleet: Cluster) -> None:
    """SIGINT during `submit --follow`: exit 130, the exact watch/cancel commands printed, the plan still runs."""
    submit = await _cli(fleet, "submit", "sleep", "--args", '{"seconds": 60}', "--follow")
    assert submit.proc.stdout is not None
    first = (await asyncio.wait_for(submit.proc.stdout.readline(), 30)).decode()
    plan_id = first.split()[1]
    while b"] running" not in await asyncio.wait_for(submit.proc.stdout.readline(), 30):
        pass
    submit.proc.send_signal(signal.SIGINT)
    rc, _, err = await submit.finish()
    assert rc == 130, err
    assert f"plan {plan_id} keeps running" in err
    assert f"fleetwire watch {plan_id}" in err and f"fleetwire cancel {plan_id}" in err
    assert "Traceback" not in err
    rc, out, _ = await _run(fleet, "plans", "--json", FLEETWIRE_ADMIN_TOKEN=ADMIN_TOKEN)
    assert {p["id"]: p["state"] for p in json.loads(out)["plans"]}[plan_id] == "running"


@ON_THE_FLEETS_LOOP
async def test_ctrl_c_with_cancel_on_interrupt_cancels_the_plan(fleet: Cluster) -> None:
    """SIGINT during `submit --cancel-on-interrupt`: the plan ends cancelled, exit 130."""
    submit = await _cli(fleet, "submit", "sleep", "--args", '{"seconds": 60}', "--follow", "--cancel-on-interrupt")
    assert submit.proc.stdout is not None
    plan_id = (await asyncio.wait_for(submit.proc.stdout.readline(), 30)).decode().split()[1]
    while b"] running" not in await asyncio.wait_for(submit.proc.stdout.readline(), 30):
        pass
    submit.proc.send_signal(signal.SIGINT)
    rc, _, err = await submit.finish()
    assert rc == 130, err
    assert f"plan {plan_id} cancelled" in err
    rc, out, _ = await _run(fleet, "plans", "--json", FLEETWIRE_ADMIN_TOKEN=ADMIN_TOKEN)
    assert {p["id"]: p["state"] for p in json.loads(out)["plans"]}[plan_id] == "cancelled"


@ON_THE_FLEETS_LOOP
async def test_typo_op_names_the_offered_ops_and_the_closest(fleet: Cluster) -> None:
    """`submit ecoh`: stderr lists the ops the workers offer and suggests 'echo'; `shell` mentions --allow-shell."""
    submit = await _cli(fleet, "submit", "ecoh", "--cancel-on-interrupt")
    shell = await _cli(fleet, "submit", "shell", "--args", '{"cmd": "true"}', "--cancel-on-interrupt")  # beside it
    await submit.stderr_has("did you mean 'echo'?")
    assert any("they offer:" in line and "echo" in line and "sleep" in line for line in submit.err)
    submit.proc.send_signal(signal.SIGINT)
    assert (await submit.finish())[0] == 130
    await shell.stderr_has("--allow-shell")
    shell.proc.send_signal(signal.SIGINT)
    assert (await shell.finish())[0] == 130


async def test_cancel_several_ids_and_all_queued(cluster: Cluster) -> None:
    """`cancel A B` cancels both; `cancel --all --state queued` cancels the rest; exit 0, one line per plan."""
    await cluster.coordinator()  # no worker: every plan stays queued
    ids = []
    # The commands that do not depend on each other run side by side (each is a process start).
    for rc, out, err in await asyncio.gather(*(_run(cluster, "submit", "echo", "--args", str(n), "--detach")
                                               for n in range(4))):  # fmt: skip
        assert rc == 0, err
        ids.append(out.split()[1])
    rc, out, err = await _run(cluster, "cancel", ids[0], ids[1])
    assert rc == 0, err
    assert out.splitlines() == [f"plan {ids[0]} cancelled", f"plan {ids[1]} cancelled"]
    (rc, out, err), (rc_again, _, err_again) = await asyncio.gather(
        _run(cluster, "cancel", "--all", "--state", "queued"), _run(cluster, "cancel", ids[0], "no-such-plan"))
    assert rc == 0, err
    assert sorted(out.splitlines()) == sorted([f"plan {ids[2]} cancelled", f"plan {ids[3]} cancelled"])
    assert rc_again == 1 and "no-such-plan" in err_again


async def test_status_and_workers_show_versions(cluster: Cluster) -> None:
    """`status` shows the URL, version, workers alive, queue and plans by state (text and --json);
    `workers` shows each worker's version."""
    await cluster.coordinator()
    await cluster.worker("w1")
    rc, _, err = await _run(cluster, "submit", "echo", "--args", "1")
    assert rc == 0, err
    as_json, as_text, workers = await asyncio.gather(  # three reads, side by side
        _run(cluster, "status", "--json", FLEETWIRE_ADMIN_TOKEN=ADMIN_TOKEN),
        _run(cluster, "status", FLEETWIRE_ADMIN_TOKEN=ADMIN_TOKEN), _run(cluster, "workers"))
    rc, out, err = as_json
    assert rc == 0, err
    status = json.loads(out)
    assert status["url"] == cluster.url and status["version"]
    assert status["workers"]["alive"] == 1 and status["queue"] == 0 and status["plans"] == {"succeeded": 1}
    rc, out, err = as_text
    assert rc == 0, err
    assert f"coordinator  {cluster.url} (version {status['version']})" in out
    assert "1 alive of 1 registered" in out and "0 plans waiting" in out and "1 succeeded" in out
    rc, out, err = workers
    assert rc == 0, err
    assert "VERSION" in out.splitlines()[0] and status["workers"]["versions"][0] in out.splitlines()[1]
