"""Shared low-level I/O: the home of what the worker agent and the SDK both use (imports ``protocol`` only).

* writeback: write-behind and ``O_DIRECT`` helpers, so big files written once do not pile up in
  the page cache (the worker's spool, the SDK's downloads);
* chunkwrite: a relayed download's chunks written and hashed in two threads of their own;
* listening: a listener's discipline (fd limit, ``TCP_DEFER_ACCEPT``, repeats per host), shared by
  the coordinator's ports and the worker's data endpoint;
* spawn: a child process started so that a cancel during its start never leaves what it started
  running (the coordinator's carbon feed, the worker's commands);
* wsbulk: big binary websocket frames sent and received past the websockets library's copies
  (the relayed chunks of the worker, the SDK and the coordinator's I/O layer);
* wsmask: binary frames written past websockets' frame object: a dialling side's (the SDK's and the
  worker's) masked, their mask keys drawn from ``os.urandom`` a block at a time; the coordinator's plain;
* frame_sink: a connection's final binary frames decoded and dispatched where they are read (``SinkReceive``:
  the SDK's and the worker's ``SinkConnection``, the coordinator's ``FailFastConnection``).

Neither the worker agent nor the SDK imports the other: both import this. The coordinator's pure
core imports nothing from here (tests/unit/test_layers.py).
"""
