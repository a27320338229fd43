"""The data plane without I/O (docs/PROTOCOL.md §Data plane, §11 Relay): what every transport of a plan's bytes obeys.

``http1``: the one HTTP/1.1 head codec. ``ranges``: ``Range``/``Content-Range``. ``verdicts``: one
table of what a receiver or sender decided, as an HTTP status and as a ``data_end`` code.
``upload``/``download``: the rules of a transfer (offsets, resume, credit, settling, retries) as
plain state machines, driven by the worker's HTTP endpoint and relay end and by the SDK's transports.
"""
