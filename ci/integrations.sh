#!/usr/bin/env bash
# Outside CI: each framework's own weight sync against real vLLM (CPU), plugin off and on, with its adapter;
# JSON per framework under benchmarks/results/integrations/, then the trainer pages' table
# (docs/trainers/index.md, between its integrations-table markers).
#
#   bash ci/integrations.sh [framework ...]      # default: every framework with a benchmark script
#
# Each framework runs in a copy of the test environment of its pinned vLLM (tests/support/frameworks.py builds
# and caches it from ci/envs/integrations/<framework>.txt); the base environments come from ci/envs/build_env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/integrations
mkdir -p "$OUT"
fws=("$@")
if [ ${#fws[@]} -eq 0 ]; then
  for f in benchmarks/integrations/*.py; do
    n=$(basename "$f" .py); [ "$n" = table ] || fws+=("$n")
  done
fi
for fw in "${fws[@]}"; do
  reqs=ci/envs/integrations/$fw.txt
  [ -f "$reqs" ] || { echo "integrations.sh: no $reqs" >&2; exit 2; }
  ver=$(sed -n 's/^# vllm: *//p' "$reqs" | head -1)
  base=$(ls -d "${VLLM_RLPATCH_ENV_CACHE:-$HOME/.cache/vllm-rlpatch/envs}"/vllm-"$ver"-*/bin/python 2>/dev/null | head -1)
  [ -n "$base" ] || { echo "integrations.sh: no vLLM $ver environment (bash ci/envs/build_env.sh $ver)" >&2; exit 2; }
  py=$(PYTHONPATH=tests "$base" -c "from support.frameworks import framework_python; print(framework_python('$fw'))")
  echo "== $fw (vLLM $ver): $py"
  PYTHONPATH=src:tests "$py" "benchmarks/integrations/$fw.py" --out "$OUT"
done
python3 benchmarks/integrations/table.py --results "$OUT" --doc docs/trainers/index.md
