#!/usr/bin/env bash
# Outside CI: each framework's own weight sync against real vLLM (CPU), plugin off and on, with its adapter;
# JSON per framework under benchmarks/results/integrations/, then the trainer pages' tables (between their
# integrations-table markers: every framework on docs/trainers/index.md, its own on each framework's page).
#
#   bash ci/integrations.sh [framework ...]      # default: every framework with a benchmark script
#
# Each framework runs in an overlay of the test environment of its pinned vLLM (tests/support/frameworks.py
# builds and caches it from ci/envs/integrations/<framework>.txt); the base environments come from
# ci/envs/build_env.sh. `replays` (SkyRL and NeMo-RL, not installable here: their call sequences) runs in the
# vLLM 0.25.1 test environment itself.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/integrations
mkdir -p "$OUT"
fws=("$@")
if [ ${#fws[@]} -eq 0 ]; then
  for f in benchmarks/integrations/*.py; do
    n=$(basename "$f" .py)
    case "$n" in table|common|replay_workers) ;; *) fws+=("$n") ;; esac
  done
fi
envs="${VLLM_RLPATCH_ENV_CACHE:-$HOME/.cache/vllm-rlpatch/envs}"
for fw in "${fws[@]}"; do
  if [ "$fw" = replays ]; then
    base=$(ls -d "$envs"/vllm-0.25.1-*/bin/python 2>/dev/null | head -1)
    [ -n "$base" ] || { echo "integrations.sh: no vLLM 0.25.1 environment (bash ci/envs/build_env.sh 0.25.1)" >&2; exit 2; }
    echo "== replays (SkyRL, NeMo-RL; vLLM 0.25.1): $base"
    PYTHONPATH=src:tests "$base" benchmarks/integrations/replays.py --out "$OUT" --models qwen2-tiny,llama-tiny --repeat 3
    continue
  fi
  reqs=ci/envs/integrations/$fw.txt
  [ -f "$reqs" ] || { echo "integrations.sh: no $reqs" >&2; exit 2; }
  ver=$(sed -n 's/^# vllm: *//p' "$reqs" | head -1)
  base=$(ls -d "$envs"/vllm-"$ver"-*/bin/python 2>/dev/null | head -1)
  [ -n "$base" ] || { echo "integrations.sh: no vLLM $ver environment (bash ci/envs/build_env.sh $ver)" >&2; exit 2; }
  py=$(PYTHONPATH=tests "$base" -c "from support.frameworks import framework_python; print(framework_python('$fw'))")
  echo "== $fw (vLLM $ver): $py"
  PYTHONPATH=src:tests "$py" "benchmarks/integrations/$fw.py" --out "$OUT"
done
# every framework's row on the index; each framework's page (named after it) its own rows
for page in docs/trainers/*.md; do
  grep -q "<!-- integrations-table -->" "$page" || continue
  name=$(basename "$page" .md)
  if [ "$name" = index ]; then
    python3 benchmarks/integrations/table.py --results "$OUT" --doc "$page"
  else
    python3 benchmarks/integrations/table.py --results "$OUT" --doc "$page" --framework "$name"
  fi
done
