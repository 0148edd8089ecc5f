#!/usr/bin/env bash
# The refit GPU runs (issue: weight updates at memory speed on the default path), on the lent H200, after the
# vLLM bundle chunks were carried to /tmp/chunks (../shared/gpu/make_bundle.sh; one chunk per `run` call):
#   bash benchmarks/gpu/run_refit_gpu.sh        -> $OUT/refit_smoke.json, $OUT/refit_full_gpu.json
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
bash "$ROOT/benchmarks/gpu/setup_site.sh" /tmp/chunks || exit 1
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ALLOW_INSECURE_SERIALIZATION=1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
cd "$ROOT"
timeout ${FULL_S:-400} python3 benchmarks/gpu/refit_full_gpu.py "$OUT/refit_full_gpu.json" ${FULL_ARGS:-} > "$OUT/refit_full_gpu.log" 2>&1
echo "full rc=$?"; grep "full-gpu\]" "$OUT/refit_full_gpu.log" | tail -20
timeout ${SMOKE_S:-220} python3 benchmarks/gpu/refit_smoke.py "$OUT/refit_smoke.json" > "$OUT/refit_smoke.log" 2>&1
echo "smoke rc=$?"; tail -c 2200 "$OUT/refit_smoke.log" | grep -v "^WARNING" | tail -5
