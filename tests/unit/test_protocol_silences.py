"""Where docs/PROTOCOL.md was silent or said otherwise than the code (issue #25 part 12), driven through the
real codecs and core (the :class:`Wire` of tests/unit/test_protocol_truths.py).

* an uploaded input's ``InputSpec.digest`` is required: the table says so, and a submit whose uploaded input
  has none is refused naming the field (issue #28 gave it a default ``""``: an input in the reference form
  has none);
* the lifecycle table of §6 names every key the core puts in a terminal event's ``data``
  (``receipt`` was missing).

(An ``event`` without ``attempt``: tests/unit/test_protocol_truths.py.)
"""

from __future__ import annotations

import re
from typing import Any

from protocol import errors
from protocol.messages import Receipt
from tests.unit.test_protocol_truths import PROTOCOL_MD, Wire, _tables

DIGEST = "sha256:" + "ab" * 32
RECEIPT = {"joules": 2.0, "source": "power_model", "estimated": True}


def test_an_input_without_a_digest_is_refused_naming_its_field_as_the_table_says() -> None:
    """InputSpec's table says an uploaded input's digest is required, and a submit whose input has none is
    refused with invalid_argument naming ``inputs[0].digest``; with one it is accepted."""
    (table,) = _tables()["InputSpec"]
    assert "required for an uploaded input" in PROTOCOL_MD.read_text().split("**InputSpec**")[1].split("**")[0]
    assert table["fields"]["digest"] == '`""`'
    wire = Wire()
    client = wire.open("client")
    wire.send_json(client, {"type": "submit", "req_id": 1, "op": "echo", "inputs": [{"name": "a", "size": 1}]})
    [error] = wire.errors(client)
    assert error["code"] == errors.INVALID_ARGUMENT and "inputs[0].digest is required" in error["message"]
    assert error["req_id"] == 1
    wire.send_json(client, {"type": "submit", "req_id": 2, "op": "echo",
                            "inputs": [{"name": "a", "size": 1, "digest": DIGEST}]})  # fmt: skip
    assert [m["type"] for m in wire.take(client)][:1] == ["accepted"]


def _row_keys(kind: str) -> set[str]:
    """The ``data`` keys the §6 lifecycle table lists for ``kind``."""
    for line in PROTOCOL_MD.read_text().splitlines():
        if line.startswith(f"| `{kind}` | `{{"):
            return set(re.findall(r'"(\w+)":', line.split("|")[2]))
    raise AssertionError(f"no §6 row for {kind}")


def _terminal_data(outcome: str) -> dict[str, Any]:
    wire = Wire()
    worker, client = wire.worker(), wire.open("client")
    plan_id = wire.run_plan(client, worker)
    done: dict[str, Any] = {"type": "done", "plan_id": plan_id, "attempt": 1, "outcome": outcome, "seq": 2,
                            "receipt": RECEIPT}  # fmt: skip
    if outcome == "failed":
        done["error"] = {"code": "handler_error", "message": "boom"}
    else:
        done["result"] = 1
    wire.send_json(worker, done)
    (event,) = [m for m in wire.take(client) if m.get("kind") == outcome]
    return dict(event["data"])


def test_the_lifecycle_table_names_every_key_of_a_terminal_events_data() -> None:
    """succeeded and failed events with a receipt: every key of their data is in the §6 row of their kind."""
    for outcome in ("succeeded", "failed"):
        data = _terminal_data(outcome)
        assert "receipt" in data and Receipt(**data["receipt"]).joules == 2.0
        assert set(data) <= _row_keys(outcome), (outcome, set(data) - _row_keys(outcome))
