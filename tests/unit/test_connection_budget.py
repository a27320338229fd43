"""Every listener's connection budget (coordinator/io/frontdoor/admission.py ``ConnectionBudget``), without sockets."""

from __future__ import annotations

from structlog.testing import capture_logs

from coordinator.io.frontdoor.admission import ConnectionBudget, RefusalLog


class _Transport:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class _Conn:
    def __init__(self, n: int) -> None:
        self.remote_address = ("10.0.0.7", n)
        self.transport = _Transport()


def test_a_budget_evicts_the_oldest_and_logs_its_own_reason() -> None:
    """Past the limit the oldest counted connection is aborted and logged under the listener's reason."""
    budget = ConnectionBudget(2, RefusalLog(burst=5), "metrics-listener connection budget")
    conns = [_Conn(i) for i in range(4)]
    with capture_logs() as logs:
        for conn in conns:
            budget.opened(conn)
    assert [c.transport.aborted for c in conns] == [True, True, False, False]
    assert (len(budget), budget.evicted, budget.accepted) == (2, 2, 4)
    assert [e["reason"] for e in logs] == ["metrics-listener connection budget"] * 2
    assert logs[0]["address"] == "10.0.0.7:0"
    budget.close()
    assert all(c.transport.aborted for c in conns) and len(budget) == 0


def test_a_budget_of_zero_counts_but_never_evicts() -> None:
    """limit 0: no budget; connections are counted and none is aborted."""
    budget = ConnectionBudget(0, RefusalLog())
    conns = [_Conn(i) for i in range(50)]
    for conn in conns:
        budget.opened(conn)
    assert len(budget) == 50 and budget.evicted == 0 and not any(c.transport.aborted for c in conns)
    budget.finished(conns[0])
    budget.finished(conns[0])  # idempotent
    assert len(budget) == 49
