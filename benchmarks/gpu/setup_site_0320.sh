#!/usr/bin/env bash
# On the GPU host (air-gapped; image: Python 3.12, torch 2.11.0+cu130, triton 3.6.0, NCCL 2.28.9, transformers;
# no vLLM), after the chunks of benchmarks/gpu/make_site_0320.sh were carried into CHUNK_DIR (flat: every
# c*/ folder's files in one folder): one site folder with torch 2.13.0, NCCL 2.32.6, triton 3.7.1, vLLM 0.32.0
# and this checkout's vllm-rlpatch, installed the way pip would (the package, its dist-info with the
# vllm.general_plugins entry point, the start-up .pth hook, activated through a sitecustomize that makes SITE
# a site dir; as benchmarks/gpu/setup_site.sh does for 0.25.1).
#
#   bash benchmarks/gpu/setup_site_0320.sh CHUNK_DIR [SITE]          (SITE default /tmp/site0320)
#   export PYTHONPATH=SITE LD_LIBRARY_PATH=SITE/nvidia/nccl/lib VLLM_USE_FLASHINFER_SAMPLER=0
#
# The wheels go in with `pip install --no-deps --no-index --no-compile --target SITE` (as measured with
# ../shared/gpu/make_torch213_chunks.sh); the vLLM bundle (site<digits>.tgz) is unpacked into the same SITE.
# Unpacking happens once per SITE; the plugin is reinstalled every time. Ends with an import check (torch,
# vllm, vllm_rlpatch, versions, the entry point) and a check of vLLM's requirements against what is
# importable there (mismatches are printed, not fatal: the image's packages are used where the bundle has none).
# PYTHON (default python3) is the interpreter the image runs.
set -euo pipefail
CHUNKS=${1:?usage: setup_site_0320.sh CHUNK_DIR [SITE]}
SITE=${2:-${SITE:-/tmp/site0320}}
PY=${PYTHON:-python3}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$ROOT/benchmarks/gpu/site_lib.sh"
CHUNKS=$(cd "$CHUNKS" && pwd)
say() { echo "[setup_site $(date +%H:%M:%S)] $*"; }

if [ ! -f "$SITE/.rlpatch-site-complete" ]; then
  [ -f "$CHUNKS/SHA256" ] || { echo "no $CHUNKS/SHA256 (carry c00 too)" >&2; exit 1; }
  missing=$(cd "$CHUNKS" && awk '{print $2}' SHA256 | while read -r f; do [ -f "$f" ] || echo "$f"; done)
  [ -z "$missing" ] || { echo "chunks missing in $CHUNKS:" $missing >&2; exit 1; }
  say "checking $(wc -l < "$CHUNKS/SHA256") chunks"
  (cd "$CHUNKS" && sha256sum -c --quiet SHA256)
  rm -rf "$SITE"
  mkdir -p "$SITE"
  W=$(mktemp -d)
  trap 'rm -rf "$W"' EXIT
  for name in $(cd "$CHUNKS" && ls -- *.whl.part?? | sed 's/\.part[0-9][0-9]$//' | sort -u); do
    cat_parts "$CHUNKS" "$name" > "$W/$name"
  done
  say "pip install --no-deps --no-index --no-compile --target $SITE: $(cd "$W" && ls -- *.whl | tr '\n' ' ')"
  "$PY" -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --target "$SITE" "$W"/*.whl
  rm -rf "$W"
  bundle=$(cd "$CHUNKS" && ls -- site*.tgz.part00 | sed 's/\.part00$//')
  say "unpacking $bundle into $SITE"
  unpack_bundle "$CHUNKS" "$bundle" "$SITE"
  touch "$SITE/.rlpatch-site-complete"
fi

say "installing this checkout's vllm-rlpatch into $SITE"
install_rlpatch "$ROOT" "$SITE" "$PY"

say "import check"
PYTHONPATH=$SITE LD_LIBRARY_PATH=$SITE/nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$PY" - "$SITE" <<'EOF'
import sys
site = sys.argv[1]
import torch, vllm, vllm_rlpatch  # noqa: E401
import vllm_rlpatch.plugin  # what vLLM loads (its dependencies: wrapt, packaging, pyzmq)
from importlib.metadata import entry_points, requires, version
from packaging.requirements import Requirement

assert torch.__file__.startswith(site), f"torch comes from {torch.__file__}, not {site}"
assert vllm.__file__.startswith(site), f"vllm comes from {vllm.__file__}, not {site}"
import triton
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "(no GPU here)"
ep = [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "rlpatch"]
print(f"torch {torch.__version__} (cuda {torch.version.cuda}, nccl {nccl}), triton {triton.__version__}, "
      f"vllm {vllm.__version__}, vllm_rlpatch {vllm_rlpatch.__version__}, entry point {ep}")
assert ep == ["vllm_rlpatch.plugin:register"], ep
env = {"python_version": "3.12", "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
       "extra": ""}
bad = []
for r in map(Requirement, requires("vllm") or []):
    if r.marker is not None and not r.marker.evaluate(env):
        continue
    try:
        have = version(r.name)
    except Exception:  # noqa: BLE001
        have = None
    if have is None or (r.specifier and not r.specifier.contains(have, prereleases=True)):
        bad.append(f"{r.name}{r.specifier or ''} (here: {have or 'absent'})")
print(f"vLLM's requirements not met here ({len(bad)}; the bundle leaves optional CUDA kernel packages out):")
for b in bad:
    print("  " + b)
EOF
echo "export PYTHONPATH=$SITE LD_LIBRARY_PATH=$SITE/nvidia/nccl/lib VLLM_USE_FLASHINFER_SAMPLER=0"
