"""Functions the ``python`` op runs in tests of what a plan may call and what it sees (issue #24).

Besides plain functions, this module holds what a careless handler module holds: names imported
from the standard library, a class, a lambda, a callable object. Each must be refused when a plan
names it through this module (tests/unit/test_python_allow.py), with the allow-list
``tests.plan_functions:*``.
"""

from __future__ import annotations

import functools
import os
import subprocess  # noqa: F401  (an attribute walk would reach subprocess.run through it)
from os import system  # noqa: F401  (a built-in re-exported: refused)
from subprocess import getoutput, run  # noqa: F401  (plain functions defined in subprocess: refused)
from typing import Any


def seen(ctx: Any = None) -> dict[str, Any]:
    """What the function's process is and sees: its pid, user, working directory and environment."""
    return {"pid": os.getpid(), "uid": os.getuid(), "cwd": os.getcwd(), "env": dict(os.environ)}


def leave_file(name: str, content: str, ctx: Any) -> str:
    """Write ``content`` to a file ``name`` in the working directory and leave it as output ``out``."""
    with open(name, "w") as f:
        f.write(content)
    ctx.output("out", name)
    return "left"


def leave_path(path: str, ctx: Any) -> str:
    """Leave the file at ``path``, wherever it is, as output ``out``."""
    ctx.output("out", path)
    return "left"


def exit_process(code: int) -> None:
    """End the process running the plan at once (a poison plan: the worker's, when run in it)."""
    os._exit(code)


def plain(x: int) -> int:
    """A plain function: the only kind a plan may call."""
    return x + 1


alias = plain  # the same plain function under another name (it is still plain, defined here)


class Klass:
    """A class: never called as a plan's function, nor its attributes."""

    @staticmethod
    def method() -> str:
        return "static"

    def __call__(self) -> str:
        return "called"


instance = Klass()  # a callable object
lam = lambda: "lambda"  # noqa: E731  (a lambda is not a top-level def)
partial_plain = functools.partial(plain, 1)  # a partial is not a plain function


def _outer() -> Any:
    def inner() -> str:
        return "inner"

    return inner


nested = _outer()  # a function defined inside another
