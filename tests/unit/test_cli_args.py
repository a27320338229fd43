"""`fleetwire submit --args`: inline JSON, @PATH or - (stdin), and what is said when it is wrong."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from fleetwire.cli.main import _args


def test_inline_file_and_stdin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "args.json"
    path.write_text('{"from": "file"}')
    monkeypatch.setattr("sys.stdin", io.StringIO('{"from": "stdin"}'))
    assert _args('{"from": "inline"}', []) == {"from": "inline"}
    assert _args(f"@{path}", []) == {"from": "file"}
    assert _args("-", ["data=@x.bin"]) == {"from": "stdin"}
    assert _args(None, []) is None


def test_what_is_wrong_is_said_with_where(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ValueError, match=f"--args @{missing}: cannot read {missing}"):
        _args(f"@{missing}", [])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=f"--args @{bad} is not valid JSON: Expecting property name"):
        _args(f"@{bad}", [])
    with pytest.raises(ValueError, match="--args is not valid JSON"):
        _args("{", [])
    with pytest.raises(ValueError, match="--args - and --input NAME=- both read stdin"):
        _args("-", ["data=-"])
