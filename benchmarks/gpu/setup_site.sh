#!/usr/bin/env bash
# On the GPU host (air-gapped; image: Python 3.12, torch, transformers, no vLLM): unpack the vLLM bundle
# carried in chunks (../shared/gpu/make_bundle.sh) to /tmp/site and install this checkout's vllm-rlpatch
# there the way pip would: the package, its dist-info with the vllm.general_plugins entry point, and the
# start-up .pth hook (activated through a sitecustomize that makes /tmp/site a site dir).
#   bash benchmarks/gpu/setup_site.sh CHUNK_DIR      then: export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0
set -euo pipefail
CHUNKS=${1:?usage: setup_site.sh CHUNK_DIR}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SITE=/tmp/site
if [ ! -f "$SITE/vllm/__init__.py" ]; then
  mkdir -p "$SITE"
  (cd "$CHUNKS" && sha256sum -c SHA256 >/dev/null)
  cat "$CHUNKS"/site0251.tgz.part* | tar -C "$SITE" -xzf -
fi
rm -rf "$SITE/vllm_rlpatch" "$SITE"/vllm_rlpatch-*.dist-info
cp -r "$ROOT/src/vllm_rlpatch" "$SITE/"
cp "$ROOT/src/vllm_rlpatch_startup.pth" "$SITE/"
VER=$(python3 -c "import re;print(re.search(r'__version__ = \"([^\"]+)\"', open('$ROOT/src/vllm_rlpatch/__init__.py').read()).group(1))")
D="$SITE/vllm_rlpatch-$VER.dist-info"
mkdir -p "$D"
printf 'Metadata-Version: 2.1\nName: vllm-rlpatch\nVersion: %s\n' "$VER" > "$D/METADATA"
printf '[vllm.general_plugins]\nrlpatch = vllm_rlpatch.plugin:register\n\n[console_scripts]\nvllm-rlpatch = vllm_rlpatch.tools.cli:main\n' > "$D/entry_points.txt"
: > "$D/RECORD"
printf 'import site\nsite.addsitedir("%s")\n' "$SITE" > "$SITE/sitecustomize.py"
PYTHONPATH=$SITE python3 -c "import vllm, vllm_rlpatch; from importlib.metadata import entry_points; print('vllm', vllm.__version__, 'rlpatch', vllm_rlpatch.__version__, [e.value for e in entry_points(group='vllm.general_plugins') if e.name=='rlpatch'])"
