"""fleetwire/memtune.py: the allocator's top pad, checked by what it is for (page faults), in fresh processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fleetwire.memtune import ENV

# Buffers made and freed as the websockets library does per frame: 16 MiB of 64 KiB buffers (heap
# sized: glibc maps bigger ones of its own) at a time, touched, freed, forty times (rounds). Prints the
# minor page faults it took.
CHURN = """
import json, resource, sys
sys.path.insert(0, {root!r})
if {tune}:
    from fleetwire.memtune import tune_allocator
    pad = tune_allocator()
else:
    pad = 0
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({rounds}):
    held = [bytearray(64 << 10) for _ in range(256)]
    del held
print(json.dumps({{"pad": pad, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}}))
"""

glibc = pytest.mark.skipif(not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
                           if hasattr(os, "confstr") else True, reason="M_TOP_PAD is glibc's")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def churn(tune: bool, env: dict[str, str] | None = None, rounds: int = 40) -> dict[str, int]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != ENV}
    code = CHURN.format(root=ROOT, tune=tune, rounds=rounds)
    out = subprocess.run([sys.executable, "-c", code], env={**environ, **(env or {})},
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@glibc
def test_the_top_pad_stops_a_page_fault_per_page_of_churned_buffers() -> None:
    """Without it every round of buffers faults its 16 MiB in again (4096 pages); with it, the heap keeps them."""
    default = churn(False)
    tuned = churn(True)
    assert tuned["pad"] == 64 << 20
    assert default["faults"] > 40 * 2048  # at least half the pages of every round, faulted afresh
    assert tuned["faults"] < default["faults"] // 8


@glibc
def test_zero_leaves_the_allocator_as_it_is() -> None:
    assert churn(True, {ENV: "0"}, rounds=0)["pad"] == 0  # the setting alone: no buffers to churn


def test_a_bad_setting_is_refused_naming_the_variable() -> None:
    out = subprocess.run([sys.executable, "-m", "fleetwire", "plans"], env={**os.environ, ENV: "lots"},
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and f"{ENV} must be a number of bytes" in out.stderr and "'lots'" in out.stderr
