"""A worker names its id in the upgrade request (issue 17: the reconnect budget must not hold its neighbours).

``?worker_id=`` (protocol/urls.py) keys the reconnect-budget penalty box by id (coordinator/io/frontdoor/gate.py),
so a session that named an id must say the same id in ``hello``; these are the pure parts. Over
loopback sockets with real agents: tests/integration/test_reconnect_key.py.
"""

from __future__ import annotations

from protocol import errors
from protocol.messages import Capabilities, Hello, Welcome
from protocol.urls import named_worker_id, with_worker_id
from tests.unit.test_core import Harness


def test_the_agent_url_names_its_id_once_and_keeps_the_pool() -> None:
    """with_worker_id appends ?worker_id= (after ?pool=), encoded, replacing one the URL names."""
    assert with_worker_id("ws://h:1/v1/worker", "w1") == "ws://h:1/v1/worker?worker_id=w1"
    assert with_worker_id("ws://h:1/v1/worker?pool=gpu", "w 1&x") == "ws://h:1/v1/worker?pool=gpu&worker_id=w+1%26x"
    assert with_worker_id("ws://h:1/v1/worker?worker_id=a&pool=p", "b") == "ws://h:1/v1/worker?pool=p&worker_id=b"


def test_the_named_id_is_read_back_from_the_request_target() -> None:
    """named_worker_id reads what with_worker_id wrote; none, an empty value or another parameter name none."""
    target = with_worker_id("ws://h:1/v1/worker?pool=gpu", "w 1&x")
    assert named_worker_id(target[len("ws://h:1") :]) == "w 1&x"
    assert named_worker_id("/v1/worker") is None
    assert named_worker_id("/v1/worker?worker_id=") is None
    assert named_worker_id("/v1/worker?pool=a&workerid=x") is None
    assert named_worker_id("/v1/worker?worker_id=a&worker_id=b") == "b"  # the last counts, for driver and core alike


def hello(h: Harness, named: str | None, says: str) -> int:
    """A worker session whose upgrade named ``named`` says hello ``says``; its connection id."""
    conn = next(h._conns)
    h.core.open_session(conn, "worker", h.now, address="127.0.0.1:4000", named_worker_id=named)
    h.send(conn, Hello(worker_id=says, capabilities=Capabilities(ops=["echo"])))
    return conn


def test_a_hello_must_say_the_id_its_upgrade_named() -> None:
    """Upgrade named 'a', hello 'b': closed 4403 naming both ids, nothing registered; 'a' and unnamed are welcomed."""
    h = Harness()
    dodge = hello(h, "a", "b")
    assert not any(isinstance(m, Welcome) for m in h.take(dodge))
    [(code, reason)] = [(code, reason) for c, code, reason in h.closes if c == dodge]
    assert code == errors.CLOSE_FORBIDDEN and "'b'" in reason and "'a'" in reason
    assert "b" not in h.core.registry
    assert h.core.counters["scope_refused.worker_id"] == 1
    assert any(isinstance(m, Welcome) for m in h.take(hello(h, "a", "a")))
    assert any(isinstance(m, Welcome) for m in h.take(hello(h, None, "c")))  # old clients name no id
