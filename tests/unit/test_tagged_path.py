"""A tagged plan's placement path (issue #29, cluster mode routes by a pool's tag): the shortcuts for the usual
one tag and short tags give the same answers as the general code.

``submit_problem`` skips the per-tag cap check when every tag is short; ``Signature.of`` keeps one tag as it is;
``Signature.meets`` looks one tag up in the worker's list. Each is compared with the general rule it replaces
on generated tag lists (hypothesis), and the edges are spelled out.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.placement.plan_queue import Signature, explain_wait
from coordinator.plans import submit_problem
from coordinator.workers import WorkerRecord
from protocol.caps import MAX_TAG_BYTES, MAX_TAGS, tags_problem
from protocol.messages import Capabilities, Requirements, Submit

_TAG = st.text(alphabet=st.sampled_from(["a", "b", "p", ":", "é", "\U0001f600"]), max_size=MAX_TAG_BYTES // 2)


def _worker(tags: list[str]) -> WorkerRecord:
    return WorkerRecord("w", Capabilities(ops=["x"], max_concurrency=1, tags=tags))


@settings(max_examples=300, deadline=None)
@given(st.lists(_TAG, max_size=MAX_TAGS + 2))
def test_a_submit_s_tags_are_refused_exactly_as_the_caps_say(tags: list[str]) -> None:
    """submit_problem's verdict on the tags is tags_problem's, whether or not its short-tag shortcut applies."""
    msg = Submit(req_id=1, op="x", requirements=Requirements(tags=tags))
    assert submit_problem(msg) == tags_problem("requirements.tags", tags)


def test_a_long_tag_behind_short_ones_is_named() -> None:
    """A tag over the cap after short ones is refused by its index; one of 4-byte characters at the cap passes."""
    at_cap = "\U0001f600" * (MAX_TAG_BYTES // 4)
    assert submit_problem(Submit(req_id=1, op="x", requirements=Requirements(tags=["pool:a", at_cap]))) is None
    problem = submit_problem(Submit(req_id=1, op="x", requirements=Requirements(tags=["pool:a", at_cap + "a"])))
    assert problem is not None and "requirements.tags[1]" in problem and str(MAX_TAG_BYTES) in problem


@settings(max_examples=300, deadline=None)
@given(st.lists(_TAG, max_size=4), st.lists(_TAG, max_size=4))
def test_a_signature_s_tags_and_the_workers_it_meets_follow_the_general_rule(
    wanted: list[str], offered: list[str]
) -> None:
    """Signature.of sorts and de-duplicates the tags (one tag as it is); meets holds when the worker has them all."""
    signature = Signature.of("x", Requirements(tags=wanted))
    assert signature.tags == tuple(sorted(set(wanted)))
    assert signature.meets(_worker(offered)) == set(wanted).issubset(offered)


def test_a_one_tag_signature_names_its_tag_when_no_worker_has_it() -> None:
    """The waiting reason of a one-tag signature names the tag as the general rule words it."""
    signature = Signature.of("x", Requirements(tags=["pool:gpu"]))
    assert signature.meets(_worker(["pool:cpu", "pool:gpu"]))
    assert explain_wait(signature, [_worker(["pool:cpu"])]) == "no worker handling op 'x' has tags [pool:gpu]"
