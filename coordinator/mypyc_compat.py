"""What the core needs to compile with mypyc (``FLEETWIRE_MYPYC=1``, setup.py), and nothing when it runs pure.

:func:`mypyc_attr` is ``mypy_extensions.mypyc_attr``: mypyc reads it at build time (a compiled module never
calls it) and type checking sees it. At run time it is that function where ``mypy_extensions`` is installed
(it comes with mypy), else a stand-in that returns the class unchanged: the pure core needs nothing new.
This module is never compiled (setup.py leaves it out).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["mypyc_attr"]

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr
else:
    try:
        from mypy_extensions import mypyc_attr
    except ImportError:  # a pure install without mypy: the decorator only speaks to mypyc

        def mypyc_attr(*attrs, **kwattrs):
            return lambda cls: cls
