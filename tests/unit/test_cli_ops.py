"""The operator's CLI (issue #15 item 7): tables, hints, flags and help that say what is true."""

from __future__ import annotations

import argparse
import io
import os
from unittest import mock

import pytest
from rich.console import Console

from fleetwire.cli import console
from fleetwire.cli.main import build_parser
from fleetwire.cli.ops import interrupted_text, op_hint, tag_list
from fleetwire.cli.reference import generate
from fleetwire.stream import RESYNC_REASON, PlanStream
from protocol.messages import Capabilities, DeviceHealth, Event, Load, PlanInfo, Resync, WorkerInfo, Workers

LONG_IDS = [
    "gpu-node-0042.rack-17.datacenter-west.example.internal-9f3a2b7c",
    "gpu-node-0043.rack-17.datacenter-west.example.internal-0c1d2e3f",
]


def _worker(worker_id: str, *, ops: tuple[str, ...] = ("echo", "sleep"), version: str = "0.1.0",
            alive: bool = True) -> WorkerInfo:  # fmt: skip
    caps = Capabilities(cpu_cores=16, ram_bytes=64 * 10**9, ops=list(ops), tags=["gpu", "a100"], max_concurrency=4)
    return WorkerInfo(id=worker_id, capabilities=caps, load=Load(), leases=1, connected=alive, alive=alive,
                      last_beat_age_s=0.25, version=version)  # fmt: skip


def _render(table: object, width: int) -> str:
    out = io.StringIO()
    console.print_table(Console(file=out, width=width, no_color=True), table)  # type: ignore[arg-type]
    return out.getvalue()


def test_workers_table_keeps_long_ids_whole_at_80_columns() -> None:
    """At 80 columns, long worker ids come first and whole (no "…"); the other cells are not cut either."""
    text = _render(console.workers_table([_worker(i) for i in LONG_IDS]), 80)
    lines = text.splitlines()
    assert lines[0].startswith("ID ")
    for worker_id, line in zip(LONG_IDS, lines[1:], strict=True):
        assert line.startswith(worker_id + " ")
    assert "…" not in text and "gpu,a100" in text and "0.2s ago" in text


def test_workers_table_at_columns_80_from_the_environment() -> None:
    """With COLUMNS=80 (a narrow terminal), `print_workers` still prints every id whole."""
    out = io.StringIO()
    with mock.patch.dict(os.environ, {"COLUMNS": "80"}), \
         mock.patch.object(console, "make_console", lambda: Console(file=out, no_color=True)):  # fmt: skip
        console.print_workers(Workers(req_id=1, workers=[_worker(i) for i in LONG_IDS], summary="2 workers"),
                              as_json=False)  # fmt: skip
    assert all(worker_id in out.getvalue() for worker_id in LONG_IDS)
    assert "…" not in out.getvalue()


def test_workers_table_drops_empty_columns_and_shows_versions() -> None:
    """Columns no worker fills (GPUS, ENERGY, CARBON, ENGINE on a CPU fleet) are left out; VERSION is shown."""
    header = _render(console.workers_table([_worker("w1", version="0.2.0"), _worker("w2")]), 200).splitlines()[0]
    assert header.split() == ["ID", "VERSION", "STATE", "TAGS", "CPUS", "RAM", "IN-FLIGHT", "LAST", "BEAT"]
    text = _render(console.workers_table([_worker("w1", version="0.2.0"), _worker("w2")]), 200)
    assert "0.2.0" in text and "0.1.0" in text
    old = _render(console.workers_table([_worker("w1", version="")]), 200).splitlines()[0]
    assert "VERSION" not in old  # workers too old to say their version


def test_workers_table_shows_gpu_health_with_the_quarantine_reason() -> None:
    """GPU HEALTH names each device not ok with its reason and the hottest temperature; a healthy GPU worker reads
    "ok"; a CPU fleet has no such column."""
    sick = _worker("w1")
    sick.load = Load(devices=[
        DeviceHealth(index=0, state="quarantined", reason="fatal XID 79 (GPU has fallen off the bus)",
                     temperature_c=41.0),
        DeviceHealth(index=1, state="degraded", reason="93 °C (from 90 °C)", temperature_c=93.0),
    ])  # fmt: skip
    well = _worker("w2")
    well.load = Load(devices=[DeviceHealth(index=0, temperature_c=64.4)])
    lines = _render(console.workers_table([sick, well]), 400).splitlines()
    assert "GPU HEALTH" in lines[0]
    assert ("gpu 0 quarantined: fatal XID 79 (GPU has fallen off the bus); gpu 1 degraded: 93 °C (from 90 °C); "
            "max 93 °C") in lines[1]
    assert "ok; max 64 °C" in lines[2]
    assert "GPU HEALTH" not in _render(console.workers_table([_worker("w3")]), 400)


