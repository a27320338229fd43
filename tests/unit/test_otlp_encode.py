"""wireio/otlp.py: the hand-written OTLP request is the message the SDK's own encoder makes of the same spans."""

from __future__ import annotations

from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from wireio.otlp import COMMIT_SPAN, SpanEncoder, expand
from wireio.span_export import SpanBuilder

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"

SPANS: list[tuple[Any, ...]] = [
    # name, trace, span id, parent (int / hex / 0), remote, start, end, attributes, events, kind, error
    ("fleetwire.queue", TRACE, 0x00F067AA0BA902B7, "00f067aa0ba902b8", True, 1_700_000_000_000_000_000,
     1_700_000_000_000_500_000,
     {"fleetwire.plan_id": "p-1", "fleetwire.attempt": 1, "fleetwire.wait_reason": "x" * 300},
     [("waiting", 1_700_000_000_000_100_000, {"reason": "no worker has tag gpu"}), ("waiting", 5, {})],
     "internal", ""),
    ("fleetwire.attempt", TRACE, (1 << 64) - 1, 0x1234, False, 10, 5, {"ok": True, "no": False, "neg": -3,
     "big": 1 << 40, "ratio": 0.25, "tags": ["a", "b"], "ints": (1, 2), "é": "ünï"}, None, "consumer",
     "handler_error"),
    ("root", TRACE, 7, 0, True, 0, 0, None, None, "server", ""),
    ("fleetwire.handler", "0" * 31 + "1", 8, 7, False, 1, 2, {}, [], "client", "x" * 200),
    ("p", TRACE, 9, 7, True, 1, 2, {"k": "v"}, None, "producer", ""),
    ("big", TRACE, 10, 7, True, 1, 2, {"k": "v" * 20_000}, None, "internal", ""),  # a span over 16 KiB
]  # fmt: skip


def _sdk_request(builder: SpanBuilder, spans: list[tuple[Any, ...]]) -> ExportTraceServiceRequest:
    return encode_spans([builder.build(*raw) for raw in spans])


def test_the_encoded_request_decodes_to_the_sdk_encoders_message() -> None:
    """Every field the SDK encoder writes (ids, parents, remote flags, kinds, times, attribute types, events,
    status, resource, scope) decodes the same from SpanEncoder's bytes."""
    builder = SpanBuilder("fleetwire-coordinator")
    ours = ExportTraceServiceRequest()
    ours.ParseFromString(builder._encoder.encode(SPANS))
    assert ours == _sdk_request(builder, SPANS)
    assert len(ours.resource_spans[0].scope_spans[0].spans) == len(SPANS)


def test_an_encoder_built_from_the_resource_alone_matches_too() -> None:
    """A SpanEncoder of the resource's attributes writes the same resource and scope as the SDK."""
    builder = SpanBuilder("fleetwire-worker")
    encoder = SpanEncoder(builder._resource.attributes)
    ours = ExportTraceServiceRequest()
    ours.ParseFromString(encoder.encode(SPANS[2:3]))
    assert ours == _sdk_request(builder, SPANS[2:3])


def test_values_kept_from_earlier_spans_never_stand_for_an_equal_value_of_another_type() -> None:
    """Across spans, a key's kept values (1, then True, 1.0; 100 plan ids past the table's size) and a repeated
    event encode each span as the SDK does."""
    builder = SpanBuilder("fleetwire-coordinator")
    spans = [("s", TRACE, i + 1, 7, True, 1, 2, {"k": value, "fleetwire.plan_id": f"p-{i}"},
              [("waiting", i, {"reason": "busy"})], "internal", "")
             for i, value in enumerate([1, True, 1.0, "1", 0, False, *range(100)])]  # fmt: skip
    for batch in (spans, spans[::-1]):
        ours = ExportTraceServiceRequest()
        ours.ParseFromString(builder._encoder.encode(batch))
        assert ours == _sdk_request(builder, batch)


def test_an_int_past_int64_is_sent_as_its_decimal_string_not_a_broken_varint() -> None:
    """An attribute of 2**70 (or below -2**63) decodes as a string; int64's own bounds stay ints."""
    encoder = SpanEncoder({"service.name": "s"})
    values = {"big": 1 << 70, "low": -(1 << 63) - 1, "max": (1 << 63) - 1, "min": -(1 << 63)}
    ours = ExportTraceServiceRequest()
    ours.ParseFromString(encoder.encode([("s", TRACE, 1, 0, False, 1, 2, values, None, "internal", "")]))
    got = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in ours.resource_spans[0].scope_spans[0].spans[0]
           .attributes}  # fmt: skip
    assert got == {"big": str(1 << 70), "low": str(-(1 << 63) - 1), "max": (1 << 63) - 1, "min": -(1 << 63)}


