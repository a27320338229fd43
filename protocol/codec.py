"""Encoding and decoding of frames (docs/PROTOCOL.md §Frames).

A frame is one websocket message holding either one message object or an array of
them. The encoding is chosen by the websocket subprotocol: ``fleetwire.v1.msgpack``
(binary frames, the default) or ``fleetwire.v1.json`` (text frames).

Decoding never raises on bad input: ``Codec.decode`` returns, in order, each decoded
message or a ``DecodeFailure`` that says what was wrong and where, so the caller can
answer each bad message with an ``error`` frame and keep the good ones.
"""

from __future__ import annotations

from collections.abc import Sequence
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
            return self._decode_slow(frame)
        return decoded if isinstance(decoded, list) else [decoded]

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
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return DecodeFailure(errors.INVALID_MESSAGE, f"a message must be an object with a 'type' field{where}")
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
