#!/usr/bin/env bash
# On the GPU host (air-gapped; image: Python 3.12, torch, transformers, no vLLM): unpack the vLLM bundle
# carried in chunks (../shared/gpu/make_bundle.sh) to /tmp/site and install this checkout's vllm-rlpatch
# there the way pip would: the package, its dist-info with the vllm.general_plugins entry point, and the
# start-up .pth hook (activated through a sitecustomize that makes /tmp/site a site dir).
#   bash benchmarks/gpu/setup_site.sh CHUNK_DIR      then: export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0
set -euo pipefail
CHUNKS=${1:?usage: setup_site.sh CHUNK_DIR}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$ROOT/benchmarks/gpu/site_lib.sh"
SITE=/tmp/site
if [ ! -f "$SITE/vllm/__init__.py" ]; then
  mkdir -p "$SITE"
  (cd "$CHUNKS" && sha256sum -c SHA256 >/dev/null)
  unpack_bundle "$CHUNKS" site0251.tgz "$SITE"
fi
install_rlpatch "$ROOT" "$SITE" python3
PYTHONPATH=$SITE python3 -c "import vllm, vllm_rlpatch; from importlib.metadata import entry_points; print('vllm', vllm.__version__, 'rlpatch', vllm_rlpatch.__version__, [e.value for e in entry_points(group='vllm.general_plugins') if e.name=='rlpatch'])"
