"""examples/deploy/ stays runnable: each unit's ExecStart parses with today's CLI and its env file is complete."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

import pytest

from fleetwire.cli.main import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "examples" / "deploy"


def _unit(name: str) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None, comment_prefixes=("#", ";"))
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    unit.read(DEPLOY / name)
    return unit


def _env(name: str) -> dict[str, str]:
    lines = (DEPLOY / name).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


@pytest.mark.parametrize(
    ("service", "env_file", "command"),
    [("fleetwire-coordinator.service", "coordinator.env", "coordinator"),
     ("fleetwire-worker.service", "worker.env", "worker")],
)
def test_unit_command_line_parses_with_the_cli(service: str, env_file: str, command: str) -> None:
    """ExecStart, with the env file's variables and %H filled in, is a valid `fleetwire` command line."""
    unit = _unit(service)
    env = _env(env_file)
    assert unit["Service"]["EnvironmentFile"] == f"/etc/fleetwire/{env_file}"
    line = unit["Service"]["ExecStart"].replace("%H", "host-1")
    missing = [name for name in re.findall(r"\$\{(\w+)\}", line) if name not in env]
    assert not missing, f"{service} uses {missing}, which {env_file} does not set"
    line = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], line)
    argv = shlex.split(line)
    assert argv[0].endswith("/fleetwire") and argv[1] == command
    ns = build_parser().parse_args(argv[1:])
    assert ns.command == command and ns.log_format == "json"
    # Stopping must outlast the worker's own drain, or systemd kills plans it meant to hand back.
    stop_s = int(unit["Service"]["TimeoutStopSec"])
    assert stop_s > getattr(ns, "drain_timeout", 0)
