"""Helpers for end-to-end tests: real processes started through the ``fleetwire`` CLI."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.no_nvml import pynvml as no_nvml

ROOT = Path(__file__).resolve().parents[2]
WORKER_TOKEN = "e2e-worker-token"
CLIENT_TOKEN = "e2e-client-token"
ADMIN_TOKEN = "e2e-admin-secret"  # operator actions (drain/undrain) need the admin role


class Proc:
    """A child process whose stdout lines are collected as they arrive."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.lines: list[str] = []
        self._cursor = 0  # wait_for_line reads forward from here
        self._new_line = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self.lines.append(line.decode(errors="replace").rstrip("\n"))
            self._new_line.set()
        self._new_line.set()

    async def wait_for_line(self, pattern: str, timeout_s: float = 30.0) -> re.Match[str]:
        """The next stdout line matching ``pattern`` (regex) after the last matched line, waiting for it."""
        regex = re.compile(pattern)

        async def scan() -> re.Match[str]:
            while True:
                for line in self.lines[self._cursor:]:
                    self._cursor += 1
                    if m := regex.search(line):
                        return m
                if self._reader.done():
                    raise AssertionError(f"{self.name} exited ({self.proc.returncode}) without printing {pattern!r}; "
                                         f"stdout: {self.lines}")
                self._new_line.clear()
                await self._new_line.wait()

        return await asyncio.wait_for(scan(), timeout_s)

    async def wait(self, timeout_s: float = 30.0) -> int:
        rc = await asyncio.wait_for(self.proc.wait(), timeout_s)
        await self._reader
        return rc

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)


class Cluster:
    """Starts ``fleetwire`` processes and cleans them all up."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []
        self.url = ""
        # The coordinators of one cluster share a fresh store directory (a restart finds the plans);
        # no test ever touches the user's default one.
        self._data_dir = tempfile.TemporaryDirectory(prefix="fleetwire-e2e-")
        self.data_dir = self._data_dir.name

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETWIRE_")}
        env.update({"FLEETWIRE_URL": self.url, "FLEETWIRE_TOKEN": CLIENT_TOKEN, "PYTHONUNBUFFERED": "1",
                    "FLEETWIRE_DATA_DIR": self.data_dir})  # fmt: skip
        # A GPU host's real NVML would refuse the GPUs tests declare (tests/no_nvml/pynvml.py).
        env["PYTHONPATH"] = os.pathsep.join(p for p in (no_nvml.DIRECTORY, env.get("PYTHONPATH", "")) if p)
        env.update(extra)
        return env

    async def run(self, *args: str, name: str = "", env: dict[str, str] | None = None) -> Proc:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fleetwire", *args,
            stdout=asyncio.subprocess.PIPE, stderr=None, env=env or self.env(), cwd=ROOT,
        )
        p = Proc(proc, name or " ".join(args[:2]))
        self.procs.append(p)
        return p

    async def script(self, path: Path, *args: str, env: dict[str, str] | None = None) -> Proc:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(path), *args, stdout=asyncio.subprocess.PIPE, env=env or self.env(), cwd=ROOT,
        )
        p = Proc(proc, path.name)
        self.procs.append(p)
        return p

    async def coordinator(self, *extra: str) -> Proc:
        env = self.env(
            FLEETWIRE_WORKER_TOKEN=WORKER_TOKEN, FLEETWIRE_CLIENT_TOKEN=CLIENT_TOKEN, FLEETWIRE_ADMIN_TOKEN=ADMIN_TOKEN
        )
        proc = await self.run("coordinator", "--port", "0", *extra, name="coordinator", env=env)
        self.url = (await proc.wait_for_line(r"listening on (ws://\S+)")).group(1)
        return proc

    async def worker(self, worker_id: str, *extra: str) -> Proc:
        proc = await self.run("worker", "--id", worker_id, *extra, name=worker_id,
                              env=self.env(FLEETWIRE_TOKEN=WORKER_TOKEN))
        await proc.wait_for_line("registered")
        return proc

    async def close(self) -> None:
        for p in self.procs:
            p.stop()
        for p in self.procs:
            try:
                await p.wait(15)
            except TimeoutError:
                p.stop(signal.SIGKILL)
                await p.wait(5)
        self._data_dir.cleanup()


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        await c.close()