def test_a_plan_ids_key_keeps_the_latest_plans_in_two_tables_still_encoding_as_the_sdk() -> None:
    """Past its table's size a key starts a new table and keeps the full one as the previous, so a plan's later
    spans (the coordinator's three, ~1,000-5,000 plans apart) copy its id's encoding; every span still decodes as
    the SDK's."""
    builder = SpanBuilder("fleetwire-coordinator")
    encoder = builder._encoder
    spans = [("s", TRACE, i + 1, 7, True, 1, 2, {"fleetwire.plan_id": f"p-{i % 6000}"}, None, "internal", "")
             for i in range(12_000)]  # fmt: skip
    ours = ExportTraceServiceRequest()
    ours.ParseFromString(encoder.encode(spans))
    assert ours == _sdk_request(builder, spans)
    table = encoder._by_key["fleetwire.plan_id"]
    previous = table[()]
    kept = (set(table) | set(previous)) - {None, ()}
    assert {f"p-{i}" for i in range(6000 - 4096, 6000)} <= kept and len(previous) > 4000 and () not in previous


def test_a_compact_commit_span_encodes_as_the_sdk_encodes_its_expansion_and_builds_the_same_span() -> None:
    """A compact span (template, traceparent, times, values) is the internal span its template names, child of the
    remote parent, its attributes under the template's keys: the SDK's encoding of it (with the id drawn) and the
    ReadableSpan the builder makes of it say the same."""
    builder = SpanBuilder("fleetwire-coordinator")
    compact = (COMMIT_SPAN, f"00-{TRACE}-00f067aa0ba902b8-01", 1_000, 2_000, "p-1", 2, "succeeded")
    ours = ExportTraceServiceRequest()
    ours.ParseFromString(builder._encoder.encode([compact, SPANS[0]]))
    span_id = int.from_bytes(ours.resource_spans[0].scope_spans[0].spans[0].span_id, "big")
    expanded = ("fleetwire.store.commit", TRACE, span_id, "00f067aa0ba902b8", True, 1_000, 2_000,
                {"fleetwire.plan_id": "p-1", "fleetwire.attempt": 2, "fleetwire.event": "succeeded"}, None,
                "internal", "")  # fmt: skip
    assert span_id and ours == _sdk_request(builder, [expanded, SPANS[0]])
    built = builder.build(*expand(compact))
    assert (built.name, dict(built.attributes), built.parent.span_id, built.parent.is_remote) == (
        "fleetwire.store.commit", expanded[7], 0x00F067AA0BA902B8, True)  # fmt: skip


def test_the_coordinators_step_records_expand_after_the_pipe_into_its_spans_encoded_as_the_sdk_does() -> None:
    """A traced plan's four steps, noted as one record a step and one a commit and sent through msgpack as the pipe
    sends them, become exactly its queue span (queued -> leased: the wait as an event and attribute, the placement's
    policy and worker) and its two commit spans (creation, end), encoded as the SDK encodes the same spans."""
    import msgspec

    from wireio.span_export import COMMIT_RECORD, STEP_RECORD, StepSpans

    parent = f"00-{TRACE}-00f067aa0ba902b8-01"
    steps = [[(parent, "p-1", 0, "queued", {})], [(parent, "p-1", 0, "waiting", {"reason": "busy"})],
             [(parent, "p-1", 1, "leased", ("fifo", "w1"))], [(parent, "p-1", 1, "succeeded", {"result": 1})]]
    records: list[tuple[Any, ...]] = []
    for n, notes in enumerate(steps, 1):
        records += [(STEP_RECORD, n, n * 1_000, notes), (COMMIT_RECORD, n, n * 1_000 + 500)]
    piped = msgspec.msgpack.decode(msgspec.msgpack.encode((0, records)))[1]
    expander = StepSpans()
    got = expander.expand(piped[:3]) + expander.expand(piped[3:])  # state kept across batches
    assert expander.queued == 0 and [raw[0] for raw in got] == [COMMIT_SPAN, "fleetwire.queue", COMMIT_SPAN]
    queue_id = got[1][2]
    assert got[1] == ("fleetwire.queue", TRACE, queue_id, "00f067aa0ba902b8", True, 1_000, 3_000,
                      {"fleetwire.plan_id": "p-1", "fleetwire.attempt": 1, "fleetwire.wait_reason": "busy",
                       "fleetwire.policy": "fifo", "fleetwire.worker_id": "w1"},
                      [("waiting", 2_000, {"reason": "busy"})], "internal", "")  # fmt: skip
    assert [tuple(raw[2:]) for raw in (got[0], got[2])] == [(1_000, 1_500, "p-1", 0, "queued"),
                                                           (4_000, 4_500, "p-1", 1, "succeeded")]  # fmt: skip
    builder = SpanBuilder("fleetwire-coordinator")
    ours = ExportTraceServiceRequest()
    ours.ParseFromString(builder._encoder.encode(got))
    ids = [int.from_bytes(s.span_id, "big") for s in ours.resource_spans[0].scope_spans[0].spans]
    sdk = [raw if raw[0].__class__ is str else (*expand(raw)[:2], span_id, *expand(raw)[3:])
           for raw, span_id in zip(got, ids, strict=True)]  # the commit spans' ids, drawn by the encoder
    assert ours == _sdk_request(builder, sdk)


