#!/usr/bin/env bash
# The trainer twin's Model Runner V2 branch on the lent H200 (issue 22), once the chunks of
# benchmarks/gpu/make_site_0320.sh are in CHUNK_DIR (default /tmp/chunks0320; one chunk folder per `run` call,
# copied there: `mkdir -p /tmp/chunks0320 && cp .gpu/v0320/cNN/* /tmp/chunks0320/`), as run_mrv2_gpu.sh:
#
#   bash benchmarks/gpu/run_mrv2_twin_gpu.sh [CHUNK_DIR]
#     -> $OUT/mrv2_twin-vllm0.32.0-<card>.json        the checks (runner, rows captured, twin vs vLLM per setting)
#        $OUT/mrv2_twin-vllm0.32.0-<card>.log         this script's output (setup, the check's lines)
#        $OUT/mrv2_twin-vllm0.32.0-<card>.engine.log   the engine's log, when the check failed
#
# Sets up SITE (benchmarks/gpu/setup_site_0320.sh), then benchmarks/gpu/mrv2_twin.py with a timeout (TWIN_S,
# default 400 s). VLLM_USE_V2_MODEL_RUNNER is left unset: vLLM's default runner on a GPU (MRv2 from 0.29).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CHUNKS=${1:-/tmp/chunks0320}
OUT=${OUT:-/tmp/out}
SITE=${SITE:-/tmp/site0320}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oE "H[0-9]+" | head -1 | tr A-Z a-z)
NAME=${NAME:-mrv2_twin-vllm0.32.0-${GPU:-gpu}}
mkdir -p "$OUT"

main() {
echo "[run_mrv2_twin $(date +%H:%M:%S)] host $(hostname), $(nproc) cores; chunks in $CHUNKS: $(ls "$CHUNKS" 2>/dev/null | wc -l) files"
if ! bash "$ROOT/benchmarks/gpu/setup_site_0320.sh" "$CHUNKS" "$SITE"; then
  printf '{"check": "mrv2_twin", "ok": false, "failures": ["setup"]}\n' > "$OUT/$NAME.json"
  return 1
fi
export PYTHONPATH=$SITE LD_LIBRARY_PATH=$SITE/nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
unset VLLM_USE_V2_MODEL_RUNNER
cd "$ROOT"
rm -f "$OUT/$NAME.json"
timeout -k 20 "${TWIN_S:-400}" python3 benchmarks/gpu/mrv2_twin.py "$OUT/$NAME.json" --keep /tmp/mrv2-twin-work
rc=$?
if [ ! -f "$OUT/$NAME.json" ]; then
  printf '{"check": "mrv2_twin", "ok": false, "failures": ["no result"], "rc": %d}\n' "$rc" > "$OUT/$NAME.json"
  [ $rc -eq 0 ] && rc=1
fi
[ $rc -eq 0 ] || { [ -f /tmp/mrv2-twin-work/engine.log ] && tail -c 3000000 /tmp/mrv2-twin-work/engine.log > "$OUT/$NAME.engine.log"; }
echo "[run_mrv2_twin $(date +%H:%M:%S)] rc=$rc"
return $rc
}

main 2>&1 | tee "$OUT/$NAME.log"
exit "${PIPESTATUS[0]}"
