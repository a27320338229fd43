"""What a plan sees of its worker (issue #24 parts 2 and 6): environment, spool, devices, user; real processes.

The ``shell`` and ``python`` ops are driven directly with a real spool (worker_agent/spool.py) and
real child processes. Tests of a plan user (``--plan-user``) need root, and run as ``nobody``.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import protocol
from tests.waiting import until
from worker_agent.handlers import Context, make_python_handler, run_handler, shell
from worker_agent.isolation import NO_DEVICES, PlanIsolation
from worker_agent.spool import Spool

pytestmark = pytest.mark.timeout(60)

SECRET = "worker-secret-token-123"
ROOT = Path(__file__).resolve().parents[2]
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="a plan user needs the worker to run as root")


class Sink:
    """Records a plan's events."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any, bool]] = []

    def __call__(self, kind: str, data: Any, ephemeral: bool) -> None:
        self.events.append((kind, data, ephemeral))

    def lines(self, kind: str = "stdout") -> list[str]:
        return [data for k, data, _ in self.events if k == kind]


def make_ctx(args: Any, *, spool: Spool | None = None, plan_id: str = "p1",
             inputs: list[protocol.InputSpec] | None = None, visible: str | None = None,
             isolation: PlanIsolation | None = None) -> tuple[Context, Sink]:  # fmt: skip
    """A plan's Context as the runner builds it (``visible``: its devices' ids on a worker with devices)."""
    sink = Sink()
    ctx = Context(plan_id=plan_id, attempt=1, worker_id="w1", args=args, sink=sink, kill_grace_s=2.0)
    if spool is not None:
        ctx.data = spool.plan_data(plan_id, 1, inputs or [])
        spool.claim(plan_id, 1)
    ctx.cuda_visible_devices = visible
    ctx.devices = visible.split(",") if visible else []
    if isolation is not None:
        ctx.isolation = isolation
    return ctx, sink


async def run_shell(args: dict[str, Any], **options: Any) -> tuple[protocol.Done, Sink, Context]:
    ctx, sink = make_ctx(args, **options)
    return await run_handler(shell, ctx, args), sink, ctx


def spooled_input(spool: Spool, plan_id: str, name: str, content: bytes) -> Path:
    """An input of another plan, received whole in the spool (on disk: over the spool's memory limit)."""
    import hashlib

    entry = spool.declare(plan_id, 1, name, len(content), f"sha256:{hashlib.sha256(content).hexdigest()}")
    entry.write(content)
    entry.finish()
    assert entry.state == "verified" and entry.path is not None
    return entry.path


@pytest.fixture
def secrets_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's environment as `fleetwire up` or a unit file leaves it: tokens and a cloud key."""
    for name in ("FLEETWIRE_WORKER_TOKEN", "FLEETWIRE_TOKEN", "FLEETWIRE_ADMIN_TOKEN", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, SECRET)


# --------------------------------------------------------------------------- environment


@pytest.mark.usefixtures("secrets_in_environment")
async def test_a_shell_plan_sees_no_token_of_the_worker() -> None:
    """`env` in a shell plan: PATH is there, the worker's tokens and other secrets are not."""
    done, sink, _ = await run_shell({"cmd": "env; cat /proc/self/environ | tr '\\0' '\\n'"})
    assert done.outcome == "succeeded", done
    lines = sink.lines()
    assert any(line.startswith("PATH=") for line in lines)
    assert not [line for line in lines if SECRET in line]


@pytest.mark.usefixtures("secrets_in_environment")
async def test_a_python_plan_in_its_own_process_sees_no_token_of_the_worker() -> None:
    """A python plan's own process (a worker with devices) starts with the built environment, not the worker's."""
    op_args = {"function": "tests.plan_functions:seen"}
    ctx, _ = make_ctx(op_args, visible="")
    done = await run_handler(make_python_handler(["tests.plan_functions:*"]), ctx, op_args)
    assert done.outcome == "succeeded", done
    env = done.result["env"]
    assert "PATH" in env and not [k for k, v in env.items() if SECRET in v]
    assert done.result["pid"] != os.getpid()


