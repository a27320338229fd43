"""The OpenAI-compatible front door (issue #30, docs/OPENAI.md): any OpenAI client can use the fleet.

The pure part, one module per concern; the asyncio driver that serves it on the coordinator's
main port lives in coordinator/io/ (nothing here reads a clock or a socket):

===============  =====================================================================
module           owns
===============  =====================================================================
``intake``       one connection's HTTP/1.1 requests: heads, bodies, their limits
``request``      a request body checked and made a ``generate`` plan with routing
                 hints computed here (protocol/prompts.py), the session key
``reply``        the answer from the plan's events: OpenAI's JSON, or its event stream
                 (chunks, ``[DONE]``, usage, the ``fleetwire`` receipt extension);
                 the queue timeout; an error mid-stream is said, never a silent cut
``models``       ``GET /v1/models`` and the 404 of a model no worker serves
``errors``       OpenAI's error shape and the status of each case
===============  =====================================================================
"""

from coordinator.openai_api.errors import ApiError, plan_failure, submit_refused
from coordinator.openai_api.intake import HttpRequest, RequestReader
from coordinator.openai_api.models import ModelTable, Served, served_models
from coordinator.openai_api.reply import Out, Reply, error_response, json_response
from coordinator.openai_api.request import PATHS, DoorRequest, Kind, parse_request

__all__ = [
    "PATHS", "ApiError", "DoorRequest", "HttpRequest", "Kind", "ModelTable", "Out", "Reply", "RequestReader", "Served",
    "error_response", "json_response", "parse_request", "plan_failure", "served_models", "submit_refused",
]
