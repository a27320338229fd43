"""The lone round trip's busy-poll (wireio/spin.py): armed by a send, ended by an answer or its window, adaptive."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from tests.waiting import until
from wireio import spin as spin_module
from wireio.spin import BUSY_SKIP, CONTENDED_FIRST_SKIP, CONTENDED_SKIP, MAX_SKIP, Spin, window_from_env


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_send_arms_a_spin_that_the_answer_read_by_the_loop_ends() -> None:
    """After ``sent`` the loop polls each turn; a frame read by the loop (``received``) ends it at once: a hit."""
    spin = Spin(1.0, switched=lambda: 0)
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    a.setblocking(False)

    def readable() -> None:
        a.recv(64)
        spin.received()

    loop.add_reader(a.fileno(), readable)
    try:
        spin.sent()
        assert spin.spinning
        await until(lambda: spin.polls >= 3)
        b.send(b"answer")
        await until(lambda: not spin.spinning)
        assert (spin.spins, spin.hits, spin.misses) == (1, 1, 0)
        polls = spin.polls
        await turns(10)
        assert spin.polls == polls  # disarmed: no more turns of its own
    finally:
        loop.remove_reader(a.fileno())
        a.close()
        b.close()


async def test_an_idle_process_uses_no_cpu_after_the_window() -> None:
    """A spin with no answer ends at its window; then the loop sleeps: the thread's CPU over 100 ms stays ~0."""
    spin = Spin(0.002, switched=lambda: 0)  # a busy test machine's switches would end it early as contended
    spin.sent()
    await until(lambda: not spin.spinning)
    assert spin.misses == 1
    cpu0 = time.thread_time()
    await asyncio.sleep(0.1)  # the window measured, not a wait for state
    assert time.thread_time() - cpu0 < 0.02
    assert not spin.spinning


async def test_misses_in_a_row_skip_1_2_4_up_to_64_sends_and_a_hit_resets() -> None:
    """A spin the window ran out on skips the next sends, doubling up to MAX_SKIP; an answer in time resets it."""
    clock = FakeClock()
    spin = Spin(0.001, clock=clock, switched=lambda: 0)

    async def miss() -> None:
        spin.sent()
        assert spin.spinning
        await turns(2)
        clock.now += 0.002
        await turns(2)
        assert not spin.spinning

    skipped = []
    for _ in range(8):
        await miss()
        spins, n = spin.spins, 0
        while True:
            spin.sent()
            if spin.spinning:
                spin.stop()
                break
            n += 1
        skipped.append(n)
        assert spin.spins == spins + 1
    assert skipped == [1, 2, 4, 8, 16, 32, 64, 64]
    assert MAX_SKIP == 64
    spin.sent()
    await turns(2)
    spin.received()  # a hit: the next send spins again
    assert spin.hits == 1
    spin.sent()
    assert spin.spinning
    spin.stop()


async def test_an_answer_there_before_the_first_turn_is_a_busy_loop() -> None:
    """An answer before the spin's first turn (a busy loop) is no hit: the next BUSY_SKIP sends spin not."""
    spin = Spin(1.0, switched=lambda: 0)
    spin.sent()
    spin.received()
    assert (spin.busy, spin.hits) == (1, 0)
    for _ in range(BUSY_SKIP):
        spin.sent()
        assert not spin.spinning
    spin.sent()
    assert spin.spinning
    spin.stop()


async def test_a_spin_switched_out_for_another_task_stops_and_backs_off() -> None:
    """When the thread was switched out during a spin (others need the core) it stops; the next 8 sends skip,
    doubling while it happens again, up to CONTENDED_SKIP; a hit resets it."""
    switches = [0]
    spin = Spin(1.0, switched=lambda: switches[0])
    skipped = []
    for _ in range(7):
        spin.sent()
        assert spin.spinning
        await turns(2)
        switches[0] += 1
        await until(lambda: not spin.spinning)
        n = 0
        while True:
            spin.sent()
            if spin.spinning:
                break
            n += 1
        skipped.append(n)
        spin.stop()
    assert spin.contended == 7
    assert skipped == [CONTENDED_FIRST_SKIP, 16, 32, 64, 128, CONTENDED_SKIP, CONTENDED_SKIP]
    spin.sent()
    await turns(2)
    spin.received()
    assert spin.hits == 1
    spin.sent()
    assert spin.spinning  # reset
    spin.stop()


async def test_a_window_of_0_never_spins() -> None:
    """Off (``FLEETWIRE_SPIN_US=0``, ``--spin-us 0``): a send arms nothing."""
    spin = Spin(0.0)
    spin.sent()
    assert not spin.spinning and spin.spins == 0


def test_a_send_without_a_running_loop_spins_not() -> None:
    """Outside a loop (a sync caller's thread) there is nothing to keep awake."""
    spin = Spin(1.0)
    spin.sent()
    assert not spin.spinning


@pytest.mark.parametrize(
    ("value", "window_s"),
    [
        (None, spin_module.SPIN_WINDOW_S),
        ("", spin_module.SPIN_WINDOW_S),
        ("0", 0.0),
        ("150", 150e-6),
        ("-1", 0.0),
        ("fast", 0.0),
    ],
)
def test_the_window_from_the_environment(monkeypatch: pytest.MonkeyPatch, value: str | None, window_s: float) -> None:
    """FLEETWIRE_SPIN_US: the window in µs; 0, negative or unreadable: off; unset: the default."""
    if value is None:
        monkeypatch.delenv(spin_module.ENV, raising=False)
    else:
        monkeypatch.setenv(spin_module.ENV, value)
    if value == "fast":  # unreadable: off, and said
        with pytest.warns(UserWarning, match="FLEETWIRE_SPIN_US='fast' is not a number"):
            assert window_from_env() == pytest.approx(window_s)
        return
    assert window_from_env() == pytest.approx(window_s)


@pytest.mark.parametrize("command", ["coordinator", "worker", "up"])
def test_spin_us_on_the_command_line_sets_the_process_window(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--spin-us 0`` turns the process's spin off, ``--spin-us 150`` sets it; no flag leaves it as it was."""
    from fleetwire.cli.main import build_parser

    monkeypatch.setattr(spin_module.SPIN, "window_s", 123e-6)
    parser = build_parser(worker_flags=command == "worker")
    spin_module.apply_spin_argument(parser.parse_args([command]))
    assert spin_module.SPIN.window_s == pytest.approx(123e-6)
    spin_module.apply_spin_argument(parser.parse_args([command, "--spin-us", "150"]))
    assert spin_module.SPIN.window_s == pytest.approx(150e-6)
    spin_module.apply_spin_argument(parser.parse_args([command, "--spin-us", "0"]))
    assert spin_module.SPIN.window_s == 0.0


def test_up_hands_spin_us_to_its_local_workers() -> None:
    """``fleetwire up --spin-us N``: its worker processes get ``--spin-us N`` too; without the flag, nothing."""
    from fleetwire.cli.main import build_parser
    from fleetwire.cli.up import _local_worker_argv

    parser = build_parser()
    argv = _local_worker_argv("ws://127.0.0.1:1", "w1", parser.parse_args(["up", "--spin-us", "150"]))
    assert argv[argv.index("--spin-us") + 1] == "150"
    assert "--spin-us" not in _local_worker_argv("ws://127.0.0.1:1", "w1", parser.parse_args(["up"]))
