"""bench/cluster_chaos.py's "back after the shard was served again" counts a worker back when it is, not at its next
life: a registration just before the bench reads the ``serving shard`` line is the worker back."""

from __future__ import annotations

import math
from types import ModuleType

from tests import bench_scripts


def _bench() -> ModuleType:
    return bench_scripts.load("cluster_chaos.py", "cluster_chaos")


def test_a_worker_registered_with_the_new_core_just_before_its_line_was_read_is_back_at_once() -> None:
    """The sims of a kill -9 (the last session's run: lost at 566.886, registered 570.0118, the line read at 570.012,
    killed again 599.378, registered 602.281) are back 0 s after served, not 32.27 s (their next life)."""
    events = [(563.89, "registered"), (566.886, "lost"), (570.0118, "registered"), (599.378, "lost"),
              (602.281, "registered")]  # fmt: skip
    assert _bench().back_s(events, 566.5, 570.012) == 0.0


def test_a_worker_back_only_with_a_core_that_then_lost_the_shard_is_back_at_its_next_registration() -> None:
    """A registration that another loss ended before the shard was served again (the old core, during a database
    freeze) is not the worker back: its first registration after that is."""
    events = [(9.0, "registered"), (11.0, "lost"), (12.0, "registered"), (15.0, "lost"), (17.5, "registered")]
    assert _bench().back_s(events, 10.0, 16.0) == 1.5


def test_workers_never_lost_not_attached_or_not_yet_back() -> None:
    """Never lost after the fault: 0; not attached at the fault: nan (not counted); lost and not back: None."""
    back_s = _bench().back_s
    assert back_s([(1.0, "registered")], 10.0, 12.0) == 0.0
    assert math.isnan(back_s([(1.0, "registered"), (5.0, "lost"), (11.0, "registered")], 10.0, 12.0))
    assert back_s([(1.0, "registered"), (10.5, "lost")], 10.0, 12.0) is None
    assert back_s([(1.0, "registered"), (10.5, "lost"), (13.0, "registered")], 10.0, 12.0) == 1.0
