"""Reconnect storms, simulated: what protocol/backoff.py's rule costs the cluster and how soon peers come back.

Each peer is a ReconnectBackoff driven through a scenario (no sockets, no clock: dials are instant,
delays are summed), one rule per column: this tree's, and any commit's protocol/backoff.py given with
``--rev`` (a rule before the served/moved/refused names gets them mapped onto ``answered``).

* ``refusing``: k URLs; one coordinator answers an HTTP refusal without Retry-After, the others
  refuse TCP. Dials/s at the refusing one, per 10,000 peers, in the second minute.
* ``lease``: three main ports, one of them dead, and the dead owner: the live ones answer ``moved``
  to the dead owner (refused) for the rest of its lease. Handshakes/s at the live main ports, per
  10,000 peers, over 10 s after the kill.
* ``failover``: the same, the lease expiring 3 s after the kill, then ``--no-owner-s`` of 1013
  "no owner yet", then ``moved`` to the new owner, which serves. Seconds from the shard being
  served again to each peer's registration (p50, p99, max).

Run: ``python bench/reconnect_storm.py --rev 79f0b74 --rev 93c5df1``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import types
from collections.abc import Callable
from typing import Any

BASE_S, CAP_S = 0.5, 30.0


def load_rule(rev: str | None) -> type:
    if rev is None:
        from protocol.backoff import ReconnectBackoff

        return ReconnectBackoff
    source = subprocess.run(["git", "show", f"{rev}:protocol/backoff.py"], capture_output=True, text=True, check=True)
    module = types.ModuleType(f"backoff_{rev}")
    exec(compile(source.stdout, f"{rev}:protocol/backoff.py", "exec"), module.__dict__)
    return module.__dict__["ReconnectBackoff"]


def tell(b: Any, outcome: str, wait_s: float | None = None) -> float:
    """The delay after ``outcome`` (served, moved, refused, unanswered), under either set of names."""
    if hasattr(b, "served"):
        said = {"served": b.served, "moved": b.moved, "unanswered": b.unanswered}
        return said[outcome]() if outcome in said else b.refused(wait_s)
    if outcome == "unanswered":
        return b.unanswered()
    delay = b.answered(wait_s)
    return 0.0 if outcome == "moved" else delay


def peer(rule: type, urls: list[str], answer: Callable[[str, float], str], horizon_s: float, rng: random.Random,
         log: Callable[[str, str, float], None]) -> float | None:  # fmt: skip
    """One peer from the kill (t=0, its served session ended) until it is served or ``horizon_s``; when served."""
    b = rule(BASE_S, CAP_S, urls=len(urls), rng=rng)
    t, turn, moved_to = tell(b, "served"), rng.randrange(len(urls)), None
    while t < horizon_s:
        url = moved_to or urls[turn % len(urls)]
        if moved_to is None:
            turn += 1
        outcome = answer(url, t)
        log(url, outcome, t)
        if outcome == "served":
            return t
        moved_to = None
        if outcome.startswith("moved "):
            moved_to = outcome.split()[1]
            outcome = "moved"
        t += tell(b, outcome)
    return None


def refusing(rule: type, k: int, peers: int, seed: int) -> float:
    urls = [f"u{i}" for i in range(k)]
    dials = 0

    def log(url: str, outcome: str, t: float) -> None:
        nonlocal dials
        dials += url == "u0" and 60.0 <= t < 120.0

    for n in range(peers):
        peer(rule, urls, lambda url, t: "refused" if url == "u0" else "unanswered", 120.0, random.Random(seed + n), log)
    return dials / 60.0 * 10_000 / peers


def lease(rule: type, peers: int, seed: int) -> float:
    shakes = 0

    def log(url: str, outcome: str, t: float) -> None:
        nonlocal shakes
        shakes += url in ("m1", "m2") and t < 10.0

    for n in range(peers):
        peer(rule, ["m0", "m1", "m2"], lambda url, t: "moved owner" if url in ("m1", "m2") else "unanswered", 10.0,
             random.Random(seed + n), log)  # fmt: skip
    return shakes / 10.0 * 10_000 / peers


def failover(rule: type, peers: int, seed: int, no_owner_s: float) -> list[float]:
    expiry_s = 3.0
    served_s = expiry_s + no_owner_s

    def answer(url: str, t: float) -> str:
        if url == "new":
            return "served"
        if url in ("m1", "m2"):
            return "moved owner" if t < expiry_s else "refused" if t < served_s else "moved new"
        return "unanswered"

    back = []
    for n in range(peers):
        at = peer(rule, ["m0", "m1", "m2"], answer, 120.0, random.Random(seed + n), lambda *_: None)
        back.append((at if at is not None else 120.0) - served_s)
    return sorted(back)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", action="append", default=[], help="a commit whose protocol/backoff.py to compare")
    parser.add_argument("--peers", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-owner-s", type=float, default=0.1)
    args = parser.parse_args()
    rules = [(rev, load_rule(rev)) for rev in args.rev] + [("this tree", load_rule(None))]
    names = " | ".join(r for r, _ in rules)
    print(f"base {BASE_S} s, cap {CAP_S} s, {args.peers} simulated peers, per 10,000; {names}")
    for k in (2, 3, 5, 10):
        figures = [refusing(rule, k, args.peers, args.seed) for _, rule in rules]
        print(f"refusing, {k:2d} URLs: dials/s at the refusing one  " + " | ".join(f"{f:8.0f}" for f in figures))
    figures = [lease(rule, args.peers, args.seed) for _, rule in rules]
    print("lease: handshakes/s at the live main ports    " + " | ".join(f"{f:8.0f}" for f in figures))
    for label, rule in rules:
        back = failover(rule, args.peers, args.seed, args.no_owner_s)
        p99 = back[int(0.99 * (len(back) - 1))]
        p50 = statistics.median(back)
        print(f"failover ({label}): back after served p50 {p50:.3f} p99 {p99:.3f} max {back[-1]:.3f} s")


if __name__ == "__main__":
    main()
