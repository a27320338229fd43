"""Encoding and decoding of frames (docs/PROTOCOL.md §Frames).

A frame is one websocket message holding either one message object or an array of
them. The encoding is chosen by the websocket subprotocol: ``fleetwire.v1.msgpack``
(binary frames, the default) or ``fleetwire.v1.json`` (text frames).

Decoding never raises on bad input: ``Codec.decode`` returns, in order, each decoded
message or a ``DecodeFailure`` that says what was wrong and where, so the caller can
answer each bad message with an ``error`` frame and keep the good ones.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

import msgspec

from protocol import errors
from protocol.messages import type_names

Encoding = Literal["msgpack", "json"]

SUBPROTOCOL_MSGPACK = "fleetwire.v1.msgpack"
SUBPROTOCOL_JSON = "fleetwire.v1.json"
SUBPROTOCOLS: dict[str, Encoding] = {SUBPROTOCOL_MSGPACK: "msgpack", SUBPROTOCOL_JSON: "json"}
ENCODING_SUBPROTOCOL: dict[Encoding, str] = {v: k for k, v in SUBPROTOCOLS.items()}


@dataclass(frozen=True, slots=True)
class DecodeFailure:
    """One message of a frame that could not be decoded."""

    code: str
    message: str
    req_id: int = 0
    type: str | None = None


class _Probe(msgspec.Struct):
    """Reads just enough of a bad message to name it and echo its ``req_id``."""

    type: Any = None
    req_id: Any = 0


def _ext_hook(code: int, data: memoryview) -> Any:
    raise msgspec.ValidationError(f"msgpack extension type {code} is not allowed")


# msgpack integers span -2**63 .. 2**64-1; JSON numbers do not stop there. A JSON peer's
# bigger integer would make the frame to a msgpack peer unencodable, so it is refused at
# the boundary. Only a frame with a run of 19+ digits can hold one: the scan is C-speed.
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
_LONG_DIGITS = re.compile(rb"[0-9]{19,}")


def _out_of_range_int(value: Any) -> str | None:
    """The ``$.path`` of the first integer msgpack cannot carry inside ``value``, or None.

    Iterative, so a value nested as deeply as the decoder allows cannot exhaust the stack.
    """
    stack: list[tuple[Any, str]] = [(value, "$")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, bool):
            continue
        if isinstance(item, int):
            if not _INT_MIN <= item <= _INT_MAX:
                return path
        elif isinstance(item, msgspec.Struct):
            stack.extend((getattr(item, name), f"{path}.{name}") for name in item.__struct_fields__)
        elif isinstance(item, dict):
            stack.extend((v, f"{path}.{k}") for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))
    return None


def _portable(value: Any) -> Any:
    """``value`` as builtins that both encodings carry: odd map keys and huge ints become strings.

    Used only when encoding a message failed (see ``Codec.encode_safe``): a msgpack map keyed
    by nil, a bool or an array has no JSON form, and JSON has no limit on integers.
    """
    if isinstance(value, bool) or value is None or isinstance(value, str | float | bytes):
        return value
    if isinstance(value, int):
        return value if _INT_MIN <= value <= _INT_MAX else str(value)
    if isinstance(value, dict):
        return {_portable_key(k): _portable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_portable(v) for v in value]
    return value


def _portable_key(key: Any) -> str | int | float:
    if isinstance(key, str):
        return key
    if isinstance(key, int | float) and not isinstance(key, bool):
        return key if _INT_MIN <= key <= _INT_MAX else str(key)
    if isinstance(key, bytes):
        return key.decode("utf-8", "backslashreplace")
    return msgspec.json.encode(_portable(key)).decode()


class Codec:
    """Encodes outgoing and decodes incoming frames for one session role.

    Args:
        encoding: ``"msgpack"`` or ``"json"``.
        inbound: the union of message types this side accepts (e.g. ``FromClient``).
        role: the peer's role, used in error messages (``"client"``, ``"worker"``).
    """

    def __init__(self, encoding: Encoding, inbound: Any, role: str) -> None:
        self.encoding: Encoding = encoding
        self.text = encoding == "json"
        self.role = role
        self._accepted = type_names(inbound)
        frame_type = Union[inbound, list[inbound]]  # type: ignore[valid-type]
        if encoding == "msgpack":
            self._encoder: Any = msgspec.msgpack.Encoder()
            self._frame: Any = msgspec.msgpack.Decoder(frame_type, ext_hook=_ext_hook)
            self._one: Any = msgspec.msgpack.Decoder(inbound, ext_hook=_ext_hook)
            self._raws: Any = msgspec.msgpack.Decoder(list[msgspec.Raw], ext_hook=_ext_hook)
            self._probe: Any = msgspec.msgpack.Decoder(_Probe, ext_hook=_ext_hook)
        else:
            self._encoder = msgspec.json.Encoder()
            self._frame = msgspec.json.Decoder(frame_type)
            self._one = msgspec.json.Decoder(inbound)
            self._raws = msgspec.json.Decoder(list[msgspec.Raw])
            self._probe = msgspec.json.Decoder(_Probe)

    def encode(self, msgs: Sequence[Any]) -> bytes:
        """One frame for ``msgs``: a bare object for one message, an array for more."""
        if len(msgs) == 1:
            return self._encoder.encode(msgs[0])  # type: ignore[no-any-return]
        return self._encoder.encode(msgs)  # type: ignore[no-any-return]

    @property
    def encode_one(self) -> Callable[[Any], bytes]:
        """One message to its bytes, as :meth:`encode` of a list of one: for a caller that encodes many apart."""
        return self._encoder.encode  # type: ignore[no-any-return]

    def encode_safe(self, msgs: Sequence[Any]) -> bytes:
        """Like :meth:`encode`, but values this encoding cannot carry are sent in a portable form.

        A msgpack peer may send maps keyed by nil, bools or arrays, which JSON cannot hold;
        such keys are sent as their JSON text (``"null"``, ``"true"``, ``"[1,2]"``) rather than
        failing the whole frame. The fast path is :meth:`encode`; this costs only on failure.

        Raises:
            RecursionError: a value nested too deeply to convert (the decoder's own limit
                keeps decoded values below it).
        """
        try:
            return self.encode(msgs)
        except (TypeError, OverflowError, ValueError):
            portable = [
                m if isinstance(m, msgspec.Raw) else _portable(msgspec.to_builtins(m, builtin_types=(bytes,)))
                for m in msgs
            ]
            return self.encode(portable)

    def encode_raw(self, msg: Any) -> msgspec.Raw:
        """One message encoded (as by :meth:`encode_safe`), to be put in many frames as is.

        A frame encoded from a list holding ``msgspec.Raw`` items copies their bytes: this is
        how one event for many subscribers is encoded once (coordinator/io/frontdoor/core_driver.py).
        """
        return msgspec.Raw(self.encode_safe([msg]))

    def decode(self, frame: bytes | str) -> list[Any]:
        """Messages of a frame, each a Struct or a ``DecodeFailure``, in order."""
        if isinstance(frame, str):
            if not self.text:
                return [DecodeFailure(errors.BAD_FRAME, "text frame on a msgpack session; send binary frames")]
            frame = frame.encode()
        elif self.text:
            return [DecodeFailure(errors.BAD_FRAME, "binary frame on a JSON session; send text frames")]
        try:
            decoded = self._frame.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            msgs = self._decode_slow(frame)
        else:
            msgs = decoded if isinstance(decoded, list) else [decoded]
        if self.text and _LONG_DIGITS.search(frame):
            msgs = [self._check_ints(msg, index, len(msgs)) for index, msg in enumerate(msgs)]
        return msgs

    def _check_ints(self, msg: Any, index: int, count: int) -> Any:
        """``msg``, or a DecodeFailure naming where it holds an integer msgpack cannot carry."""
        if isinstance(msg, DecodeFailure):
            return msg
        path = _out_of_range_int(msg)
        if path is None:
            return msg
        mtype = type(msg).__struct_config__.tag
        where = f" (message {index} of the frame)" if count > 1 else ""
        return DecodeFailure(
            errors.INVALID_MESSAGE,
            f"invalid {mtype!r} message{where}: integer out of range (-2**63 .. 2**64-1) - at `{path}`; "
            "send larger numbers as strings",
            getattr(msg, "req_id", 0),
            mtype if isinstance(mtype, str) else None,
        )

    def _decode_slow(self, frame: bytes) -> list[Any]:
        """Per-message decode, used only once the fast whole-frame decode failed."""
        try:
            raws: list[msgspec.Raw] = self._raws.decode(frame)
        except msgspec.ValidationError:
            raws = [msgspec.Raw(frame)]
        except (msgspec.DecodeError, RecursionError) as exc:
            return [DecodeFailure(errors.BAD_FRAME, f"frame is not valid {self.encoding}: {exc}")]
        out: list[Any] = []
        for index, raw in enumerate(raws):
            where = f" (message {index} of the frame)" if len(raws) > 1 else ""
            try:
                out.append(self._one.decode(raw))
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
                out.append(self._failure(raw, exc, where))
        return out

    def _failure(self, raw: msgspec.Raw, exc: Exception, where: str) -> DecodeFailure:
        try:
            probe = self._probe.decode(raw)
        except RecursionError:
            return DecodeFailure(errors.INVALID_MESSAGE, f"message nested too deeply{where}")
        except msgspec.ValidationError as probe_exc:  # valid msgpack/JSON, but not a map (42, null, "x")
            return DecodeFailure(
                errors.INVALID_MESSAGE, f"a message must be a map with a string 'type' field{where}: {probe_exc}"
            )
        except msgspec.DecodeError as probe_exc:  # not msgpack/JSON at all: malformed or truncated
            return DecodeFailure(errors.BAD_FRAME, f"frame is not valid {self.encoding}{where}: {probe_exc}")
        req_id = probe.req_id if isinstance(probe.req_id, int) and not isinstance(probe.req_id, bool) else 0
        mtype = probe.type if isinstance(probe.type, str) else None
        if mtype is None:
            return DecodeFailure(errors.INVALID_MESSAGE, f"message has no string 'type' field{where}", req_id)
        if mtype not in self._accepted:
            accepted = ", ".join(sorted(self._accepted))
            return DecodeFailure(
                errors.UNKNOWN_TYPE,
                f"unknown message type {mtype!r} for a {self.role} session{where}; expected one of: {accepted}",
                req_id,
                mtype,
            )
        if isinstance(exc, RecursionError):
            detail = "nested too deeply"
        else:
            detail = str(exc)
        return DecodeFailure(errors.INVALID_MESSAGE, f"invalid {mtype!r} message{where}: {detail}", req_id, mtype)
