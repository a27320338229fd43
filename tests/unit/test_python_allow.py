"""What the ``python`` op may call (issue #24 part 1): the resolved function is checked, not the target string.

The probe's escapes, with the documented allow-list shape ``--python-allow 'mymod:*'``: each is
refused with ``invalid_argument`` naming the target, in the worker's process and in a plan's own
process (worker_agent/pychild.py checks again what the target resolves to there). The same list is
in docs/OPERATIONS.md §Security.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from worker_agent.handlers import Context, make_python_handler, run_handler
from worker_agent.pychild import resolve_allowed

pytestmark = pytest.mark.timeout(60)

MOD = "tests.plan_functions"
ALLOW = [f"{MOD}:*"]

#: (target, what the refusal says), under ALLOW.
ESCAPES = [
    (f"{MOD}:os.system", "attribute paths are refused"),  # the probe: ran `id` as root
    (f"{MOD}:os.environ.get", "attribute paths are refused"),  # the probe: returned the worker token
    (f"{MOD}:subprocess.run", "attribute paths are refused"),
    (f"{MOD}:Klass.method", "attribute paths are refused"),  # a class attribute
    (f"{MOD}:system", "built-in function (posix.system)"),  # `from os import system`
    (f"{MOD}:run", "it is subprocess:run, defined in a module the allow-list does not match"),  # re-export
    (f"{MOD}:getoutput", "it is subprocess:getoutput, defined in a module the allow-list does not match"),
    (f"{MOD}:subprocess", "a module (subprocess)"),
    (f"{MOD}:Klass", "a class (tests.plan_functions.Klass)"),
    (f"{MOD}:instance", "a Klass object"),  # a callable object
    (f"{MOD}:partial_plain", "a partial object"),
    (f"{MOD}:lam", "defined inside a class or a function"),  # a lambda
    (f"{MOD}:nested", "defined inside a class or a function"),
    (f"{MOD}:__import__", "names starting with '__' are never called"),
    (f"{MOD}:__builtins__", "names starting with '__' are never called"),
    (f"{MOD}.__class__:plain", "names starting with '__' are never called"),
    (f"{MOD}:", "is not of the form 'module:function'"),
    ("builtins:eval", "is not allowed on worker w1"),
    ("os:system", "is not allowed on worker w1"),
    (f"{MOD}x:plain", "is not allowed on worker w1"),
]


def make_ctx(args: Any, *, own_process: bool) -> Context:
    """A plan's Context; ``own_process``: as on a worker with devices (the function runs in a child)."""
    ctx = Context(plan_id="p1", attempt=1, worker_id="w1", args=args, sink=lambda kind, data, ephemeral: None)
    if own_process:
        ctx.cuda_visible_devices = ""  # a plan holding no device on a worker that has some
    return ctx


async def call(target: str, args: list[Any], *, allow: list[str] = ALLOW, own_process: bool = False) -> Any:
    op_args = {"function": target, "args": args}
    return await run_handler(make_python_handler(allow), make_ctx(op_args, own_process=own_process), op_args)


@pytest.mark.parametrize("own_process", [False, True], ids=["worker-process", "own-process"])
@pytest.mark.parametrize(("target", "why"), ESCAPES)
async def test_escapes_through_an_allowed_module_are_refused(target: str, why: str, own_process: bool) -> None:
    """Each known escape fails invalid_argument naming the target and why, and runs nothing."""
    done = await call(target, ["true"], own_process=own_process)
    assert done.outcome == "failed" and done.error is not None, done
    assert done.error.code == "invalid_argument"
    assert repr(target) in done.error.message and why in done.error.message, done.error.message


async def test_os_environ_get_no_longer_returns_the_worker_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's `mymod:os.environ.get` with the worker token in the environment: refused, no token in the answer."""
    monkeypatch.setenv("FLEETWIRE_WORKER_TOKEN", "worker-secret-123")
    done = await call(f"{MOD}:os.environ.get", ["FLEETWIRE_WORKER_TOKEN"])
    assert done.outcome == "failed" and "worker-secret-123" not in repr(done)


@pytest.mark.parametrize("own_process", [False, True], ids=["worker-process", "own-process"])
async def test_plain_functions_of_an_allowed_module_run(own_process: bool) -> None:
    """A top-level def of the allowed module runs, by its name or an alias of it in the same module."""
    for target in (f"{MOD}:plain", f"{MOD}:alias"):
        done = await call(target, [41], own_process=own_process)
        assert done.outcome == "succeeded" and done.result == 42, done


def test_a_target_listed_exactly_may_be_a_re_export() -> None:
    """A re-exported plain function runs only when the operator lists the target exactly, or its own module."""
    import subprocess

    assert resolve_allowed(f"{MOD}:run", [f"{MOD}:run"], "w1") is subprocess.run
    assert resolve_allowed(f"{MOD}:run", [*ALLOW, "subprocess:*"], "w1") is subprocess.run
    with pytest.raises(ValueError, match=r"list 'tests\.plan_functions:run' exactly"):
        resolve_allowed(f"{MOD}:run", ALLOW, "w1")


def test_a_catch_all_pattern_still_refuses_built_ins() -> None:
    """--python-allow '*' allows plain functions anywhere (documented as code execution), never a built-in."""
    with pytest.raises(ValueError, match=r"built-in function \(posix.system\)"):
        resolve_allowed("os:system", ["*"], "w1")
    with pytest.raises(ValueError, match=r"built-in function \(builtins.eval\)"):
        resolve_allowed("builtins:eval", ["*"], "w1")


async def test_nothing_ran_for_a_refused_escape(tmp_path: Path) -> None:
    """`mymod:os.system` with a command that would leave a file: refused, and the file is never made."""
    marker = tmp_path / "ran"
    done = await call(f"{MOD}:os.system", [f"touch {marker}"])
    assert done.outcome == "failed" and not marker.exists()
