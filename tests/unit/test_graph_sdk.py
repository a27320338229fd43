"""Plan graphs in the SDK and the CLI (issue #28): the submit a reference and an order make, and how the CLI
reads ``--input x=plan:ID/NAME``."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from fleetwire import OutputRef, submits
from fleetwire.cli.main import _inputs, _outputs
from protocol.messages import InputSpec, Submit


def _message(**options: object) -> Submit:
    ids = itertools.count(1)
    fields: dict[str, object] = {"outputs": (), **options}
    return submits.submit_message(
        ids.__next__, "b", None, {}, tags=None, requirements=None, priority=0, timeout_s=None, max_attempts=3,
        retries=0, plan_id="p2", hints=None, session_key=None, policy=None, resources=None,
        **fields,  # type: ignore[arg-type]
    )


def test_a_reference_is_an_input_in_the_reference_form_with_nothing_to_upload() -> None:
    """An OutputRef input becomes InputSpec(name, ref=...) without size or digest; after and deterministic ride
    along; on the wire the reference form leaves size and digest out."""
    msg = _message(refs={"x": OutputRef("a1b2", "y")}, after=["a0"], deterministic=False)
    assert msg.inputs == [InputSpec("x", ref=OutputRef("a1b2", "y"))]
    assert msg.after == ["a0"] and msg.deterministic is False
    wire = msgspec.json.encode(msg)
    assert b'"inputs":[{"name":"x","ref":{"plan_id":"a1b2","name":"y"}}]' in wire


def test_a_submit_without_graph_options_is_unchanged_on_the_wire() -> None:
    """No reference, no order: nothing new is sent (the defaults are omitted)."""
    wire = msgspec.json.encode(_message())
    assert b"after" not in wire and b"deterministic" not in wire and b"inputs" not in wire


def test_the_cli_reads_another_plans_output_as_an_input() -> None:
    """``--input x=plan:ID/NAME`` is OutputRef(ID, NAME); an id may hold '/', the output name may not."""
    assert _inputs(["x=plan:a1b2/y", "z=plan:team/run-7/out.bin"]) == {
        "x": OutputRef("a1b2", "y"), "z": OutputRef("team/run-7", "out.bin"),
    }


@pytest.mark.parametrize("spec", ["x=plan:a1b2", "x=plan:/y", "x=plan:a1b2/", "x=a1b2/y"])
def test_the_cli_refuses_a_malformed_reference_saying_the_form(spec: str) -> None:
    """A reference without a plan id or an output name is refused, showing NAME=plan:PLAN_ID/OUTPUT."""
    with pytest.raises(ValueError, match="plan:PLAN_ID/OUTPUT"):
        _inputs([spec])


def test_outputs_with_replicas_become_the_submits_replicas() -> None:
    """outputs={"y": {"replicas": 2}, "log": None} names both outputs and asks for two copies of y; plain names
    send no replicas; an unknown option or a non-int count is refused before anything is sent."""
    msg = _message(outputs={"y": {"replicas": 2}, "log": None})
    assert msg.outputs == ["y", "log"] and msg.replicas == {"y": 2}
    assert b"replicas" not in msgspec.json.encode(_message(outputs=["y"]))
    with pytest.raises(ValueError, match="unknown options \\['copies'\\]"):
        submits.output_options({"y": {"copies": 2}})
    with pytest.raises(ValueError, match="must be an int"):
        submits.output_options({"y": {"replicas": "2"}})


def test_the_cli_reads_output_replicas() -> None:
    """--output-replicas y=2 with --output log: both outputs, two copies of y; a malformed one says the form."""
    assert _outputs(["log"], ["y=2"]) == {"log": {}, "y": {"replicas": 2}}
    assert _outputs(["y"], []) == ["y"]
    with pytest.raises(ValueError, match="expected NAME=N"):
        _outputs([], ["y"])
