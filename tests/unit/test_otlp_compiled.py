"""wireio/otlp.py as imported (compiled by mypyc in a compiled build, setup.py ``COMPILED``) writes the bytes its pure
source writes, for every kind of span the exporters encode.

tools/build_compiled.py ``--test`` runs this file against the compiled copy, where ``wireio.otlp`` is the extension
and its source is loaded beside it under another name; in a pure tree both are the source (the test then checks
only itself).
"""

from __future__ import annotations

import enum
import importlib.util
import random
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest

import wireio.otlp
from tests.unit.test_otlp_encode import SPANS, TRACE, _step_records
from tests.unit.test_worker_live_spans import _noted
from wireio.span_export import StepSpans

ROOT = Path(__file__).resolve().parents[2]
RESOURCE = {"service.name": "fleetwire-coordinator", "telemetry.sdk.language": "python", "n": 3}


class Level(enum.IntEnum):
    HIGH = 2


def _pure() -> ModuleType:
    """wireio/otlp.py's source as a module of its own (never the extension beside it)."""
    spec = importlib.util.spec_from_file_location("fleetwire_pure_otlp", ROOT / "wireio" / "otlp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _requests(otlp: ModuleType, batches: list[list[Any]], steps: list[list[Any]]) -> list[bytes]:
    """Each batch encoded by one encoder of ``otlp`` (its tables kept across batches), then the step records made
    into spans and encoded (``StepSpans`` with that encoder); span ids drawn from a seeded ``random``."""
    random.seed(11)
    encoder = otlp.SpanEncoder(RESOURCE, "fleetwire", "https://opentelemetry.io/schemas/1.21.0")
    out = [encoder.encode(batch) for batch in batches]
    expander = StepSpans()
    out += [encoder.encode(expander.expand(records, encoder)) for records in steps]
    out.append(otlp.encode_attributes(0x4A, {"a": [1, "b", 2.5, True], "e": Level.HIGH, "o": Path("/x")}))
    return out


def test_the_module_as_imported_writes_the_pure_sources_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Full spans (every attribute type, events, errors, roots, remote and local parents, one over 16 KiB), the
    worker's live spans in every shape, compact commit spans, and the coordinator's step records (queue and commit
    spans, through msgpack as the pipe delivers them), across batches and past a key table's turn (4,096 plan ids):
    the same bytes from the imported module and from its source."""
    live = _noted(monkeypatch, full=False)
    assert {raw[0] for raw in live} >= {wireio.otlp.LIVE_BASE + i for i in range(len(wireio.otlp.LIVE_SPANS))}
    parent = f"00-{TRACE}-00f067aa0ba902b8-01"
    compact = [(wireio.otlp.COMMIT_SPAN, parent, 1_000 + i, 900 + i * 3, f"p-{i}", i % 3, "succeeded")
               for i in range(5_000)]  # fmt: skip
    batches = [list(SPANS), live + list(SPANS[:2]), compact[:2_500], compact[2_500:] + live, [b"\x0a\x00"]]
    records = msgspec.msgpack.decode(msgspec.msgpack.encode((0, _step_records())))[1]
    steps = [records[:5], records[5:]]
    pure = _pure()
    assert pure.__file__ == str(ROOT / "wireio" / "otlp.py") and pure is not wireio.otlp
    assert _requests(wireio.otlp, batches, steps) == _requests(pure, batches, steps)
