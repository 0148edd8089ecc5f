"""The refit's check kernels on a GPU, without vLLM: which launch configuration reaches memory bandwidth.

    PYTHONPATH=src python benchmarks/gpu/check_kernels.py OUT.json [--shape 8b]

Trainer tensors of a Llama shape (random bf16), destinations laid out like vLLM's fused parameters (q/k/v
windows in one qkv tensor, gate/up in one gate_up). Timed, median of 5 after a warm-up, every one checked
against the production digests:
- the digest kernel (finite count + checksum) over every source, for each (blocks per program, warps);
- the fused copy-and-check kernel for each read-back mode (see ``checks.copy_check_kernel``), blocks per
  program and warps;
- references: one device copy of all the bytes, the per-tensor copies, copies followed by a digest pass.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from vllm_rlpatch.refit import checks

SHAPES = {"8b": dict(h=4096, kv=1024, ffn=14336, layers=32, vocab=128256),
          "1b": dict(h=2048, kv=512, ffn=8192, layers=16, vocab=128256)}


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    xs = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    args = ap.parse_args()
    c = SHAPES[args.shape]
    h, kv, ffn = c["h"], c["kv"], c["ffn"]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    srcs, dsts = [], []

    def pair(shape, dst=None):
        t = torch.randn(shape, device=dev, generator=g, dtype=torch.float32).to(torch.bfloat16)
        srcs.append(t)
        dsts.append(dst if dst is not None else torch.empty_like(t))

    pair((c["vocab"], h))
    for _ in range(c["layers"]):
        qkv = torch.empty((h + 2 * kv, h), device=dev, dtype=torch.bfloat16)
        pair((h, h), qkv[:h])
        pair((kv, h), qkv[h:h + kv])
        pair((kv, h), qkv[h + kv:])
        pair((h, h))
        gu = torch.empty((2 * ffn, h), device=dev, dtype=torch.bfloat16)
        pair((ffn, h), gu[:ffn])
        pair((ffn, h), gu[ffn:])
        pair((h, ffn))
        pair((h,))
        pair((h,))
    pair((h,))
    pair((c["vocab"], h))
    nbytes = sum(t.numel() * t.element_size() for t in srcs)
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "shape": args.shape,
           "tensors": len(srcs), "gb": nbytes / 1e9}
    print(f"[kernels] {res['gpu']}: {len(srcs)} tensors, {nbytes / 1e9:.2f} GB", flush=True)
    want = [d.key for d in checks.digests(srcs)]
    flat_a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    flat_b = torch.empty_like(flat_a)
    res["copy_flat_ms"] = timed(lambda: flat_b.copy_(flat_a))
    del flat_a, flat_b
    torch.cuda.empty_cache()

    def copies():
        for d, s in zip(dsts, srcs):
            d.copy_(s, non_blocking=True)

    res["copy_per_tensor_ms"] = timed(copies)
    res["copy_then_digest_ms"] = timed(lambda: (copies(), checks.digests(dsts)))
    res["torch_int32_block_sums_ms"] = timed(lambda: [s.view(torch.int32).sum(dtype=torch.int32) for s in srcs])

    kern = checks._kernel()
    nw = tuple(t.numel() * t.element_size() // 4 for t in srcs)
    sp = torch.tensor([t.data_ptr() for t in srcs], dtype=torch.int64, device=dev)
    dp = torch.tensor([t.data_ptr() for t in dsts], dtype=torch.int64, device=dev)
    nwt = torch.tensor(nw, dtype=torch.int64, device=dev)
    digest_rows = []
    for group in (1, 2, 4, 8):
        ti, bi = checks._worklist(nw, dev, group)
        for warps in (4, 8, 16):
            acc = torch.zeros(len(srcs) * 3, dtype=torch.int32, device=dev)

            def run():
                acc.zero_()
                kern[(ti.numel(),)](sp, nwt, ti, bi, acc, MODE=1, MASK=0x7F80, BLOCK=checks.BLOCK_WORDS, GROUP=group,
                                    num_warps=warps)

            ms = timed(run)
            rows = acc.view(-1, 3).tolist()
            ok = [f"{s & 0xFFFFFFFF:08x}{p & 0xFFFFFFFF:08x}:{n}" for (s, p, _), n in
                  zip(rows, [t.numel() * 2 for t in srcs])] == want
            digest_rows.append({"group": group, "warps": warps, "ms": ms, "equal": ok})
            print(f"[kernels] digest group {group} warps {warps}: {ms:.2f} ms equal={ok}", flush=True)
    res["digest"] = digest_rows
    ck = checks._copy_kernel()
    cc_rows = []
    for readback in (0, 1, 2, 3):
        for group in (1, 2, 4):
            ti, bi = checks._worklist(nw, dev, group)
            for warps in (4, 8, 16):
                acc = torch.zeros(len(srcs) * 2, dtype=torch.int32, device=dev)

                def run():
                    acc.zero_()
                    ck[(ti.numel(),)](sp, dp, nwt, ti, bi, acc, BLOCK=checks.BLOCK_WORDS, GROUP=group,
                                      READBACK=readback, num_warps=warps)

                for d in dsts:
                    d.zero_()
                ms = timed(run)
                rows = acc.view(-1, 2).tolist()
                ok = [f"{s & 0xFFFFFFFF:08x}{p & 0xFFFFFFFF:08x}" for s, p in rows] == [w.split(":")[0] for w in want]
                copied = all(torch.equal(d, s) for d, s in zip(dsts, srcs))
                cc_rows.append({"readback": readback, "group": group, "warps": warps, "ms": ms, "equal": ok,
                                "copied": copied})
                print(f"[kernels] copy-check readback {readback} group {group} warps {warps}: {ms:.2f} ms "
                      f"equal={ok} copied={copied}", flush=True)
    res["copy_check"] = cc_rows
    best_d = min((r for r in digest_rows if r["equal"]), key=lambda r: r["ms"], default=None)
    best_c = {rb: min((r for r in cc_rows if r["equal"] and r["copied"] and r["readback"] == rb),
                      key=lambda r: r["ms"], default=None) for rb in (0, 1, 2, 3)}
    res["best"] = {"digest": best_d, "copy_check": best_c}
    print(json.dumps(res["best"], indent=1), flush=True)
    print(json.dumps({k: v for k, v in res.items() if k.endswith("_ms")}), flush=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