async def test_plan_env_passes_what_the_operator_names_but_never_fleetwire_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--plan-env NAME and patterns pass those variables; one naming FLEETWIRE_* is refused at start."""
    monkeypatch.setenv("HF_TOKEN", "hf-123")
    monkeypatch.setenv("ACME_REGION", "eu")
    monkeypatch.setenv("FLEETWIRE_WORKER_TOKEN", SECRET)
    done, sink, _ = await run_shell({"cmd": "env"}, isolation=PlanIsolation.of(["HF_TOKEN", "ACME_*"]))
    assert done.outcome == "succeeded", done
    assert "HF_TOKEN=hf-123" in sink.lines() and "ACME_REGION=eu" in sink.lines()
    assert not [line for line in sink.lines() if SECRET in line]
    with pytest.raises(ValueError, match="FLEETWIRE_\\* variables never pass to plans"):
        PlanIsolation.of(["FLEETWIRE_*"])


async def test_the_plans_own_env_is_added_to_the_built_one() -> None:
    """args.env still adds variables (and may set PATH): to the plan's environment, not the worker's."""
    done, sink, _ = await run_shell({"cmd": "echo $GREETING; echo $PATH", "env": {"GREETING": "hi", "PATH": "/bin"}})
    assert done.outcome == "succeeded" and sink.lines() == ["hi", "/bin"], (done, sink.lines())


# --------------------------------------------------------------------------- devices


@pytest.mark.parametrize(
    ("visible", "expected"),
    [("", NO_DEVICES),
     ("2,3", {"CUDA_VISIBLE_DEVICES": "2,3", "NVIDIA_VISIBLE_DEVICES": "2,3", "ROCR_VISIBLE_DEVICES": None})],
    ids=["no-device", "two-devices"],
)  # fmt: skip
async def test_a_shell_plan_sees_its_devices_only(visible: str, expected: dict[str, str | None],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """On a worker with devices a shell plan sees its own (none: CUDA "", NVIDIA void, ROCR ""), whatever its env."""
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "0,1,2,3")
    script = "; ".join(f'echo {name}=${{{name}-unset}}' for name in expected)
    done, sink, _ = await run_shell({"cmd": script, "env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}}, visible=visible)
    assert done.outcome == "succeeded", done
    assert sink.lines() == [f"{name}={'unset' if value is None else value}" for name, value in expected.items()]


# --------------------------------------------------------------------------- spool


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


async def test_spool_directories_are_private_and_named_at_random(tmp_path: Path) -> None:
    """Root 0311 (never listed), an attempt's directory 0700 with a random part, its files 0600."""
    spool = Spool(tmp_path / "spool", memory_bytes=4)
    input_path = spooled_input(spool, "p1", "x", b"on disk")
    output = spool.add_output("p1", 1, "o", b"kept")
    attempt_dir = spool.plan_dir("p1", 1)
    assert mode(spool.root) == 0o311 and mode(attempt_dir) == 0o700
    assert mode(input_path) == 0o600 and mode(output.path) == 0o600
    assert attempt_dir.parent == spool.root and attempt_dir.name.startswith("p1.1.") and len(attempt_dir.name) == 21
    again = Spool(tmp_path / "other", memory_bytes=4)
    assert again.plan_dir("p1", 1).name != attempt_dir.name  # not guessable from the plan id and attempt


async def test_a_declared_output_outside_the_output_directory_is_refused(tmp_path: Path) -> None:
    """outputs {'x': '../../<other attempt>/in-data'} or an absolute path: invalid_argument naming the output."""
    spool = Spool(tmp_path / "spool", memory_bytes=4)
    other = spooled_input(spool, "other", "data", b"another principal's input")
    relative = "../../../" + other.parent.name + "/" + other.name  # from work/outputs, up to the spool's root
    for path in (relative, str(other), "a/../b", ""):
        done, _, _ = await run_shell({"cmd": "true", "outputs": {"x": path}}, spool=spool)
        assert done.outcome == "failed" and done.error is not None, done
        assert done.error.code == "invalid_argument" and "declared output 'x'" in done.error.message
    assert spool.outputs_of("p1", 1) == []


