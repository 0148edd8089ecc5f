#!/usr/bin/env bash
# Everything the air-gapped H200 (image: Python 3.12, torch 2.11.0+cu130, triton 3.6.0, NCCL 2.28.9,
# transformers 5.17.0; no vLLM) needs to run vLLM 0.32.0, as chunks of at most 48 MB, one per folder, so that
# each `run` call carries one folder (benchmarks/gpu/run_mrv2_gpu.sh says how):
#
#   bash benchmarks/gpu/make_site_0320.sh OUTDIR        -> OUTDIR/c00 .. OUTDIR/cNN
#
# (a) torch 2.13.0 + nvidia-nccl-cu13 2.32.6 + triton 3.7.1 wheel chunks, made by
#     ../shared/gpu/make_torch213_chunks.sh itself (measured on the H200: torch 2.13 imports, compiles and
#     all-reduces with them);
# (b) a vLLM site bundle (site0320.tgz) made the way ../shared/gpu/make_bundle.sh makes 0.25.1's: the vLLM
#     wheel and its requirements unpacked into one site folder, tarred and gzipped. The requirement list is
#     derived from the wheel's METADATA (benchmarks/gpu/bundle_reqs.py: resolved by pip for Linux x86_64
#     CPython 3.12, less what the image has or the torch chunks carry) and written next to the chunks. The
#     same removals as 0.25.1's: the FlashAttention-2 kernels (Hopper uses FA3), the vllm-rs binary, the C++
#     headers for JIT kernels, and a `ray` stub when ray is absent (vLLM's weight-transfer modules import it).
# c00 also holds SHA256 (every part), requirements.txt/.json (what the bundle carries and why the rest is left
# out) and MANIFEST. Prints the total size and the chunk count.
#
# VLLM_VERSION (default 0.32.0) picks another vLLM that pins torch 2.13 (0.28-0.32); the bundle is then
# site<digits>.tgz. RLPATCH_SHARED points at the shared folder (default: ../shared beside the checkout).
set -euo pipefail
OUT=${1:?usage: make_site_0320.sh OUTDIR}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TAG=$(printf '%s' "$VLLM_VERSION" | tr -cd '0-9')
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
SHARED=${RLPATCH_SHARED:-$ROOT/../shared}
PART=48000000
[ -x "$SHARED/gpu/make_torch213_chunks.sh" ] || [ -f "$SHARED/gpu/make_torch213_chunks.sh" ] \
  || { echo "no $SHARED/gpu/make_torch213_chunks.sh (set RLPATCH_SHARED)" >&2; exit 2; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/site$TAG.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
  PLAT+=(--platform "$p")
done
say() { echo "[make_site $(date +%H:%M:%S)] $*"; }

say "(a) torch 2.13.0 + nvidia-nccl-cu13 2.32.6 + triton 3.7.1 chunks (../shared/gpu/make_torch213_chunks.sh)"
bash "$SHARED/gpu/make_torch213_chunks.sh" "$WORK/torch" > "$WORK/torch.log"

say "(b) vLLM $VLLM_VERSION: the wheel, its requirements (derived from its METADATA), one site folder"
mkdir -p "$WORK/whl" "$WORK/site" "$WORK/meta"
python3 -m pip download -q --no-deps -d "$WORK/whl" "vllm==$VLLM_VERSION" "${PLAT[@]}" 2> >(grep -v "is ignored" >&2)
VWHL=$(ls "$WORK"/whl/vllm-"$VLLM_VERSION"-*.whl)
python3 "$HERE/bundle_reqs.py" "$VWHL" "$WORK/meta" > "$WORK/meta/derive.log"
head -1 "$WORK/meta/derive.log"
python3 - "$WORK/meta/requirements.json" <<'EOF'
import json, sys
direct = json.load(open(sys.argv[1]))["direct"]
pins = [r for r in direct if r.replace(" ", "").startswith("torch==")]
if pins != ["torch==2.13.0"]:
    sys.exit(f"this vLLM pins {pins or 'no torch'}; the torch chunks carry torch 2.13.0 (vLLM 0.28-0.32)")
EOF
python3 -m pip download -q --no-deps -d "$WORK/whl" -r "$WORK/meta/requirements.txt" "${PLAT[@]}" \
  2> >(grep -v "is ignored" >&2)
n_whl=$(ls "$WORK"/whl/*.whl | wc -l)
n_req=$(grep -c '^[^#]' "$WORK/meta/requirements.txt")
[ "$n_whl" -eq $((n_req + 1)) ] || { echo "downloaded $n_whl wheels for $n_req requirements + vllm" >&2; exit 1; }
for w in "$WORK"/whl/*.whl; do
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$WORK/site"
done
# the 0.25.1 bundle's removals (make_bundle.sh)
rm -rf "$WORK/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$WORK/site/vllm/vllm-rs" \
       "$WORK/site/vllm/third_party/fmha_sm100/cutlass" "$WORK/site/vllm/third_party/deep_gemm/include"
if [ ! -d "$WORK/site/ray" ]; then
  mkdir -p "$WORK/site/ray"
  printf 'def is_initialized():\n    return False\n' > "$WORK/site/ray/__init__.py"
fi
# the bundle's own record of what it is
cp "$WORK/meta/requirements.txt" "$WORK/site/rlpatch-bundle-requirements.txt"
site_mb=$(du -sm "$WORK/site" | cut -f1)
tar -C "$WORK/site" -cf - . | gzip -6 > "$WORK/site$TAG.tgz"
mkdir -p "$WORK/parts"
split -b "$PART" -d "$WORK/site$TAG.tgz" "$WORK/parts/site$TAG.tgz.part"

say "chunk folders: one part each"
mkdir -p "$OUT"
rm -rf "$OUT"/c[0-9][0-9]
parts=("$WORK"/torch/*.part?? "$WORK"/parts/*.part??)
i=0
for p in "${parts[@]}"; do
  d=$(printf '%s/c%02d' "$OUT" "$i")
  mkdir -p "$d"
  cp "$p" "$d/"
  i=$((i + 1))
done
(cd "$WORK/torch" && sha256sum -- *.part??; cd "$WORK/parts" && sha256sum -- *.part??) > "$OUT/c00/SHA256"
cp "$WORK/meta/requirements.txt" "$WORK/meta/requirements.json" "$OUT/c00/"
total=$(cat "${parts[@]}" | wc -c)
{
  echo "vllm $VLLM_VERSION site bundle site$TAG.tgz + torch 2.13.0 / nvidia-nccl-cu13 2.32.6 / triton 3.7.1 wheels"
  echo "made $(date -u +%FT%TZ) by benchmarks/gpu/make_site_0320.sh; $i chunks, $total bytes"
  echo "site folder: ${site_mb} MB unpacked, $n_req requirements + vllm"
  for p in "${parts[@]}"; do echo "$(basename "$p") $(stat -c %s "$p")"; done
} > "$OUT/c00/MANIFEST"
for d in "$OUT"/c[0-9][0-9]; do
  s=$(du -cb "$d"/* | tail -1 | cut -f1)
  [ "$s" -le $((50 * 1024 * 1024)) ] || { echo "$d holds $s bytes (over the 50 MiB a carry can spare)" >&2; exit 1; }
done
say "vLLM $VLLM_VERSION: site folder ${site_mb} MB unpacked, site$TAG.tgz $(stat -c %s "$WORK/site$TAG.tgz") bytes"
say "total $total bytes ($((total / 1000000)) MB) in $i chunks: $OUT/c00 .. $(printf 'c%02d' $((i - 1)))"
