#!/usr/bin/env bash
# The main job on a fresh machine: build (or reuse) a vLLM CPU environment with vllm-rlpatch installed, then
# run `vllm-rlpatch parity` on the embedded model: the rollout-vs-trainer logprob table (stdout),
# parity.json and parity.png in ./vllm-rlpatch-out/ (--out DIR elsewhere).
#   Usage: scripts/parity.sh [VLLM_VERSION] [parity args...]      (default 0.32.0; e.g. scripts/parity.sh 0.25.1 --runs 3)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="0.32.0"
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then VERSION="$1"; shift; fi
PY=$(bash "$ROOT/ci/envs/build_env.sh" "$VERSION" | tail -n 1)
exec "$(dirname "$PY")/vllm-rlpatch" parity "$@"
