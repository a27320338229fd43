"""Third-party packages imported without the optional extras fleetwire never uses.

Every fleetwire process is a fresh interpreter (the e2e tests start hundreds), so what its imports
pull in is its start-up time. Some dependencies import an optional package whenever it is
installed, for a feature we never call: structlog imports rich (pretty tracebacks, locals) and
greenlet (its deprecated threadlocal); httpx imports click, pygments and rich for its own
command-line client (``httpx._main``). :func:`without` makes such a package look absent to the
imports inside its block; once the block ends, ``import rich`` (a CLI table) works as usual.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

__all__ = ["import_httpx", "without"]


@contextlib.contextmanager
def without(*names: str) -> Iterator[None]:
    """Modules ``names`` (not yet imported) look absent to the imports inside the block."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # ``import name`` raises ImportError
    try:
        yield
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def import_httpx() -> None:
    """Import httpx without its command-line client (click, pygments, rich: ~100 ms of a worker's start)."""
    with without("click"):
        import httpx  # noqa: F401
