"""The one HTTP/1.1 head codec (protocol/transfer/http1.py) and the data plane's byte ranges (ranges.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.transfer import http1
from protocol.transfer.http1 import HeadError, HeadTooLarge
from protocol.transfer.ranges import RangeError, content_range, parse_content_range, parse_range, range_from

PUT = (b"PUT /v1/data/p%201/1/inputs/w.bin HTTP/1.1\r\nHost: 10.0.0.5:8788\r\nAuthorization: Bearer fw1.k.c.m\r\n"
       b"Content-Length: 5\r\nContent-Range: bytes 0-4/5\r\nExpect: 100-continue\r\n\r\n")

# ---------------------------------------------------------------- finding a head


def test_head_end_is_just_past_the_blank_line_and_leaves_what_follows() -> None:
    """The index after CRLF CRLF; the body's first bytes stay after it."""
    buf = PUT + b"hello"
    assert buf[: http1.head_end(buf, 1 << 14)] == PUT


def test_head_end_finds_a_blank_line_split_across_reads() -> None:
    """A search resumed from ``searched`` still finds an end that straddles the two reads."""
    buf = bytearray(PUT[:-2])
    assert http1.head_end(buf, 1 << 14) == -1
    searched = len(buf)
    buf += b"\r\n"
    assert http1.head_end(buf, 1 << 14, searched) == len(PUT)


def test_head_end_refuses_a_head_past_its_limit() -> None:
    """No blank line within ``limit`` bytes raises HeadTooLarge (a server answers 431)."""
    with pytest.raises(HeadTooLarge, match="within 64 bytes"):
        http1.head_end(b"GET / HTTP/1.1\r\nX: " + b"a" * 80, 64)


def test_head_end_does_not_end_at_bare_line_feeds() -> None:
    """A head with bare LFs never ends (it is refused by its size or deadline, as before)."""
    assert http1.head_end(b"GET / HTTP/1.1\nHost: x\n\n", 1 << 10) == -1


# ---------------------------------------------------------------- requests


def test_a_put_head_parses_to_method_target_and_lower_cased_headers() -> None:
    """Method, target as sent (percent-encoded), header names lower-cased, values stripped."""
    request = http1.parse_request(PUT)
    assert (request.method, request.target, request.version) == ("PUT", "/v1/data/p%201/1/inputs/w.bin", "1.1")
    assert request.headers["content-range"] == "bytes 0-4/5"
    assert request.headers["expect"] == "100-continue"
    assert request.keep_alive


def test_path_drops_the_query_and_connection_close_ends_keep_alive() -> None:
    """``path`` is the target without its query; ``Connection: close`` is not kept alive."""
    request = http1.parse_request(b"GET /metrics?x=1 HTTP/1.1\r\nConnection: Close\r\n\r\n")
    assert request.path == "/metrics"
    assert not request.keep_alive


def test_a_repeated_header_keeps_its_last_value() -> None:
    """As the hand parser did: the last of two ``X`` headers."""
    assert http1.parse_request(b"GET / HTTP/1.1\r\nX: a\r\nX: b\r\n\r\n").headers["x"] == "b"


