"""The per-plan (per-message, per-batch) functions make no closure cell a call (docs/PERFORMANCE.md §T32j).

CPython 3.11 makes the cells of a function's closed-over variables (its comprehensions', lambdas', inner
functions') at every call, whether the code that reads them runs or not: the closures of these functions live
in helpers called only when they are needed (as Tracing.start_each's ``_start_sampled``). Under the compiled
core (mypyc) the coordinator's functions are not code objects: their pure source is checked.
"""

from __future__ import annotations

import types
from pathlib import Path

import coordinator.client_session
import coordinator.scheduling
import fleetwire.submits
import worker_agent.runner


def _cells(module: types.ModuleType, qualname: str) -> tuple[str, ...]:
    """The cell variables of ``qualname`` in ``module``'s source (compiled from it: a mypyc build has none)."""
    path = Path(module.__file__ or "").with_name(module.__name__.rpartition(".")[2] + ".py")
    code = compile(path.read_text(), str(path), "exec")
    for part in qualname.split("."):
        code = next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == part)
    return code.co_cellvars


def test_the_per_plan_functions_make_no_cell_a_call() -> None:
    cells = {}
    for module, qualname in [
        (worker_agent.runner, "PlanRunner._start"),  # each plan a worker starts
        (worker_agent.runner, "PlanRunner._release"),  # each plan it ends
        (coordinator.client_session, "ClientSessions.on_message"),  # each client message
        (coordinator.scheduling, "Scheduler.fill_worker"),  # each worker with room
    ]:
        cells[qualname] = _cells(module, qualname)
    assert cells == dict.fromkeys(cells, ())


def test_a_batch_makes_only_the_cells_of_its_submits_comprehension() -> None:
    """``submits.batch``: the comprehension that makes every batch's submits reads three of its variables (cells
    used at each call); the refusal of an item too large, a generator over ``max_inline_bytes``, is ``_too_large``'s."""
    assert set(_cells(fleetwire.submits, "batch")) == {"fresh", "replace", "template"}
