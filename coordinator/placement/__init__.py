"""Where a plan runs: the plan queue, the placement engine and its policies, one layer above the registry.

* plan_queue: queued plans grouped by requirement signature, best first, and why they wait;
* fair_queue: the same groups in fair-share order (teams, then principals, by weighted dominant
  share; quota tiers), with fairshare's usage, service and keys per team and principal (issue #27);
* preemption: which preemptible leases to stop so that a waiting plan can run, with no loops;
* placer: :class:`Placement`, which picks a worker for a plan (candidates, KV admission,
  sticky sessions, prefetch and work stealing);
* policies: the scoring policies (least busy, latency, joule, carbon, KV-aware, session);
* prefix: prefix-hash bookkeeping for KV-aware routing;
* shares: each worker's share of recent placements (KV-aware routing's bounded load).

The workers' records and their report predicates are coordinator/workers.py's; the registry
(coordinator/registry.py) owns the records and keeps the pools told; the pools' indexes of free
workers (heaps that keep placement O(log n)) are coordinator/capacity.py's. Imports point one
way: workers <- capacity <- registry <- placer (policies and plan_queue need only workers), so no
module outside this folder is both imported by it and importing it (tests/unit/test_layers.py).

Pure like the rest of the core: no clock, no I/O.
"""
