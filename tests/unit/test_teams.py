"""Teams in the token file (issue #27): ``team`` and ``weight`` on entries, ``[[team]]`` tables, reloads."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.auth import TokenFileError, TokenStore, hash_token, parse_teams, parse_token_file
from coordinator.teams import Member, Team, TeamBook, quota_reason


def _entry(name: str, role: str = "client", extra: str = "") -> str:
    return f'[[token]]\nname = "{name}"\nrole = "{role}"\n{extra}hash = "{hash_token(name + "-token")}"\n'


VISION = '[[team]]\nname = "vision"\nweight = 2\nmax_gpus = 8\nmax_running = 20\nmax_queued = 5000\n'
FILE = (
    _entry("alice", extra='team = "vision"\n') + _entry("carol", extra='team = "vision"\nweight = 3\n')
    + _entry("bob", extra="weight = 2\n") + _entry("dave") + _entry("gpu", "worker") + VISION
)


def test_entries_name_their_team_and_weight_and_tables_give_quotas() -> None:
    """Entries carry team and weight; a [[team]] table gives its team a weight and quotas."""
    book = parse_teams(FILE, "tokens.toml")
    assert book.member("carol") == Member("vision", 3.0)
    assert book.team_of("alice") == "vision" and book.member_weight("alice") == 1.0
    assert book.member_weight("carol") == 3.0
    assert book.team("vision") == Team("vision", 2.0, 8.0, 20, 5000, True)
    assert book.teams == (Team("vision", 2.0, 8.0, 20, 5000, True),)


def test_a_principal_without_team_is_a_team_of_its_own_with_its_weight() -> None:
    """No ``team``: its own team, named after it, whose weight is the entry's (default 1)."""
    book = parse_teams(FILE, "tokens.toml")
    assert book.team_of("bob") == "bob" and book.team("bob").weight == 2.0
    assert book.member_weight("bob") == 1.0  # the weight went to its team
    assert book.team_of("dave") == "dave" and book.team("dave") == Team("dave")
    assert book.team_of("not-in-the-file") == "not-in-the-file"  # an environment token, --insecure
    assert book.team("not-in-the-file").weight == 1.0


@pytest.mark.parametrize(("text", "expected"), [
    (_entry("a", extra="weight = 0\n"), "'weight' must be > 0"),
    (_entry("a", extra="weight = 'heavy'\n"), "'weight' must be a number"),
    (_entry("a", extra="weight = 1e9\n"), "'weight' must be at most"),
    (_entry("a", extra='team = ""\n'), "'team' must be a non-empty string"),
    (_entry("w", "worker", 'team = "vision"\n'), "apply to roles client and admin"),
    ('[[team]]\nname = "v"\nmax_gpu = 3\n', "unknown key(s) ['max_gpu']"),
    ('[[team]]\nname = "v"\nmax_running = -1\n', "'max_running' must be a whole number >= 0"),
    ('[[team]]\nname = "v"\nmax_queued = 2.5\n', "'max_queued' must be a whole number >= 0"),
    ('[[team]]\nname = "v"\nmax_gpus = -2\n', "'max_gpus' must be a number >= 0"),
    ('[[team]]\nname = "v"\nborrow = "no"\n', "'borrow' must be true or false"),
    ('[[team]]\nweight = 2\n', "'name' must be a non-empty string"),
    ('[[team]]\nname = "v"\n[[team]]\nname = "v"\n', "team 'v' has two [[team]] tables"),
    ('[team]\nname = "v"\n', "write [[team]], not [team]"),
    ('[[teams]]\nname = "v"\n', "one [[team]] table per team"),
])
def test_bad_team_settings_say_where_and_what_to_fix(text: str, expected: str) -> None:
    """Every mistake in team settings is refused with the file, the entry or table, and what to change."""
    with pytest.raises(TokenFileError) as info:
        parse_token_file(text, "tokens.toml")
    assert "tokens.toml" in str(info.value) and expected in str(info.value)


def test_a_reload_that_changes_a_team_keeps_sessions_and_puts_the_new_teams_in_force(tmp_path: Path) -> None:
    """Team and weight are not who a principal is: a reload changing them revokes nobody."""
    path = tmp_path / "tokens.toml"
    path.write_text(FILE)
    store = TokenStore(path)
    alice = store.authenticate("alice-token")
    assert alice is not None and alice.team == "vision"
    path.write_text(FILE.replace('name = "alice"\nrole = "client"\nteam = "vision"', 'name = "alice"\nrole = "client"\n'
                                 'team = "nlp"\nweight = 4'))
    assert store.reload() == []
    assert store.current(alice)
    assert store.teams.team_of("alice") == "nlp" and store.teams.member_weight("alice") == 4.0


def test_quota_reason_names_the_quota_reached() -> None:
    """A plan past a quota waits with a reason naming the team and the quota; within it, no reason."""
    team = Team("vision", max_gpus=8, max_running=20)
    assert quota_reason(team, running=3, gpus=8, need_gpus=1) == (
        "team vision is at its quota of 8 GPUs; it may use capacity no other team waits for"
    )
    assert quota_reason(team, running=20, gpus=0) == (
        "team vision is at its quota of 20 running plans; it may use capacity no other team waits for"
    )
    assert quota_reason(Team("t", max_running=1, borrow=False), running=1, gpus=0) == (
        "team t is at its quota of 1 running plan"
    )
    assert quota_reason(team, running=19, gpus=7, need_gpus=1) is None
    assert quota_reason(team, running=19, gpus=8) is None  # a plan without GPUs is not held by max_gpus


def test_team_book_equality_ignores_teams_only_asked_about() -> None:
    """Asking for a team without a table does not make two equal books differ."""
    one, two = TeamBook([Team("v", 2.0)]), TeamBook([Team("v", 2.0)])
    one.team("someone")
    assert one == two and one.teams == (Team("v", 2.0),)
