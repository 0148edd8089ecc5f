#!/usr/bin/env bash
# The test command (README): run the suite against real vLLM, once per supported version.
#
#   ci/test.sh                      # vLLM 0.20.2, 0.25.1 and 0.32.0 (CPU builds), then the source-level check
#   ci/test.sh 0.32.0               # one version
#   ci/test.sh 0.25.1 -- -k engine  # extra pytest arguments after --
#   ci/test.sh --quick              # the engine-free tests (pytest marker `quick`: docs, wording, registry, contract,
#                                   # trainer, source level, ...) in one pytest process, on 0.32.0 unless a version is given
#   RLPATCH_TEST_LANES=1 ci/test.sh # one test file at a time (default: 2 concurrent pytest processes)
#
# Each version's environment is built once and cached outside the repo (ci/envs/build_env.sh). Prints the
# environment-build and test time per version; exits non-zero if any version fails.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
versions=()
quick=0
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; break ;;
    --quick) quick=1; shift ;;
    -*) echo "ci/test.sh: unknown option $1 (versions, --quick, then -- and pytest arguments)" >&2; exit 2 ;;
    *) versions+=("$1"); shift ;;
  esac
done
if [ ${#versions[@]} -eq 0 ]; then
  if [ "$quick" -eq 1 ]; then versions=(0.32.0); else versions=(0.20.2 0.25.1 0.32.0); fi
fi
LANES="${RLPATCH_TEST_LANES:-2}"
extra=("$@")
declare -a summary
status=0
# Hosts differ (issue: tests must not depend on the CPU kind): say which kind this is, from the CPU flags.
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  echo "=== host CPU: AMX (amx_tile in /proc/cpuinfo); $(nproc) cores"
else
  echo "=== host CPU: no AMX (no amx_tile in /proc/cpuinfo); $(nproc) cores"
fi
last_py=""
for v in "${versions[@]}"; do
  echo "=== vLLM $v: environment"
  t0=$(date +%s)
  if ! py=$(bash ci/envs/build_env.sh "$v" | tail -n 1) || [ ! -x "$py" ]; then
    echo "!!! vLLM $v: environment build failed"; summary+=("$v: ENV BUILD FAILED"); status=1; continue
  fi
  t1=$(date +%s)
  if [ "$quick" -eq 1 ]; then
    echo "=== vLLM $v: quick tests, -m quick ($py)"
    "$py" -m pytest tests -m quick -p no:cacheprovider -q -rs --timeout=600 "${extra[@]}"
    rc=$?
    [ $rc -eq 0 ] || status=1
    summary+=("$v: env $((t1 - t0))s, quick tests $(( $(date +%s) - t1 ))s, pytest exit $rc")
    continue
  fi
  echo "=== vLLM $v: tests ($py)"
  # Test files run in $LANES concurrent pytest processes (ci/shards.py says why); the port-race file alone.
  "$py" ci/shards.py --lanes "$LANES" --alone tests/test_port_races.py --ignore tests/source_level tests \
    -- -p no:cacheprovider -q -rs --timeout=1200 "${extra[@]}"
  rc=$?
  t2=$(date +%s)
  [ $rc -eq 0 ] || status=1
  summary+=("$v: env $((t1 - t0))s, tests $((t2 - t1))s, pytest exit $rc")
  last_py="$py"
done
if [ "$quick" -eq 0 ] && [ ${#extra[@]} -eq 0 ] && [ -n "$last_py" ]; then
  echo "=== source level: targets in the newest vLLM release, upstream diffs on their pristine bases"
  t0=$(date +%s)
  "$last_py" -m pytest tests/source_level -p no:cacheprovider -q -rs --timeout=1200
  rc=$?
  [ $rc -eq 0 ] || status=1
  summary+=("source-level: $(( $(date +%s) - t0 ))s, pytest exit $rc")
fi
echo "=== summary"
printf '  %s\n' "${summary[@]}"
exit $status
