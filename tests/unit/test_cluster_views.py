"""The main port's /v1/plans query: states and limit checked, each error naming what was wrong."""

from __future__ import annotations

import pytest

from coordinator.io.cluster.views import MAX_LIMIT, ViewError, parse_query


def test_query_takes_an_id_states_and_a_limit() -> None:
    """?id=, ?state=a,b (repeatable) and ?limit= are read; the limit defaults to 200."""
    assert parse_query({}) == (None, [], 200)
    assert parse_query({"id": ["p1"], "state": ["queued,running", "failed"], "limit": ["7"]}) == (
        "p1", ["queued", "running", "failed"], 7)  # fmt: skip


@pytest.mark.parametrize(("query", "words"), [
    ({"state": ["queued,bogus"]}, "unknown state bogus"),
    ({"limit": ["x"]}, "'x' is not an integer"),
    ({"limit": [str(MAX_LIMIT + 1)]}, "out of range"),
    ({"limit": ["0"]}, "out of range"),
])  # fmt: skip
def test_bad_query_is_refused_naming_the_parameter(query: dict[str, list[str]], words: str) -> None:
    """An unknown state or a bad limit is a ViewError that names it."""
    with pytest.raises(ViewError, match=words):
        parse_query(query)
