"""The in-process core the per-plan benches drive (bench/core_per_plan.py, bench/tracing_per_plan.py).

Built outside the measured loops, so sharing it changes no per-plan figure. Imports inside the function: the
benches run it against another checkout too (``--compare``: PYTHONPATH names that tree).
"""

from __future__ import annotations

from typing import Any

WORKERS = (1, 2)  # the two echo workers' connection ids
CLIENT = 3  # the one client's


def echo_core(new_id: Any) -> Any:
    """A fresh core with two echo workers (1,000 slots each) and one client that may hold every plan unfinished.

    One client holds every plan at once: past the per-client limit (10,000 by default) its submits would be
    refused, so the limit is lifted, as the live benchmarks lift it (bench/_harness.py). Fields an older tree's
    ``CoreConfig`` lacks are left out.
    """
    import dataclasses

    from coordinator import Coordinator, CoreConfig
    from protocol.messages import Capabilities, Hello

    fields = {f.name for f in dataclasses.fields(CoreConfig)}
    core = Coordinator(CoreConfig(**{k: 0 for k in ("max_plans_per_client", "max_bytes_per_client") if k in fields}),
                       new_id=new_id)
    for conn in WORKERS:
        core.open_session(conn, "worker", 0.0, address=f"127.0.0.1:{4000 + conn}")
        caps = Capabilities(cpu_cores=4, ram_bytes=8_000_000_000, ops=["echo"], max_concurrency=1000)
        core.receive(conn, Hello(worker_id=f"bench-{conn}", capabilities=caps), 0.0)
    core.open_session(CLIENT, "client", 0.0, principal="bench")
    core.take_effects()
    return core