def test_an_upgrade_request_is_a_whole_head() -> None:
    """``Upgrade`` and ``CONNECT`` heads parse (refusing them is the caller's business)."""
    request = http1.parse_request(b"GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
    assert request.headers["upgrade"] == "websocket"


@pytest.mark.parametrize(
    ("head", "why"),
    [
        (b"PUT / HTTP/1.1\r\nContent-Length : 5\r\n\r\n", "space before colon"),
        (b"PUT / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", "two Content-Lengths"),
        (b"PUT / HTTP/1.1\r\nX: a\r\n b\r\n\r\n", "obs-fold"),
        (b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n", "TE and CL"),
        (b"GET /\r\n\r\n", "HTTP/0.9"),
        (b"GET / HTTP/2.0\r\n\r\n", "version 2"),
        (b"FOO / HTTP/1.1\r\n\r\n", "unknown method"),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", "a TLS hello"),
    ],
)
def test_malformed_request_heads_are_refused_naming_why(head: bytes, why: str) -> None:
    """The heads the hand parsers accepted (request smuggling) and non-HTTP bytes raise HeadError."""
    with pytest.raises(HeadError) as raised:
        http1.parse_request(head)
    assert str(raised.value), why


# ---------------------------------------------------------------- responses


def test_a_response_head_parses_to_status_reason_and_headers() -> None:
    """Status, reason, lower-cased headers; ``content_length`` 0 when not said."""
    response = http1.parse_response(b"HTTP/1.1 204 No Content\r\nUpload-Offset: 5\r\n\r\n")
    assert (response.status, response.reason, response.headers) == (204, "No Content", {"upload-offset": "5"})
    assert response.content_length == 0 and response.keep_alive


def test_a_response_without_reason_and_an_interim_100_parse() -> None:
    """``HTTP/1.1 200`` (no reason) and ``100 Continue`` are answers too."""
    assert http1.parse_response(b"HTTP/1.1 200\r\n\r\n").status == 200
    assert http1.parse_response(http1.CONTINUE).status == 100


def test_not_an_answer_is_refused() -> None:
    """Bytes that are no HTTP answer raise HeadError quoting them."""
    with pytest.raises(HeadError, match="not an HTTP answer"):
        http1.parse_response(b"SSH-2.0-OpenSSH\r\n\r\n")


def test_is_response_looks_at_the_first_five_bytes() -> None:
    """A plain-HTTP server's first bytes are ``HTTP/``; a TLS alert's are not."""
    assert http1.is_response(b"HTTP/1.1 200 OK")
    assert not http1.is_response(b"\x15\x03\x03\x00\x02")


# ---------------------------------------------------------------- writing


def test_format_response_uses_the_reason_table_and_keeps_header_order() -> None:
    """``HTTP/1.1 409 Conflict``, then the headers as given, then the blank line."""
    head = http1.format_response(409, {"Upload-Offset": "3", "Content-Length": "0"})
    assert head == b"HTTP/1.1 409 Conflict\r\nUpload-Offset: 3\r\nContent-Length: 0\r\n\r\n"


def test_a_header_value_with_a_line_break_is_refused() -> None:
    """No caller can inject a header through a value."""
    with pytest.raises(ValueError, match="line break"):
        http1.format_request("GET", "/", {"Authorization": "Bearer x\r\nX-Evil: 1"})


header_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12).filter(
    lambda name: name.strip("-") == name and name not in ("content-length", "transfer-encoding", "connection",
                                                         "upgrade")
)
header_values = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40)
targets = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.%~", min_size=0, max_size=40).map(lambda s: "/" + s)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["GET", "PUT", "HEAD"]), targets, st.dictionaries(header_names, header_values, max_size=8))
def test_request_heads_round_trip(method: str, target: str, headers: dict[str, str]) -> None:
    """What format_request writes, parse_request reads back the same (names lower-cased)."""
    head = http1.format_request(method, target, headers)
    assert http1.head_end(head, 1 << 16) == len(head)
    request = http1.parse_request(head)
    assert (request.method, request.target) == (method, target)
    assert request.headers == headers


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=100, max_value=599), st.dictionaries(header_names, header_values, max_size=8))
def test_response_heads_round_trip(status: int, headers: dict[str, str]) -> None:
    """What format_response writes, parse_response reads back the same."""
    response = http1.parse_response(http1.format_response(status, headers))
    assert (response.status, response.headers) == (status, headers)


# ---------------------------------------------------------------- ranges


def test_content_range_round_trips_and_checks_the_body_length() -> None:
    """``bytes S-E/T`` -> (S, T); a body of another length is a 400."""
    assert parse_content_range(content_range(4, 10, 10), 6) == (4, 10)
    with pytest.raises(RangeError) as raised:
        parse_content_range("bytes 0-4/10", 3)
    assert raised.value.status == 400


def test_a_range_outside_the_output_is_416_with_its_size() -> None:
    """``bytes=N-`` within the output -> [N, size); past it -> 416 and ``Content-Range: bytes */size``."""
    assert parse_range(range_from(3), 10) == (3, 10)
    assert parse_range("bytes=2-4", 10) == (2, 5)
    with pytest.raises(RangeError) as raised:
        parse_range("bytes=10-", 10)
    assert (raised.value.status, raised.value.headers) == (416, {"Content-Range": "bytes */10"})
