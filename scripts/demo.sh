#!/usr/bin/env bash
# The main job on a fresh machine: build (or reuse) a vLLM CPU environment with vllm-rlpatch installed,
# then run `vllm-rlpatch demo` on the embedded model.   Usage: scripts/demo.sh [VLLM_VERSION] [demo args...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${1:-0.32.0}"
[ $# -gt 0 ] && shift
PY=$(bash "$ROOT/ci/envs/build_env.sh" "$VERSION" | tail -n 1)
exec "$(dirname "$PY")/vllm-rlpatch" demo "$@"
