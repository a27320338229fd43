"""JSON Schema of every message, generated from the Structs (``fleetwire protocol schema``)."""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.messages import FromClient, FromWorker, ToClient, ToWorker


def json_schema() -> dict[str, Any]:
    """One schema document whose ``$defs`` hold every message and record type.

    The top level is an object keyed by direction (``from_worker``, ``to_worker``,
    ``from_client``, ``to_client``), each the union a peer of that direction may send.
    """
    unions = {"from_worker": FromWorker, "to_worker": ToWorker, "from_client": FromClient, "to_client": ToClient}
    names = list(unions)
    schemas, components = msgspec.json.schema_components(list(unions.values()), ref_template="#/$defs/{name}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "fleetwire protocol v1",
        "description": "A frame is one message object or an array of them. See docs/PROTOCOL.md.",
        "type": "object",
        "properties": {
            name: {"anyOf": [schema, {"type": "array", "items": schema}]}
            for name, schema in zip(names, schemas, strict=True)
        },
        "$defs": components,
    }
