"""AgentSettings: checked when built, and the same agent whether given whole or as keyword arguments."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from worker_agent import Agent, AgentSettings
from worker_agent.settings import AgentOptions


def test_keyword_options_are_exactly_the_settings_fields() -> None:
    """Every AgentSettings field is an Agent keyword argument, and nothing else is."""
    assert set(AgentOptions.__annotations__) == {f.name for f in dataclasses.fields(AgentSettings)}


def test_keywords_build_the_same_settings_and_override_given_ones() -> None:
    """Agent(url, tags=...) equals Agent(url, settings=AgentSettings(tags=...)); keywords beside settings win."""
    by_keywords = Agent("ws://h:1", worker_id="w", tags=["a"], max_concurrency=2)
    by_settings = Agent("ws://h:1", settings=AgentSettings(worker_id="w", tags=["a"], max_concurrency=2))
    assert by_keywords.settings == by_settings.settings
    assert by_keywords.worker_id == "w" and by_keywords.settings.tags == ("a",)
    both = Agent("ws://h:1", settings=AgentSettings(max_concurrency=2, tags=["a"]), max_concurrency=7)
    assert (both.settings.max_concurrency, both.settings.tags) == (7, ("a",))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"encoding": "xml"}, "encoding"),
        ({"max_concurrency": -1}, "max_concurrency"),
        ({"reconnect_base_s": 2.0, "reconnect_cap_s": 1.0}, "reconnect"),
        ({"max_frame_bytes": 100}, "max_frame_bytes"),
        ({"kv_blocks": -1}, "kv_blocks"),
        ({"on_quarantine": "drop"}, "on_quarantine"),
    ],
)
def test_out_of_range_settings_are_refused(options: dict[str, Any], message: str) -> None:
    """A value out of range raises ValueError naming the field, from AgentSettings and from Agent alike."""
    with pytest.raises(ValueError, match=message):
        AgentSettings(**options)
    with pytest.raises(ValueError, match=message):
        Agent("ws://h:1", **options)


def test_flags_override_the_probed_capabilities() -> None:
    """models, accelerator, carbon zone and KV budget become capability overrides; unset ones do not."""
    assert AgentSettings().advertised_capabilities() == {}
    settings = AgentSettings(
        models=["m", "m", "n"], accelerator="gpu", carbon_zone="FR", kv_blocks=8, kv_block_tokens=16
    )
    assert settings.advertised_capabilities() == {
        "models": ["m", "n"], "accelerator": "gpu", "carbon_zone": "FR", "kv_blocks": 8, "kv_block_tokens": 16,
    }


def test_the_on_quarantine_flag_reaches_the_settings() -> None:
    """`fleetwire worker --on-quarantine requeue` sets on_quarantine; the default is finish; another word is refused."""
    import argparse

    from worker_agent.main import _settings, add_worker_arguments

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    assert _settings(parser.parse_args(["--on-quarantine", "requeue"])).on_quarantine == "requeue"
    assert _settings(parser.parse_args([])).on_quarantine == "finish"
    with pytest.raises(SystemExit):
        parser.parse_args(["--on-quarantine", "drop"])
