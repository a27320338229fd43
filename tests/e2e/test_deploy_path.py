"""The deploy path of docs/OPERATIONS.md ("Deploying to a fleet") works as written: the Dockerfile's
wheel build, the TLS walkthrough command by command, and the alert rules."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

from fleetwire import Client
from fleetwire.errors import AuthError
from tests.e2e.conftest import CLIENT_TOKEN, ROOT, WORKER_TOKEN, Cluster, Proc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

DOCKERFILE = ROOT / "Dockerfile"
ALERTS = ROOT / "examples" / "deploy" / "alerts.yml"
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"
PACKAGES = ("protocol", "wireio", "coordinator", "worker_agent", "fleetwire")


def _dockerfile_lines() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_is_slim_non_root_and_runs_fleetwire() -> None:
    """The image is python:3.11-slim, installs the wheel, runs as a non-root user with ENTRYPOINT fleetwire."""
    lines = _dockerfile_lines()
    assert all(line.split()[1] in ("python:3.11-slim", "python:3.11-slim AS build")
               or not line.startswith("FROM") for line in lines)  # fmt: skip
    assert [line for line in lines if line.startswith("FROM")][-1] == "FROM python:3.11-slim"
    final = lines[max(i for i, line in enumerate(lines) if line.startswith("FROM")):]
    assert any(line.startswith("RUN pip install") and ".whl" in line for line in final)
    user = [line.split()[1] for line in final if line.startswith("USER ")]
    assert user and user[-1] not in ("root", "0")
    assert [line for line in final if line.startswith("ENTRYPOINT")] == ['ENTRYPOINT ["fleetwire"]']


def test_dockerfile_copies_every_build_file() -> None:
    """The image builds from the same build files as `pip install .`: pyproject.toml and setup.py (the
    optional compiled core's build, docs/OPERATIONS.md §The compiled core)."""
    copied = {name for line in _dockerfile_lines() if line.startswith("COPY ") and "--from=" not in line
              for name in line.split()[1:-1]}  # fmt: skip
    assert {"pyproject.toml", "setup.py"} <= copied


def _stages() -> list[list[str]]:
    """The Dockerfile's stages, each its instructions from its FROM on."""
    stages: list[list[str]] = []
    for line in _dockerfile_lines():
        if line.startswith("FROM "):
            stages.append([])
        stages[-1].append(line)
    return stages


def test_the_build_stage_has_a_compiler_and_the_run_stage_none(tmp_path: Path) -> None:
    """The image's wheel is compiled: the build stage installs gcc and libc's headers before its `pip wheel`, with
    FLEETWIRE_MYPYC=1 (compiled or the build fails) the default build arg, and installs none with the build arg 0
    (a pure image); the run stage installs no compiler and says which build it holds (fleetwire.build_info)."""
    build, run = _stages()
    assert build[0] == "FROM python:3.11-slim AS build"
    assert "ARG FLEETWIRE_MYPYC=1" in build
    wheel = next(i for i, line in enumerate(build) if line.startswith("RUN pip wheel"))
    (install,) = [line for line in build[:wheel] if "apt-get install" in line]
    assert build.index("ARG FLEETWIRE_MYPYC=1") < build.index(install)
    assert not [line for line in run if "apt-get" in line or "gcc" in line]
    assert any(line.startswith("RUN pip install") and "fleetwire.build_info" in line for line in run)
    # The install line run as the build runs it (sh, the build arg in its environment; no globbing), apt-get and rm
    # stand-ins that only say how they were called (never this host's apt lists).
    shim = tmp_path / "bin"
    shim.mkdir()
    calls = tmp_path / "calls"
    for tool in ("apt-get", "rm"):
        (shim / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\n')
        (shim / tool).chmod(0o755)
    compiler = ["apt-get update", "apt-get install -y --no-install-recommends gcc libc6-dev",
                "rm -rf /var/lib/apt/lists/*"]  # fmt: skip
    for switch, expected in (("1", compiler), ("", compiler), ("0", [])):
        calls.unlink(missing_ok=True)
        env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "FLEETWIRE_MYPYC": switch}
        subprocess.run(["sh", "-efc", install.removeprefix("RUN ")], env=env, cwd=tmp_path, check=True, timeout=30)
        assert (calls.read_text().splitlines() if calls.exists() else []) == expected, switch


def test_dockerfile_context_builds_a_complete_wheel(tmp_path: Path) -> None:
    """What the Dockerfile COPYs is enough: its `pip wheel` line, run on just those files, builds a wheel
    holding every module and the dashboard, and the installed wheel runs `fleetwire --version`."""
    lines = _dockerfile_lines()
    src = tmp_path / "src"
    src.mkdir()
    for line in lines:
        if line.startswith("COPY ") and "--from=" not in line:
            *sources, dest = line.split()[1:]
            for name in sources:
                path = ROOT / name
                assert path.exists(), f"the Dockerfile copies {name}, which is not in the repository"
                target = src / (dest if not dest.endswith("/") and dest not in (".", "./") else name)
                if path.is_dir():
                    shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy2(path, target)
    wheel_cmd = next(line for line in lines if line.startswith("RUN pip wheel"))
    argv = shlex.split(wheel_cmd.removeprefix("RUN "))
    argv[argv.index("-w") + 1] = str(tmp_path / "dist")
    # The image's pure build (--build-arg FLEETWIRE_MYPYC=0; the build arg is the RUN lines' environment): the
    # compiled one takes ~2 minutes of CPU, which the deploy tests leave to the image's build.
    env = {**os.environ, "FLEETWIRE_MYPYC": "0"}
    done = subprocess.run([sys.executable, "-m", *argv], cwd=src, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "dist").glob("fleetwire-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name  # the fallback: pure, for any host
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {p.relative_to(ROOT).as_posix() for package in PACKAGES for p in (ROOT / package).rglob("*")
                if p.is_file() and "__pycache__" not in p.parts}  # fmt: skip
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks {missing} (pyproject.toml's packages or package-data)"
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=120)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", "import fleetwire, sys; print(fleetwire.__file__)"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.stdout.strip().startswith(str(site)), done.stdout + done.stderr
    done = subprocess.run([sys.executable, "-m", "fleetwire", "--version"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("fleetwire "), done.stderr


def _walkthrough() -> tuple[str, list[str]]:
    """The TLS walkthrough's certificate script and its three run commands, from docs/OPERATIONS.md."""
    text = OPERATIONS.read_text()
    after = text[text.index("<!-- tls-walkthrough:"):]
    blocks = re.findall(r"```bash\n(.*?)```", after, re.S)
    certs, runs = blocks[0], blocks[1]
    commands = [line for line in runs.splitlines() if line.strip() and not line.startswith("#")]
    return certs, commands


def _local(text: str) -> str:
    return text.replace("coord.example.internal", "localhost").replace("10.0.0.5", "127.0.0.1")


async def _start(cluster: Cluster, command: str, cwd: Path, env: dict[str, str], name: str) -> Proc:
    words = shlex.split(command)
    extra = dict(word.split("=", 1) for word in words if "=" in word.split("/")[0] and words.index(word) == 0)
    words = words[len(extra):]
    assert words[0] == "fleetwire"
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", *words, cwd=cwd, env={**env, **extra},
                                                stdout=pipe, stderr=pipe)  # fmt: skip
    p = Proc(proc, name)
    cluster.procs.append(p)
    return p


@pytest.mark.skipif(shutil.which("openssl") is None, reason="the walkthrough makes its certificates with openssl")
async def test_tls_walkthrough_as_written(cluster: Cluster, tmp_path: Path) -> None:
    """The OPERATIONS.md TLS walkthrough, step by step: openssl CA and certificates, a wss:// coordinator
    with worker mTLS, a worker with its certificate registers, a client lists it; no certificate: refused."""
    certs, (coordinator, worker, client) = _walkthrough()
    openssl = await asyncio.create_subprocess_exec("bash", "-euo", "pipefail", "-c", _local(certs), cwd=tmp_path,
                                                   stderr=asyncio.subprocess.PIPE)  # fmt: skip
    _, err = await asyncio.wait_for(openssl.communicate(), 60)
    assert openssl.returncode == 0, err.decode()
    env = cluster.env(FLEETWIRE_WORKER_TOKEN=WORKER_TOKEN, FLEETWIRE_CLIENT_TOKEN=CLIENT_TOKEN)
    del env["FLEETWIRE_URL"]
    coordinator = coordinator.replace("--host 0.0.0.0 --port 8765", "--host 127.0.0.1 --port 0")
    coord = await _start(cluster, coordinator, tmp_path, env, "coordinator")
    url = (await coord.wait_for_line(r"listening on (wss://\S+)")).group(1)
    port = url.rsplit(":", 1)[1]
    dial = f"wss://127.0.0.1:{port}"
    worker = worker.replace("wss://coord.example.internal:8765", dial)
    gpu = await _start(cluster, worker, tmp_path, {**env, "FLEETWIRE_TOKEN": WORKER_TOKEN}, "gpu-01")
    await gpu.wait_for_line("registered")
    listing = await _start(cluster, client.replace("wss://coord.example.internal:8765", dial), tmp_path,
                           {**env, "FLEETWIRE_TOKEN": CLIENT_TOKEN}, "workers")  # fmt: skip
    assert await listing.wait() == 0
    assert any(line.startswith("gpu-01 ") for line in listing.lines), listing.lines
    # mTLS: the same worker command without its certificate is refused at the handshake.
    bare = re.sub(r" --tls-cert \S+ --tls-key \S+", "", worker).replace("--id gpu-01", "--id gpu-02")
    refused = await _start(cluster, bare, tmp_path, {**env, "FLEETWIRE_TOKEN": WORKER_TOKEN}, "gpu-02")
    assert await refused.wait(60) == 1
    assert refused.proc.stderr is not None
    assert "403" in (await refused.proc.stderr.read()).decode()


def _metric_names(expr_text: str) -> set[str]:
    return set(re.findall(r"\bfleetwire_[a-z0-9_]+", expr_text))


async def test_alert_rules_use_metrics_the_coordinator_exports(cluster: Cluster) -> None:
    """Every fleetwire_* series in examples/deploy/alerts.yml appears in a live coordinator's /metrics."""
    await cluster.coordinator()
    await cluster.worker("w1")
    with pytest.raises(AuthError):  # one refusal, so that fleetwire_refusals_total has a series
        await Client(cluster.url, token="not-a-token-of-this-fleet").connect()
    http_url = cluster.url.replace("ws://", "http://", 1)
    async with httpx.AsyncClient() as http:
        exposition = (await http.get(f"{http_url}/metrics")).text
    exported = {line.split("{")[0].split(" ")[0] for line in exposition.splitlines() if not line.startswith("#")}
    for line in exposition.splitlines():  # labelled families with no series yet (no refusal so far) count too
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}.get(kind, ("",))
            exported.update(name + suffix for suffix in suffixes)
    used = _metric_names(ALERTS.read_text())  # in expressions and in descriptions alike
    assert used, "no fleetwire metric found in the rules"
    assert not sorted(used - exported), f"alerts.yml names metrics the coordinator does not export: {used - exported}"


def test_alert_rules_pass_promtool() -> None:
    """`promtool check rules examples/deploy/alerts.yml` passes (Debian: apt-get install prometheus)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus); the rules were not checked")
    done = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
