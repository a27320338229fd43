"""The worker's device allocator (worker_agent/devices.py): allocate, release, share, --gpus declarations."""

from __future__ import annotations

import pytest

from protocol.messages import GpuInfo, Resources
from worker_agent.devices import DeviceAllocator, DeviceRequest, contradiction, parse_gpus


def four(share: int = 1) -> DeviceAllocator:
    return DeviceAllocator(parse_gpus("0,1,2,3"), share)


def test_allocations_never_overlap_without_sharing() -> None:
    """Four one-device plans get four distinct devices; a fifth gets none until one is released."""
    alloc = four()
    got = [alloc.allocate(f"p{i}", DeviceRequest(1)) for i in range(4)]
    assert sorted(d for g in got if g for d in g) == [0, 1, 2, 3]
    assert alloc.allocate("p4", DeviceRequest(1)) is None and alloc.free == 0
    assert alloc.release("p1") == got[1]
    assert alloc.allocate("p4", DeviceRequest(1)) == got[1]


def test_share_lets_k_plans_hold_one_device() -> None:
    """With share 2 two plans may hold each device, spread before stacked; a third per device waits."""
    alloc = DeviceAllocator(parse_gpus("0,1"), share=2)
    firsts = [alloc.allocate(f"a{i}", DeviceRequest(1)) for i in range(2)]
    assert sorted(firsts) == [(0,), (1,)]  # spread first
    seconds = [alloc.allocate(f"b{i}", DeviceRequest(1)) for i in range(2)]
    assert sorted(seconds) == [(0,), (1,)]
    assert alloc.allocate("c", DeviceRequest(1)) is None
    assert alloc.use() == [2, 2]


def test_preferred_devices_are_taken_when_free_else_any_match() -> None:
    """The coordinator's choice is honoured when free here; otherwise free matching ones are used."""
    alloc = four()
    assert alloc.allocate("a", DeviceRequest(2), preferred=[2, 3]) == (2, 3)
    assert alloc.allocate("b", DeviceRequest(1), preferred=[3]) == (0,)
    assert alloc.allocate("a", DeviceRequest(2)) == (2, 3)  # idempotent per key


def test_memory_and_model_match() -> None:
    """Only devices with enough memory whose name contains the model are given."""
    alloc = DeviceAllocator(parse_gpus("0:24GB:A10,1:80GB:H100,2:80GB:H100"))
    request = DeviceRequest.of(Resources(gpus=1, gpu_memory_gb=40, accelerator="h100"))
    assert request is not None
    assert alloc.allocate("x", request) == (1,)
    assert alloc.visible((1,)) == "1"


def test_release_of_an_unknown_key_is_a_noop() -> None:
    """Releasing twice, or a key that never held devices, changes nothing."""
    alloc = four()
    alloc.allocate("a", DeviceRequest(1))
    alloc.release("a")
    assert alloc.release("a") == () and alloc.free == 4


def test_parse_gpus_forms_and_errors() -> None:
    """--gpus takes indexes, INDEX:MEMORY:MODEL and MIG UUIDs; bad entries are refused naming them."""
    gpus = parse_gpus("0:80GB:H100,MIG-abc:10GB")
    assert gpus[0].memory_bytes == 80 * 10**9 and gpus[0].name == "H100"
    assert gpus[1].visible_id == "MIG-abc"
    for bad, words in [("0,0", "repeated"), ("0,,1", "empty"), ("0:eighty", "80GB"), ("0:1:2:3", "INDEX")]:
        with pytest.raises(ValueError, match=words):
            parse_gpus(bad)


def test_declaration_contradicting_nvml_is_named() -> None:
    """A declared device NVML lacks, or with more memory or another model, is a contradiction; none seen is fine."""
    nvml = [GpuInfo(name="NVIDIA A100-SXM4-40GB", memory_bytes=40 * 10**9, index=0)]
    assert contradiction(parse_gpus("0,1"), []) is None
    assert contradiction(parse_gpus("0"), nvml) is None
    assert "does not see" in (contradiction(parse_gpus("0,1"), nvml) or "")
    assert "NVML reports 40 GB" in (contradiction(parse_gpus("0:80GB"), nvml) or "")
    assert "H100" in (contradiction(parse_gpus("0:40GB:H100"), nvml) or "")
