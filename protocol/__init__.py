"""The fleetwire wire contract: messages, codecs, error and close codes. No I/O here."""

from protocol.codec import (
    ENCODING_SUBPROTOCOL,
    SUBPROTOCOL_JSON,
    SUBPROTOCOL_MSGPACK,
    SUBPROTOCOLS,
    Codec,
    DecodeFailure,
    Encoding,
)
from protocol.messages import *  # noqa: F403  (the message module is the public surface)
from protocol.messages import PROTOCOL_VERSION, TERMINAL_STATES
from protocol.schema import json_schema

__all__ = [
    "ENCODING_SUBPROTOCOL",
    "PROTOCOL_VERSION",
    "SUBPROTOCOLS",
    "SUBPROTOCOL_JSON",
    "SUBPROTOCOL_MSGPACK",
    "TERMINAL_STATES",
    "Codec",
    "DecodeFailure",
    "Encoding",
    "json_schema",
]
