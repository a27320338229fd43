"""Plan graphs (issue #28): one plan's output is the next plan's input, where the data already is.

A plan names another plan's output as an input (``InputSpec.ref``: the reference form) or runs
after other plans (``submit.after``). This package is the pure bookkeeping of those edges
(docs/SEMANTICS.md §Graphs); it reads no clock, draws no random number and does no I/O. The
core hands it the plans table and tells it what happened; it answers with decisions.

    needs.py     Need, needs_of, PlanView    the edges one plan declares, and what the graph reads of a plan
    remote.py    RemotePlan, PlansAndRemotes upstreams of another shard (cluster mode), as the driver read
                                             their rows; the plans table and them, as the graph reads both
    lineage.py   Lineage                     where each output is now (the producer, or its latest
                                             rebuild), which are lost, and whether a lost one can be rebuilt
    graph.py     PlanGraph                   edges both ways; refusals at submit; readiness and waiting
                                             reasons; failure propagation; dependants to cancel; rebuilds
    locality.py  choose_holders              where a consumer should run: the worker holding most of its
                                             bytes, or a wait for it bounded by how long a copy would take
    replicas.py  HeldSuccess, copy_submit    replicated outputs: which still want a copy, the copy plan's
                                             submit, how long a success waits for its copies

Calls go down the list; none of them imports the core or placement.
"""

from __future__ import annotations

from coordinator.graphs.graph import Doom, PlanGraph, Rebuild, Verdicts, Wait
from coordinator.graphs.lineage import Lineage, Source
from coordinator.graphs.locality import LocalityChoice, LocalityConfig, choose_holders, held_bytes, wait_bound_s
from coordinator.graphs.needs import MAX_NEEDS, Need, PlanView, needs_of

__all__ = [
    "MAX_NEEDS",
    "Doom",
    "Lineage",
    "LocalityChoice",
    "LocalityConfig",
    "Need",
    "PlanGraph",
    "PlanView",
    "Rebuild",
    "Source",
    "Verdicts",
    "Wait",
    "choose_holders",
    "held_bytes",
    "needs_of",
    "wait_bound_s",
]
