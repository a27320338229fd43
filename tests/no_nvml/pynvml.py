"""``pynvml`` as on a host without NVIDIA's library, for the tests.

Tests that declare GPUs (``--gpus 0,1``, ``Agent(gpus=...)``) must not meet a GPU host's real devices: the
worker rightly refuses a declaration NVML contradicts ("declares device 1, which NVML does not see"), which
failed five tests on a one-GPU H100 machine. tests/conftest.py puts this module in ``sys.modules`` for every
test (a test that fakes NVML itself still replaces it), and the processes tests/e2e starts find it first on
``PYTHONPATH``. The real NVML is exercised by bench/gpu_check.py and bench/gpu_fleet.py on a GPU host.
"""

from __future__ import annotations

from pathlib import Path

DIRECTORY = str(Path(__file__).resolve().parent)


class NVMLError(Exception):
    """pynvml's base error."""


class NVMLError_LibraryNotFound(NVMLError):
    """What pynvml raises where libnvidia-ml is not installed."""


def nvmlInit() -> None:
    raise NVMLError_LibraryNotFound("NVML Shared Library Not Found (tests/no_nvml: the tests see no GPU)")


def nvmlShutdown() -> None:
    """Nothing to shut down."""
