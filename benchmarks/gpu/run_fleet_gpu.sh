#!/usr/bin/env bash
# The GPU fleet run (issue 21): two engines on one H200 updated over cuda_ipc from one trainer (one set of
# handles every engine opens), against two sequential single-engine pushes and one device copy of the same
# bytes, in one run. On the lent H200, after the vLLM 0.25.1 bundle's chunks were carried to /tmp/chunks
# (../shared/gpu/make_bundle.sh; one chunk per `run` call), like run_refit_gpu.sh:
#
#   bash benchmarks/gpu/run_fleet_gpu.sh     -> $OUT/fleet_throughput-gpu.json, $OUT/fleet_throughput-gpu.log
#
# FLEET_S (default 480): the timeout; FLEET_ARGS: extra arguments (default: 8B shape, 2 engines at
# gpu_memory_utilization 0.35 each, 5 rounds, settle 1.5 s).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
bash "$ROOT/benchmarks/gpu/setup_site.sh" /tmp/chunks || exit 1
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
cd "$ROOT"
timeout "${FLEET_S:-480}" python3 benchmarks/fleet_throughput.py --device cuda --shape 8b --max-engines 2 \
  --gpu-mem 0.35 --transports cuda_ipc --rounds 5 --out "$OUT/fleet_throughput-gpu.json" ${FLEET_ARGS:-} \
  > "$OUT/fleet_throughput-gpu.log" 2>&1
rc=$?
echo "fleet rc=$rc"; grep -E "fleet-bench\]|^\[(settled|back_to_back)\]" "$OUT/fleet_throughput-gpu.log" | tail -30
exit $rc