def _step_records() -> list[tuple[Any, ...]]:
    """Step and commit records of every queue span's shape: a wait then a placement; a lease adopted without one; an
    end while queued; a requeue; a lease of a plan queued before a restart; one step recording two plans."""
    from wireio.span_export import COMMIT_RECORD, STEP_RECORD

    a, b, c, d = (f"00-{TRACE[:-1]}{n}-00f067aa0ba902b{n}-01" for n in "1234")
    steps = [
        [(a, "p-1", 0, "queued", {}), (b, "p-2", 0, "queued", {}), (c, "p-3", 0, "queued", {})],
        [(a, "p-1", 0, "waiting", {"reason": "no worker has tag gpu"}), (a, "p-1", 0, "waiting", {"reason": "busy"})],
        [(a, "p-1", 1, "leased", ("joule_weighted", "w1")), (b, "p-2", 1, "leased", None)],
        [(c, "p-3", 0, "cancelled", {}), (d, "p-4", 2, "leased", ["fifo", "w2"])],
        [(a, "p-1", 1, "requeued", {}), (b, "p-2", 1, "succeeded", {"result": 1})],
        [(a, "p-1", 2, "leased", ("least_busy", "w2")), (d, "p-4", 2, "failed", {})],
    ]  # fmt: skip
    records: list[tuple[Any, ...]] = []
    for n, notes in enumerate(steps, 1):
        records += [(STEP_RECORD, n, n * 1_000, notes), (COMMIT_RECORD, n, n * 1_000 + 500)]
    return records


def test_step_records_encoded_at_once_decode_as_the_sdk_encodes_the_spans_they_expand_to() -> None:
    """StepSpans given the encoder makes each queue and commit span's bytes straight from the records (no tuple): the
    request decodes to the SDK's encoding of the spans the same records expand to, span for span, every shape."""
    import msgspec

    from wireio.span_export import StepSpans

    records = msgspec.msgpack.decode(msgspec.msgpack.encode((0, _step_records())))[1]  # as the pipe delivers them
    builder = SpanBuilder("fleetwire-coordinator")
    encoder, encoding, plain_spans = builder._encoder, StepSpans(), StepSpans()  # state kept across batches
    encoded = encoding.expand(records[:5], encoder) + encoding.expand(records[5:], encoder)
    plain = plain_spans.expand(records[:5]) + plain_spans.expand(records[5:])
    assert all(raw.__class__ is bytes for raw in encoded) and len(encoded) == len(plain) == 11
    ours = ExportTraceServiceRequest()
    ours.ParseFromString(encoder.encode(encoded))
    ids = [int.from_bytes(s.span_id, "big") for s in ours.resource_spans[0].scope_spans[0].spans]
    sdk = [(*expand(raw)[:2], span_id, *expand(raw)[3:]) for raw, span_id in zip(plain, ids, strict=True)]
    assert len(set(ids)) == len(ids) and ours == _sdk_request(builder, sdk)
    names = [s.name for s in ours.resource_spans[0].scope_spans[0].spans]
    assert names.count("fleetwire.queue") == 5 and names.count("fleetwire.store.commit") == 6
