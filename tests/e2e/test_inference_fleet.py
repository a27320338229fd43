"""examples/inference_fleet runs end to end: two OpenAI-compatible engines, two workers, a streaming client."""

from __future__ import annotations

import re

import pytest

from tests.e2e.conftest import ROOT, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


async def test_inference_fleet_example_streams_tokens_from_both_engines(cluster: Cluster) -> None:
    """run_local.py starts the fleet; the client prints every plan's streamed tokens, served by both workers."""
    proc = await cluster.script(ROOT / "examples" / "inference_fleet" / "run_local.py")
    assert await proc.wait(90) == 0, proc.lines
    plans = [line for line in proc.lines if line.startswith("plan ")]
    assert len(plans) == 4, proc.lines
    assert "plan" in plans[0] and plans[0].endswith(("[from engine-a]", "[from engine-b]"))
    # The toy model answers with the prompt's words reversed: every token arrived, in order.
    assert any(line.endswith(": workers to plans routes fleetwire [from engine-a]")
               or line.endswith(": workers to plans routes fleetwire [from engine-b]") for line in plans)
    served = {m.group(1) for line in proc.lines if (m := re.search(r"-> on (gpu-[ab]): \d+ tokens", line))}
    assert served == {"gpu-a", "gpu-b"}, proc.lines
    assert any(re.match(r"worker gpu-a: models=\['fake-model'\] engine running=\d+ waiting=0", line)
               for line in proc.lines), proc.lines
