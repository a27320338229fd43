"""Unsafe defaults refused or warned (issue #15 item 6) and the worker's own token variable (item 5)."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.auth import TokenFileError, TokenStore, hash_token, parse_token_file, weak_tokens
from fleetwire.cli.safety import plaintext_warning, up_state_tokens
from worker_agent.session import worker_token

ROOT = Path(__file__).resolve().parents[2]
STRONG = "x" * 16


def test_placeholders_and_short_tokens_are_named_by_role_never_shown() -> None:
    """change-me-* and tokens under 16 characters are unsafe; the lines name the role, not the token."""
    problems = weak_tokens([("worker", "worker", "change-me-worker-token"), ("client", "client", "short-secret"),
                            ("admin", "admin", STRONG)])  # fmt: skip
    assert len(problems) == 2
    assert "worker token" in problems[0] and "change-me placeholder" in problems[0]
    assert "client token" in problems[1] and "12 characters; at least 16" in problems[1]
    assert not any("short-secret" in p or "change-me-worker-token" in p for p in problems)


def test_one_token_for_two_roles_is_refused() -> None:
    """The same token as worker and client token: the store refuses to load, naming both principals."""
    with pytest.raises(TokenFileError, match=r"same token is given for 'worker' .* and 'client'"):
        TokenStore(None, [("worker", "worker", STRONG), ("client", "client", STRONG)])


def test_token_file_refuses_the_hash_of_a_placeholder() -> None:
    """A token file entry whose hash is a change-me placeholder's is refused at load."""
    text = f'[[token]]\nname = "w"\nrole = "worker"\nhash = "{hash_token("change-me-worker-token")}"\n'
    with pytest.raises(TokenFileError, match="change-me placeholder"):
        parse_token_file(text, "tokens.toml")


@pytest.mark.parametrize(("host", "tls", "warned"), [
    ("127.0.0.1", False, False), ("::1", False, False), ("localhost", False, False),
    ("0.0.0.0", False, True), ("10.1.2.3", False, True), ("coordinator.example", False, True),
    ("0.0.0.0", True, False),
])  # fmt: skip
def test_plaintext_beyond_loopback_warns(host: str, tls: bool, warned: bool) -> None:
    """ws:// on a non-loopback bind gets a loud warning; loopback or TLS get none."""
    warning = plaintext_warning(host, tls)
    assert (warning is not None) == warned
    if warning:
        assert warning.startswith("WARNING: plaintext ws://") and "--tls-cert" in warning


def test_coordinator_with_a_placeholder_token_exits_2_in_one_line() -> None:
    """`fleetwire coordinator` with examples/deploy's placeholder: one line on stderr, exit 2, nothing served."""
    env = {"FLEETWIRE_WORKER_TOKEN": "change-me-worker-token", "FLEETWIRE_CLIENT_TOKEN": STRONG, "PATH": ""}
    done = subprocess.run([sys.executable, "-m", "fleetwire", "coordinator", "--port", "0", "--store", "memory"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=30)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "change-me placeholder" in done.stderr


def test_worker_prefers_its_own_token_variable() -> None:
    """--token, then FLEETWIRE_WORKER_TOKEN, then FLEETWIRE_TOKEN (kept for older setups)."""
    both = {"FLEETWIRE_WORKER_TOKEN": "worker-t", "FLEETWIRE_TOKEN": "client-t"}
    assert worker_token(None, both) == "worker-t"
    assert worker_token("flag-t", both) == "flag-t"
    assert worker_token(None, {"FLEETWIRE_TOKEN": "old-t"}) == "old-t"
    assert worker_token(None, {}) is None


def test_up_state_dir_keeps_the_tokens(tmp_path: Path) -> None:
    """`up --state-dir DIR`: tokens made once, saved 0600, the same on the next run."""
    first = up_state_tokens(tmp_path / "state")
    again = up_state_tokens(tmp_path / "state")
    assert first == again and set(first) == {"worker", "client", "admin"}
    assert len(set(first.values())) == 3
    mode = stat.S_IMODE((tmp_path / "state" / "up-tokens.json").stat().st_mode)
    assert mode == 0o600