def test_progress_fractions_are_rounded() -> None:
    """A progress fraction of 0.333333 reads "33 %" in the live line and in followed event lines."""
    assert console.progress_text({"fraction": 0.333333, "message": "tokenizing"}) == "33 % tokenizing"
    assert console.progress_text({"fraction": 1}) == "100 %"
    out = io.StringIO()
    follower = console._Follower(Console(file=out, no_color=True), "p1", follow=True, live=False)
    follower.event(Event(plan_id="p1", seq=3, kind="progress", data={"fraction": 0.333333, "message": ""}))
    assert out.getvalue().strip() == "[3] progress 33 %"
    assert follower.progress == "33 %"


def test_op_hint_names_offered_ops_and_the_closest_match() -> None:
    """A typo'd op: the hint lists the ops the alive workers offer and the closest one."""
    hint = op_hint("ecoh", [_worker("w1"), _worker("w2", ops=("python",)), _worker("w3", ops=("gone",), alive=False)])
    assert "they offer: echo, python, sleep" in hint
    assert "did you mean 'echo'?" in hint
    assert "gone" not in hint


def test_op_hint_for_shell_mentions_allow_shell() -> None:
    """Op 'shell' without a worker offering it: the hint says workers need --allow-shell."""
    hint = op_hint("shell", [_worker("w1")])
    assert "--allow-shell" in hint


def test_op_hint_without_workers_says_none_is_connected() -> None:
    """No alive worker at all: the hint says so instead of listing nothing."""
    assert "no worker is connected" in op_hint("echo", [])


def test_interrupted_text_prints_the_exact_commands() -> None:
    """Ctrl-C during submit: the plan keeps running, and the watch and cancel commands are given verbatim."""
    text = interrupted_text("p-7", "ws://10.0.0.1:8765")
    assert "plan p-7 keeps running" in text
    assert "fleetwire watch --url ws://10.0.0.1:8765 p-7" in text
    assert "fleetwire cancel --url ws://10.0.0.1:8765 p-7" in text
    assert "fleetwire watch p-7" in interrupted_text("p-7", None)


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """`fleetwire --version` prints the package's version and exits 0."""
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("fleetwire ")


def test_tags_is_the_one_spelling_and_tag_a_hidden_alias() -> None:
    """`submit --tags a,b --tag c` gives [a, b, c]; only --tags is in the help and the reference."""
    ns = build_parser().parse_args(["submit", "echo", "--tags", "gpu,a100", "--tag", "llm"])
    assert tag_list(ns.tags) == ["gpu", "a100", "llm"]
    submit = _subparser("submit")
    assert "--tags" in submit.format_help() and "--tag " not in submit.format_help()
    section = generate(build_parser()).split("### `fleetwire submit`")[1].split("### ")[0]
    assert "`--tags`" in section and "`--tag`" not in section


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub: argparse.ArgumentParser = action.choices[name]
    return sub


@pytest.mark.parametrize("command", ["drain", "undrain", "plans", "status"])
def test_admin_commands_say_their_token_is_the_admin_token(command: str) -> None:
    """drain/undrain/plans/status `--token` help names the admin token; client commands name the client token."""
    token = next(a for a in _subparser(command)._actions if "--token" in a.option_strings)
    assert token.help is not None and token.help.startswith("admin token")
    client_token = next(a for a in _subparser("submit")._actions if "--token" in a.option_strings)
    assert client_token.help is not None and client_token.help.startswith("client token")


def test_cancel_takes_several_ids_or_all_with_state() -> None:
    """`cancel a b c` and `cancel --all --state queued` both parse."""
    ns = build_parser().parse_args(["cancel", "a", "b", "c"])
    assert ns.plan == ["a", "b", "c"] and not ns.all
    ns = build_parser().parse_args(["cancel", "--all", "--state", "queued"])
    assert ns.all and ns.state == ["queued"] and ns.plan == []


def test_a_followed_resync_marker_says_which_events_it_stands_for_and_why() -> None:
    """``watch`` of a finished plan whose ephemeral events are gone prints the resync marker's seqs and its
    reason, not an unexplained map."""
    stream = PlanStream("p1", live=True)
    info = PlanInfo(id="p1", op="echo", state="succeeded", last_seq=9)
    stream.resync(Resync(plan_id="p1", first_seq=3, last_seq=8, plan=info))
    out = io.StringIO()
    follower = console._Follower(Console(file=out, no_color=True), "p1", follow=True, live=False)
    follower.event(stream.events[-1])
    assert " ".join(out.getvalue().split()) == f"[3-8] resync: {RESYNC_REASON}"  # as wrapped at 80 columns
    assert "ephemeral events (tokens, progress) of a plan that ended" in RESYNC_REASON
