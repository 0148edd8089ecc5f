#!/usr/bin/env bash
# The GPU confirmation of vLLM 0.32.0 under Model Runner V2 (issue 20, item 4), on the lent H200, once the
# chunks of benchmarks/gpu/make_site_0320.sh are in CHUNK_DIR (default /tmp/chunks0320; one chunk folder per
# `run` call, copied there: `mkdir -p /tmp/chunks0320 && cp .gpu/v0320/cNN/* /tmp/chunks0320/`):
#
#   bash benchmarks/gpu/run_mrv2_gpu.sh [CHUNK_DIR]
#     -> $OUT/mrv2-vllm0.32.0-h200.json         every check, versions, GPU, the runner class
#        $OUT/mrv2-vllm0.32.0-h200.engine.log   the engine's log (vLLM and the plugin, every process)
#        $OUT/mrv2-vllm0.32.0-h200.log          this script's output (setup, import check, the check's lines)
#
# Sets up SITE (benchmarks/gpu/setup_site_0320.sh: torch 2.13.0, NCCL 2.32.6, triton 3.7.1, vLLM 0.32.0 and this
# checkout's vllm-rlpatch), then runs benchmarks/gpu/mrv2_check.py with a timeout (CHECK_S, default 420 s).
# VLLM_USE_V2_MODEL_RUNNER is left unset: the runner vLLM picks by default is the one checked. Exit status:
# the check's (0 = every check passed; a JSON saying what failed is written even on a timeout or a crash).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CHUNKS=${1:-/tmp/chunks0320}
OUT=${OUT:-/tmp/out}
SITE=${SITE:-/tmp/site0320}
NAME=${NAME:-mrv2-vllm0.32.0-h200}
mkdir -p "$OUT"

main() {
t0=$(date +%s)
echo "[run_mrv2 $(date +%H:%M:%S)] host $(hostname), $(nproc) cores; chunks in $CHUNKS: $(ls "$CHUNKS" 2>/dev/null | wc -l) files"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || true
if ! bash "$ROOT/benchmarks/gpu/setup_site_0320.sh" "$CHUNKS" "$SITE"; then
  echo "[run_mrv2] setup failed"
  printf '{"check": "mrv2_check", "ok": false, "failures": ["setup"], "error": "setup_site_0320.sh failed: see %s.log"}\n' \
    "$NAME" > "$OUT/$NAME.json"
  return 1
fi
t1=$(date +%s)
export PYTHONPATH=$SITE LD_LIBRARY_PATH=$SITE/nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# torch.compile stays on, as users run vLLM (the CPU suite turns dynamo off to start engines faster,
# tests/conftest.py); RLPATCH_TEST_TORCH_COMPILE=0 turns it off here too
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 RLPATCH_TEST_TORCH_COMPILE=${RLPATCH_TEST_TORCH_COMPILE:-1}
unset VLLM_USE_V2_MODEL_RUNNER
cd "$ROOT"
rm -f "$OUT/$NAME.json"
timeout -k 20 "${CHECK_S:-420}" python3 benchmarks/gpu/mrv2_check.py "$OUT/$NAME.json" --keep /tmp/mrv2-work
rc=$?
if [ ! -f "$OUT/$NAME.json" ]; then
  printf '{"check": "mrv2_check", "ok": false, "failures": ["no result"], "rc": %d, "error": "mrv2_check.py exited %d without writing its JSON (timeout after %s s?)"}\n' \
    "$rc" "$rc" "${CHECK_S:-420}" > "$OUT/$NAME.json"
  [ -f /tmp/mrv2-work/engine.log ] && tail -c 4000000 /tmp/mrv2-work/engine.log > "$OUT/$NAME.engine.log"
  [ $rc -eq 0 ] && rc=1
fi
echo "[run_mrv2 $(date +%H:%M:%S)] setup $((t1 - t0)) s, check $(( $(date +%s) - t1 )) s, rc=$rc"
return $rc
}

main 2>&1 | tee "$OUT/$NAME.log"
exit "${PIPESTATUS[0]}"