@pytest.mark.parametrize(
    ("cmd", "outputs"),
    [
        ('ln -s "$OTHER" "$FLEETWIRE_OUTPUT_DIR/x"', None),
        ('ln -s "$OTHER" "$FLEETWIRE_OUTPUT_DIR/x"', {"x": "x"}),
        ('ln -s "$(dirname "$OTHER")" "$FLEETWIRE_OUTPUT_DIR/d"', {"x": "d/in-data"}),
        ('rmdir "$FLEETWIRE_OUTPUT_DIR" && ln -s "$(dirname "$OTHER")" "$FLEETWIRE_OUTPUT_DIR"', {"x": "in-data"}),
        ('rmdir "$FLEETWIRE_OUTPUT_DIR" && ln -s "$(dirname "$OTHER")" "$FLEETWIRE_OUTPUT_DIR"', None),
    ],
    ids=["collected", "declared", "through-a-linked-directory", "output-dir-linked", "output-dir-linked-collected"],
)
async def test_an_output_is_never_read_through_a_symbolic_link(tmp_path: Path, cmd: str,
                                                               outputs: dict[str, str] | None) -> None:  # fmt: skip
    """A link in the output directory to another attempt's input: the plan fails naming the output, nothing kept."""
    spool = Spool(tmp_path / "spool", memory_bytes=4)
    other = spooled_input(spool, "other", "data", b"another principal's input")
    args: dict[str, Any] = {"cmd": cmd, "env": {"OTHER": str(other)}}
    if outputs is not None:
        args["outputs"] = outputs
    done, _, _ = await run_shell(args, spool=spool)
    assert done.outcome == "failed" and done.error is not None, done
    assert done.error.code == "handler_error" and "refused" in done.error.message
    assert "symbolic link" in done.error.message
    assert any(name in done.error.message for name in ("'x'", "'d'", "$FLEETWIRE_OUTPUT_DIR")), done.error.message
    assert spool.outputs_of("p1", 1) == []


async def test_a_shell_plan_runs_in_its_scratch_directory_which_goes_with_the_attempt(tmp_path: Path) -> None:
    """Its cwd is the attempt's work/ (its outputs/ inside); the attempt's end removes it and written-out inputs."""
    spool = Spool(tmp_path / "spool", memory_bytes=1024)
    digest = "sha256:" + __import__("hashlib").sha256(b"small").hexdigest()
    entry = spool.declare("p1", 1, "small", 5, digest)
    entry.write(b"small")
    entry.finish()
    spec = protocol.InputSpec(name="small", size=5, digest=digest)
    done, sink, ctx = await run_shell({"cmd": 'pwd; echo "$FLEETWIRE_OUTPUT_DIR"; cat "$FLEETWIRE_INPUT_SMALL" > out'},
                                      spool=spool, inputs=[spec])  # fmt: skip
    assert done.outcome == "succeeded", done
    work = spool.work_dir("p1", 1)
    assert sink.lines() == [str(work), str(work / "outputs")] and (work / "out").read_bytes() == b"small"
    written = ctx.inputs["small"].path  # the in-memory input, written out for the command
    assert ctx.data is not None
    ctx.data.close()
    spool.release("p1", 1)
    assert not written.exists()
    await until(lambda: not work.parent.exists())  # removed in a thread; nothing else was kept


async def test_a_shell_plan_without_data_runs_in_a_temporary_directory_removed_after() -> None:
    """No inputs or outputs: the command starts in a fresh private directory, not the worker's, gone after."""
    done, sink, _ = await run_shell({"cmd": "pwd; stat -c %a ."})
    assert done.outcome == "succeeded", done
    cwd, dir_mode = sink.lines()
    assert cwd != os.getcwd() and "fleetwire-plan-" in cwd and dir_mode == "700"
    assert not await asyncio.to_thread(Path(cwd).exists)


# --------------------------------------------------------------------------- plan user (root only)


def nobody() -> PlanIsolation:
    return PlanIsolation.of((), "nobody")


@pytest.fixture
def passable() -> Iterator[Path]:
    """A directory for a spool whose parents the plan user may pass through (pytest's tmp_path is root's, 0700)."""
    directory = Path(tempfile.mkdtemp(prefix="fleetwire-test-"))
    directory.chmod(0o711)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def runs_as_nobody(path: str) -> bool:
    """Whether nobody may run ``path`` (this interpreter may live in root's home)."""
    return subprocess.run(["test", "-x", path], user="nobody", check=False).returncode == 0


@as_root
async def test_a_plan_user_runs_the_command_and_cannot_reach_other_attempts(passable: Path) -> None:
    """As nobody: its own input is readable, its outputs kept; another attempt's input and the spool's list are not."""
    spool = Spool(passable / "spool", memory_bytes=4)
    other = spooled_input(spool, "other", "data", b"another principal's input")
    own = spooled_input(spool, "p1", "mine", b"my input")
    spec = protocol.InputSpec(name="mine", size=len(b"my input"), digest=spool.input("p1", 1, "mine").digest)
    cmd = ('id -u; cat "$FLEETWIRE_INPUT_MINE" > "$FLEETWIRE_OUTPUT_DIR/copy"; '
           'cat "$OTHER" || echo cannot-read-other; ls "$SPOOL" || echo cannot-list-spool')  # fmt: skip
    done, sink, _ = await run_shell({"cmd": cmd, "env": {"OTHER": str(other), "SPOOL": str(spool.root)}},
                                    spool=spool, inputs=[spec], isolation=nobody())  # fmt: skip
    assert done.outcome == "succeeded", (done, sink.events)
    assert sink.lines() == [str(pwd.getpwnam("nobody").pw_uid), "cannot-read-other", "cannot-list-spool"]
    assert [o.name for o in spool.outputs_of("p1", 1)] == ["copy"], sink.events
    assert own.read_bytes() == b"my input"


