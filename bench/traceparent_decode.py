"""What an assign's ``traceparent`` costs the worker to decode, by its form (callgrind; issue #32).

    python bench/traceparent_decode.py                  # this tree
    python bench/traceparent_decode.py --compare PATH   # and another checkout, same sitting

Frames of 500 ``assign`` messages, as the coordinator sends them, decoded by the worker's codec (its reader's
``Codec.decode``) and each message's ``traceparent`` read once, then let go: instructions per assign for each form
of the field: none (``""``, not sent), ``"00"`` (the caller's "no", protocol/tracecontext.py ``UNSAMPLED``: what
99 plans in 100 carry at 1 % sampling), a one-character string (``"0"``: CPython hands out its cached
one-character strings, so decoding allocates nothing) and a sampled context (55 characters). Each figure is the
callgrind difference of two runs of different sizes, so start-up cancels out and the machine's load does not move
it. The forms other than none and ``"00"`` are for comparison only: the protocol sends none of them as the
unsampled decision. ``--submit``: frames of 500 ``submit`` messages as the SDK sends them, decoded by the
coordinator's codec (its ``FromClient``), where ``"0"`` is accepted too (docs/PROTOCOL.md §4 ``submit``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FORMS = {"none": "", "00": "00", "one char": "0", "sampled": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


def run(form: str, frames: int, submit: bool = False) -> None:
    """Decode ``frames`` frames of 500 assigns carrying ``form``, as the worker's reader does (``submit``: 500
    submits, as the coordinator's reader does)."""
    import msgspec

    from protocol.codec import Codec
    from protocol.messages import Assign, FromClient, Submit, ToWorker

    if submit:
        frame = msgspec.msgpack.encode([Submit(req_id=i, op="echo", args=i, plan_id=f"p{i}", traceparent=FORMS[form])
                                        for i in range(500)])  # fmt: skip
        codec = Codec("msgpack", FromClient, "client")
    else:
        frame = msgspec.msgpack.encode([Assign(plan_id=f"p{i}", attempt=1, op="echo", args=i, traceparent=FORMS[form])
                                        for i in range(500)])  # fmt: skip
        codec = Codec("msgpack", ToWorker, "coordinator")
    for _ in range(frames):
        for msg in codec.decode(frame):
            msg.traceparent  # noqa: B018  (read, as the runner reads it)


def per_assign(tree: str, form: str, submit: bool = False) -> float:
    """Callgrind instructions per assign (``submit``: per submit): (Ir(10 frames) - Ir(2 frames)) / 4,000."""
    from _harness import callgrind_total  # the parent's only: a child's count has no more imports than before

    with tempfile.TemporaryDirectory() as tmp:
        totals = [callgrind_total(tree, [__file__, "--child", form, str(frames), *(["--submit"] if submit else [])],
                                  os.path.join(tmp, f"cg.{frames}"))
                  for frames in (2, 10)]  # fmt: skip
    return (totals[1] - totals[0]) / (8 * 500)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", metavar="PATH", help="also measure the tree at PATH")
    parser.add_argument("--submit", action="store_true", help="submits as the coordinator decodes them")
    parser.add_argument("--child", nargs=2, metavar=("FORM", "FRAMES"), help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        run(ns.child[0], int(ns.child[1]), ns.submit)
        return 0
    for tree in [ROOT] + ([os.path.abspath(ns.compare)] if ns.compare else []):
        figures = {form: per_assign(tree, form, ns.submit) for form in FORMS}
        base = figures["none"]
        print(f"{tree}: " + "  ".join(f"{form} {v:,.0f} ({v - base:+,.0f})" for form, v in figures.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
