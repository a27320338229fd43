#!/usr/bin/env bash
# Every GPU check of fleetwire on a host with an NVIDIA GPU, in one go (a lent GPU machine, or yours):
#
#     bash bench/gpu_host_checks.sh [OUT_DIR]
#
# 1. bench/gpu_check.py: NVML probe, power/energy vs NVML's counter, health sampling, per-plan isolation;
# 2. bench/gpu_fleet.py: a real coordinator + worker: process-isolated handler sees only its GPU (env, CUDA
#    driver, torch), a plan holding none sees none, /metrics carries each device's health;
# 3. bench/handler_isolation.py: the per-plan cost of the child bridge;
# 4. the GPU-related tests (they must pass on a GPU host too: tests/no_nvml keeps the host's real NVML out).
# Each writes its output to OUT_DIR (default ./gpu-checks); the exit status is the number of steps that failed.
set -u
out=${1:-gpu-checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
failed=0
(nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu,power.draw,clocks_event_reasons.active --format=csv) > "$out/nvidia-smi.txt" 2>&1
step() {  # name, command...
    local name=$1; shift
    local t0=$SECONDS
    "$@" > "$out/$name.txt" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $((SECONDS - t0)) s"
    [ $rc -eq 0 ] || failed=$((failed + 1))
}
step gpu_check timeout 180 "$py" bench/gpu_check.py --seconds 5 --json --require-gpu
step gpu_fleet timeout 180 "$py" bench/gpu_fleet.py --plans 100 --json --require-gpu
step handler_isolation timeout 120 "$py" bench/handler_isolation.py --plans 200
step gpu_tests timeout 300 "$py" -m pytest -q -p no:cacheprovider tests/unit/test_probe.py tests/unit/test_devices.py \
    tests/unit/test_gpu_health.py tests/unit/test_gpu_quarantine.py tests/unit/test_gpu_placement.py \
    tests/unit/test_energy_carbon.py tests/unit/test_handler_child.py tests/integration/test_gpu_health.py \
    tests/integration/test_handler_isolation.py tests/e2e/test_gpus.py tests/e2e/test_gpu_python.py
exit $failed