@as_root
async def test_a_python_plan_of_a_plan_user_runs_as_it_and_leaves_only_its_own_files(passable: Path) -> None:
    """A python plan runs as nobody in its own process; ctx.output of a file it made is kept, of /etc/shadow refused."""
    if not runs_as_nobody(sys.executable) or not runs_as_nobody(str(ROOT / "worker_agent" / "pychild.py")):
        pytest.skip(f"nobody cannot run {sys.executable} or read this checkout")
    spool = Spool(passable / "spool", memory_bytes=4)
    python = make_python_handler(["tests.plan_functions:*"])
    args = {"function": "tests.plan_functions:leave_file", "args": ["made", "by the plan"]}
    ctx, _ = make_ctx(args, spool=spool, isolation=nobody())
    done = await run_handler(python, ctx, args)
    assert done.outcome == "succeeded", done
    [kept] = spool.outputs_of("p1", 1)
    assert kept.size == len(b"by the plan")
    args = {"function": "tests.plan_functions:leave_path", "args": ["/etc/shadow"]}
    ctx, _ = make_ctx(args, spool=spool, plan_id="p2", isolation=nobody())
    done = await run_handler(python, ctx, args)
    assert done.outcome == "failed" and done.error is not None and "PermissionError" in done.error.message, done
    assert spool.outputs_of("p2", 1) == []


@as_root
async def test_a_plan_user_that_cannot_run_the_interpreter_is_named() -> None:
    """Where nobody cannot run this interpreter (it lives in root's home), the plan fails saying what nobody needs."""
    if runs_as_nobody(sys.executable):
        pytest.skip("nobody can run this interpreter here")
    args = {"function": "tests.plan_functions:seen"}
    ctx, _ = make_ctx(args, isolation=nobody())
    done = await run_handler(make_python_handler(["tests.plan_functions:*"]), ctx, args)
    assert done.outcome == "failed" and done.error is not None, done
    assert "exited with status 127" in done.error.message
    assert f"as --plan-user nobody, who must be able to run {sys.executable}" in done.error.message


@as_root
def test_a_plan_user_needs_a_root_worker_and_a_real_user() -> None:
    """--plan-user root or an unknown name is refused at start, naming it."""
    with pytest.raises(ValueError, match="is root"):
        PlanIsolation.of((), "root")
    with pytest.raises(ValueError, match="no such user"):
        PlanIsolation.of((), "fleetwire-no-such-user")


# --------------------------------------------------------------------------- the worker's own process

LOCK_PROBE = """
import ctypes, os, subprocess, sys
from worker_agent.isolation import lock_worker_process
if os.geteuid() == 0:  # root reads any process's /proc: be nobody (which clears the dumpable flag: set it again)
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)
if sys.argv[1] == "lock":
    assert lock_worker_process()
os.environ.pop("FLEETWIRE_WORKER_TOKEN")  # as `fleetwire worker` does: /proc/PID/environ still has it
seen = subprocess.run(["cat", f"/proc/{os.getpid()}/environ"], capture_output=True, env={"PATH": os.defpath})
print("secret-seen" if b"FLEETWIRE_WORKER_TOKEN" in seen.stdout else "secret-hidden")
"""


@pytest.mark.parametrize(("lock", "expected"), [("lock", "secret-hidden"), ("no-lock", "secret-seen")])
def test_a_locked_process_keeps_its_start_environment_from_same_user_processes(lock: str, expected: str) -> None:
    """A child of the same (non-root) user reads the worker's /proc/PID/environ unless the worker is non-dumpable."""
    done = subprocess.run([sys.executable, "-c", LOCK_PROBE, lock], capture_output=True, text=True, cwd=ROOT,
                          env={"PATH": os.defpath, "FLEETWIRE_WORKER_TOKEN": SECRET, "PYTHONPATH": str(ROOT)},
                          timeout=30)  # fmt: skip
    assert done.stdout.strip() == expected, done.stderr
