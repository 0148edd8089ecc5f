#!/usr/bin/env bash
# vLLM 0.32.0 under Model Runner V2 on a GPU, in one command: the MRv2 check, the top-p boundary patch
# (mrv2_top_p) unpatched vs patched, the trainer twin both ways, the kernel against the PyTorch sort reference,
# and the patch's cost per decode step. Needs the chunks of benchmarks/gpu/make_site_0320.sh in CHUNK_DIR (flat:
# every c*/ folder's files in one folder; default /tmp/chunks0320):
#
#   OUT=$OUT bash benchmarks/gpu/run_mrv2_topp_gpu.sh [CHUNK_DIR]
#     -> $OUT/mrv2-vllm0.32.0-<card>.json               mrv2_check.py ("ok", or "failures" saying why)
#        $OUT/mrv2_topp-kernel-vllm0.32.0-<card>.json    the kernel on the GPU (vLLM's dispatch), unpatched and
#                                                        patched: constructed rows + 512 random rows of a 131072
#                                                        vocabulary (bf16 values, ties) vs the sort reference
#        $OUT/mrv2_twin-unpatched-vllm0.32.0-<card>.json twin without engine_info, VLLM_RLPATCH_MRV2_TOP_P=0
#        $OUT/mrv2_topp-captured-vllm0.32.0-<card>.json  the rows the unpatched twin found off (top-k/top-p
#                                                        input rebuilt), unpatched vs patched kernel, on the GPU
#        $OUT/mrv2_twin-vllm0.32.0-<card>.json           the patch on (the default), requests asking for
#                                                        rlpatch_support: the twin without engine_info
#                                                        (twin_matches) and with it (engine_info_matches)
#        $OUT/mrv2_topp-cost-vllm0.32.0-<card>.json      apply_top_k_top_p_triton per call, off vs on
#        $OUT/mrv2_topp-vllm0.32.0-<card>.log            this script's output; engine logs of failed steps
# Each step has its own time limit (seconds: CHECK_S 120, KERNEL_S 60 each, TWIN_S 130 each, COST_S 60; 560 in all) so that the
# whole run stays under ten minutes; a step that fails or times out leaves a JSON saying so and the next step
# runs. Exit status: 0 when every step passed. SKIP_SETUP=1 uses PYTHON (default python3) as it is, without the
# site (to try the script's flow where no chunks are).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CHUNKS=${1:-/tmp/chunks0320}
OUT=${OUT:-/tmp/out}
SITE=${SITE:-/tmp/site0320}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oE "H[0-9]+" | head -1 | tr A-Z a-z)
TAG=vllm0.32.0-${GPU:-gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
fails=()

say() { echo "[run_mrv2_topp $(date +%H:%M:%S)] $*"; }

step() {  # step NAME JSON LIMIT_S CMD... : run with a limit, leave a JSON either way
  local name=$1 json=$2 limit=$3; shift 3
  local t0; t0=$(date +%s)
  say "$name: $*"
  rm -f "$json"
  timeout -k 15 "$limit" "$@"
  local rc=$?
  if [ ! -f "$json" ]; then
    printf '{"step": "%s", "ok": false, "rc": %d, "error": "no JSON written (timeout after %s s?)"}\n' \
      "$name" "$rc" "$limit" > "$json"
    [ $rc -eq 0 ] && rc=1
  fi
  say "$name: rc=$rc, $(( $(date +%s) - t0 )) s"
  [ $rc -eq 0 ] || fails+=("$name")
  return 0
}

main() {
say "host $(hostname), $(nproc) cores; chunks in $CHUNKS: $(ls "$CHUNKS" 2>/dev/null | wc -l) files"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || true
if [ "${SKIP_SETUP:-0}" != 1 ]; then
  if ! bash "$ROOT/benchmarks/gpu/setup_site_0320.sh" "$CHUNKS" "$SITE"; then
    printf '{"step": "setup", "ok": false, "error": "setup_site_0320.sh failed"}\n' > "$OUT/mrv2_topp-setup-$TAG.json"
    return 1
  fi
  export PYTHONPATH=$SITE LD_LIBRARY_PATH=$SITE/nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 RLPATCH_TEST_TORCH_COMPILE=${RLPATCH_TEST_TORCH_COMPILE:-1}
unset VLLM_USE_V2_MODEL_RUNNER TRITON_INTERPRET
cd "$ROOT"
KP="PYTHONPATH=$ROOT/src:$ROOT/tests:${PYTHONPATH:-}"

# 1. the MRv2 check (plugin in every process, fp32 head, processed logprobs, refit, stale KV)
step mrv2_check "$OUT/mrv2-$TAG.json" "${CHECK_S:-120}" \
  "$PY" benchmarks/gpu/mrv2_check.py "$OUT/mrv2-$TAG.json" --keep /tmp/mrv2-work
[ -f /tmp/mrv2-work/engine.log ] && [[ " ${fails[*]} " == *" mrv2_check "* ]] && \
  tail -c 2000000 /tmp/mrv2-work/engine.log > "$OUT/mrv2-$TAG.engine.log"

# 2. the kernel on the GPU through vLLM's own dispatch: unpatched reproduces, patched keeps the nominal set;
#    512 random rows of a 131072 vocabulary against the sort reference (reported for both)
step kernel "$OUT/mrv2_topp-kernel-$TAG.json" "${KERNEL_S:-60}" \
  env $KP "$PY" tests/scripts/mrv2_top_p_interp.py --api --random 512 --vocab 131072 \
  --out "$OUT/mrv2_topp-kernel-$TAG.json"

# 3. the twin without engine_info, patch off: the 346 tokens again, and the rows behind them saved
step twin_unpatched "$OUT/mrv2_twin-unpatched-$TAG.json" "${TWIN_S:-130}" \
  env VLLM_RLPATCH_MRV2_TOP_P=0 "$PY" benchmarks/gpu/mrv2_twin.py "$OUT/mrv2_twin-unpatched-$TAG.json" \
  --keep /tmp/twin-off --dump-rows /tmp/twin-off/rows.pt
# (its failing twin_matches is the expected result: recorded, not counted as a failure of this run)
fails=("${fails[@]/twin_unpatched}")

# 4. those captured rows, unpatched vs patched kernel, on the GPU
if [ -f /tmp/twin-off/rows.pt ]; then
  step captured "$OUT/mrv2_topp-captured-$TAG.json" "${KERNEL_S:-60}" \
    env $KP "$PY" tests/scripts/mrv2_top_p_interp.py --api --rows /tmp/twin-off/rows.pt \
    --out "$OUT/mrv2_topp-captured-$TAG.json"
else
  say "captured: no rows saved by step 3"; fails+=(captured)
  printf '{"step": "captured", "ok": false, "error": "the unpatched twin saved no rows"}\n' \
    > "$OUT/mrv2_topp-captured-$TAG.json"
fi

# 5. the patch on (default), requests asking for rlpatch_support (MRv2's support hooks): the twin without
#    engine_info and with it, each against vLLM's processed logprobs: target 14,400 / 14,400 within 1e-5
step twin_patched "$OUT/mrv2_twin-$TAG.json" "${TWIN_S:-130}" \
  "$PY" benchmarks/gpu/mrv2_twin.py "$OUT/mrv2_twin-$TAG.json" --keep /tmp/twin-on --engine-info
[[ " ${fails[*]} " == *" twin_patched "* ]] && [ -f /tmp/twin-on/engine.log ] && \
  tail -c 2000000 /tmp/twin-on/engine.log > "$OUT/mrv2_twin-$TAG.engine.log"

# 6. cost per decode step: apply_top_k_top_p_triton, vLLM's vs the patched module, batches 1-256, 131072 vocab
step cost "$OUT/mrv2_topp-cost-$TAG.json" "${COST_S:-60}" \
  env $KP "$PY" benchmarks/gpu/topp_cost.py "$OUT/mrv2_topp-cost-$TAG.json"

local left=()
for f in "${fails[@]}"; do [ -n "$f" ] && left+=("$f"); done
say "done; failed steps: ${left[*]:-none}"
[ ${#left[@]} -eq 0 ]
}

main 2>&1 | tee "$OUT/mrv2_topp-$TAG.log"
exit "${PIPESTATUS[0]}"
