"""Fixtures shared by every test layer: a real PostgreSQL server (tests/pg.py) for the cluster-mode tests.

Also the hooks for pytest-xdist workers: the default worker count, ``solo`` tests kept alone
(tests/parallel.py says how).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import fleetwire.client
from tests.no_nvml import pynvml as no_nvml
from tests.parallel import SOLO_MARK, MachineShare, default_to_workers, run_temp, worker_share
from tests.pg import PostgresServer, missing_reason, postgres_server, scratch_dir

_share: MachineShare | None = None  # this xdist worker's handle on the run's solo lock


@pytest.fixture
def mute_collector() -> Iterator[str]:
    """An OTLP/HTTP endpoint that completes the TCP handshake (the kernel's backlog) and never answers a request
    (the tracing tests' collector that holds every post until the exporter's timeout)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.fixture
def client_dials(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The SDK client's dials, in order (each URL's scheme, host and port): ``fleetwire.client.dial`` recorded."""
    urls: list[str] = []
    real_dial = fleetwire.client.dial

    async def recording_dial(url: str, **kwargs: Any) -> Any:
        urls.append(url.split("/v1/")[0])
        return await real_dial(url, **kwargs)

    monkeypatch.setattr(fleetwire.client, "dial", recording_dial)
    return urls


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The default ``-n`` and ``--dist`` (tests/parallel.py), before xdist's own hook turns ``-n`` into nodes."""
    default_to_workers(config)


def pytest_configure(config: pytest.Config) -> None:
    global _share
    _share = worker_share(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _share is not None:
        _share.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """Under xdist each test holds the run's lock, shared, or alone when marked ``solo`` (setup to teardown)."""
    if _share is None:
        return (yield)
    with _share.held(alone=item.get_closest_marker(SOLO_MARK) is not None):
        return (yield)


@pytest.fixture(scope="session", autouse=True)
def _child_bytecode(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Child Python processes cache their bytecode in a temp tree kept for the session.

    The tests start hundreds of Python processes (coordinators, workers, CLI commands, bench
    scripts, handler children). Under ``PYTHONDONTWRITEBYTECODE=1`` (set where CI runs) each one
    compiled every module it imported afresh: 0.68-0.78 s of CPU to import the coordinator and the
    worker agent, against 0.33-0.36 s with bytecode. ``PYTHONPYCACHEPREFIX`` keeps that bytecode
    out of the checkout, and the tree goes with the session's temp dirs. Under xdist the workers
    share one tree (the run's temp dir): Python writes each ``.pyc`` to a temp file and renames it.
    """
    saved = {name: os.environ.get(name) for name in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    shared = run_temp(request.config)
    if shared is None:
        prefix = tmp_path_factory.mktemp("pycache")
    else:
        prefix = shared / "pycache"
        prefix.mkdir(exist_ok=True)
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session", autouse=True)
def _no_real_nvml() -> Iterator[None]:
    """No test meets a GPU host's real NVML (tests/no_nvml/pynvml.py says why); a test's own fake still wins."""
    saved = sys.modules.get("pynvml")
    sys.modules["pynvml"] = no_nvml  # type: ignore[assignment]
    yield
    if saved is None:
        sys.modules.pop("pynvml", None)
    else:
        sys.modules["pynvml"] = saved


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the session (skips with the reason when PostgreSQL or asyncpg is missing).

    Its files are on tmpfs where there is room (tests/pg.py ``scratch_dir``): each test's CREATE
    DATABASE writes and syncs a 7.5 MB copy of template1 (40 of them: 5.5-12.9 s -> 2.8-4.3 s here), and
    deleting the session's files at the end (~850 MB) took 2.3-3.1 s -> 0.5-0.6 s for half of them.
    """
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    with postgres_server(parent=scratch_dir()) as server:
        yield server


@pytest.fixture
def pg_dsn(postgres: PostgresServer) -> str:
    """The DSN of a fresh, empty database on the session's PostgreSQL server."""
    return postgres.new_database()
