"""Handlers the data-plane end-to-end tests load into real worker processes (``--handler``)."""

from __future__ import annotations

import hashlib
from typing import Any


async def digest(ctx: Any, args: Any) -> dict[str, Any]:
    """The size and sha256 of input ``data``, read in chunks."""
    hasher, size = hashlib.sha256(), 0
    async for chunk in ctx.inputs["data"]:
        hasher.update(chunk)
        size += len(chunk)
    return {"size": size, "digest": f"sha256:{hasher.hexdigest()}"}
