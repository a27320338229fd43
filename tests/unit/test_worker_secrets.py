"""How `fleetwire worker` takes its token (issue #24 part 2): once, from a file or the environment, then forgets it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from worker_agent.main import add_worker_arguments, run_worker
from worker_agent.session import WORKER_SECRETS, forget_secrets, read_token_file, take_worker_token

pytestmark = pytest.mark.timeout(30)


def test_the_token_comes_from_the_flag_the_file_or_the_environment(tmp_path: Path) -> None:
    """--token, else --token-file (one line, white space dropped), else FLEETWIRE_WORKER_TOKEN, else FLEETWIRE_TOKEN."""
    token_file = tmp_path / "token"
    token_file.write_text("  from-the-file\n")
    environ = {"FLEETWIRE_WORKER_TOKEN": "from-env", "FLEETWIRE_TOKEN": "old"}
    assert take_worker_token("flag", None, environ) == "flag"
    assert take_worker_token(None, str(token_file), environ) == "from-the-file"
    assert take_worker_token(None, None, environ) == "from-env"
    assert take_worker_token(None, None, {"FLEETWIRE_TOKEN": "old"}) == "old"
    with pytest.raises(ValueError, match="--token or --token-file, not both"):
        take_worker_token("flag", str(token_file), environ)


@pytest.mark.parametrize(("content", "why"), [(None, "cannot read it"), ("", "alone, on one line"),
                                              ("a\nb\n", "alone, on one line")])  # fmt: skip
def test_a_bad_token_file_is_refused_naming_it(tmp_path: Path, content: str | None, why: str) -> None:
    """A missing, empty or multi-line token file: ValueError naming the file and what is wrong."""
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=why) as info:
        read_token_file(str(path))
    assert str(path) in str(info.value)


def test_every_token_variable_is_forgotten() -> None:
    """forget_secrets removes the worker's, client's, admin's, metrics and inference tokens, and nothing else."""
    environ = {name: "secret" for name in WORKER_SECRETS} | {"PATH": "/bin", "FLEETWIRE_URL": "ws://h:1"}
    assert sorted(forget_secrets(environ)) == sorted(WORKER_SECRETS)
    assert environ == {"PATH": "/bin", "FLEETWIRE_URL": "ws://h:1"}


def _worker_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser.parse_args(list(argv))


async def test_token_on_the_command_line_is_warned_about(capsys: pytest.CaptureFixture[str]) -> None:
    """--token works but warns that ps shows it; --token with --token-file exits 2 naming both."""
    ns = _worker_args("--url", "ws://127.0.0.1:1", "--token", "t" * 20, "--plan-user", "fleetwire-no-such-user")
    assert await run_worker(ns) == 2  # the bad --plan-user stops it after the token was read
    err = capsys.readouterr().err
    assert "warning: --token on the command line is shown to every user of this host" in err
    assert "--plan-user 'fleetwire-no-such-user'" in err
    ns = _worker_args("--url", "ws://127.0.0.1:1", "--token", "t" * 20, "--token-file", "/nonexistent")
    assert await run_worker(ns) == 2
    assert "--token or --token-file, not both" in capsys.readouterr().err


async def test_plan_env_naming_a_fleetwire_variable_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """--plan-env FLEETWIRE_WORKER_TOKEN is refused at start (exit 2), naming the entry."""
    ns = _worker_args("--url", "ws://127.0.0.1:1", "--plan-env", "FLEETWIRE_WORKER_TOKEN")
    assert await run_worker(ns) == 2
    assert "--plan-env 'FLEETWIRE_WORKER_TOKEN'" in capsys.readouterr().err
