"""vLLM's Triton top-k/top-p kernel (v1/sample/ops/topk_topp_triton.py) against the nominal top-p, unpatched and
with the mrv2_top_p patch's two edits, run by Triton's interpreter on the CPU or by Triton on a GPU.

    TRITON_INTERPRET=1 python mrv2_top_p_interp.py [--which unpatched|patched|both] [--random N] [--vocab V]
        [--rows FILE.pt] [--gpu-blocks]                                     -> prints one JSON line

The kernel is launched directly with the launch constants the GPU uses (BLOCK_SIZE 8192 / BLOCK_SIZE_TRUNC 4096;
`--cpu-blocks` gives the 256/128 vLLM picks for a CPU tensor, which changes the zeroth pass's sample block and
with it the search path). The reference is vLLM's PyTorch implementation (`apply_top_k_top_p_pytorch`: sort,
cumulative sum): the kept set must be the same set of tokens on every row.

Rows: `constructed` (2-5 finite tokens, as min-p leaves them, with top-p < the mass of all but the smallest:
the nominal set is every finite token; placed at the start, the middle and the end of the vocabulary; with and
without top-k); `--random N` random rows (bf16-rounded logits, exact ties, a `--vocab` vocabulary, 0-5 tokens
masked by min-p); `--rows FILE.pt` rows captured from an engine ({"logits": [R, V] fp32 after temperature and
min-p, "k": [R] int, "p": [R] float}). Exit status 0 when the patched kernel (if run) keeps the nominal set on
every constructed and captured row and the unpatched one (if run) misses on at least one constructed row; 1
otherwise; 2 on bad arguments. The random rows (and, with `--api`, the
constructed rows in a batch small enough for vLLM's split-row pipeline) are reported, not judged: they also show differences the patch
does not address (top-k then top-p with ties at the top-k boundary; the boundary tie group's trim count from
fp32 sums in another order).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


INFO = ("random", "constructed_split")  # reported, not judged


def kernel_module(patched: bool):
    from vllm_rlpatch.patches import mrv2_top_p

    with open(mrv2_top_p.kernel_source_path(), encoding="utf-8") as fh:
        src = fh.read()
    if patched:
        src = mrv2_top_p.patched_source(src)
    if os.environ.get("TRITON_INTERPRET") == "1":
        # vllm.triton_utils turns Triton off on a host without a GPU backend; the interpreter's tl.range yields
        # Python ints (no .to)
        src = src.replace("from vllm.triton_utils import tl, triton", "import triton\nimport triton.language as tl")
        src = src.replace("row_id.to(tl.int64) * LOGITS_STRIDE_0", "tl.full((), row_id, tl.int64) * LOGITS_STRIDE_0")
    return mrv2_top_p.load_kernels(src, "interp_" + ("patched" if patched else "unpatched"))


def run_kernel(q, x, k, p, gpu_blocks: bool = True):
    """One launch of _topk_topp_kernel (one program per row), in place on x."""
    n, V = x.shape
    bs, bst = (8192, 4096) if gpu_blocks else (256, 128)
    buf = x.new_empty((n, V))
    q._topk_topp_kernel[(n,)](
        x, x.stride(0), buf, x.new_tensor(q._PERCENTILE_TO_STD_TABLE), x.new_tensor(q._NORMAL_CDF_TO_SIGMA_TABLE),
        k if k is not None else x, p, n, VOCAB_SIZE=V, MASK_VALUE=float("-inf"), BLOCK_SIZE=bs,
        BLOCK_SIZE_TRUNC=bst, TOPK_ENABLED=k is not None, TOPP_ENABLED=True, SPLIT_COVERS_PONLY=False)
    return x


def constructed(V: int):
    """Rows a min-p leaves with 2-5 finite tokens whose nominal top-p set is all of them."""
    import torch

    rows, ps = [], []
    for n_fin in (2, 3, 4, 5):
        for start in (5, V // 2, V - 8):
            x = torch.full((V,), float("-inf"))
            vals = torch.linspace(2.0, 2.0 - 0.35 * (n_fin - 1), n_fin)
            x[start:start + n_fin] = vals
            pr = torch.softmax(vals, 0)
            rows.append(x)
            ps.append(float((1.0 - pr[-1]) + pr[-1] / 2))  # between the mass without the smallest and 1
    return torch.stack(rows), torch.tensor(ps)


def randomized(R: int, V: int, seed: int):
    """bf16-rounded logits with exact ties, then temperature and MRv2's logit-space min-p."""
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, V, generator=g) * 2.5).to(torch.bfloat16).float()  # bf16 values: many exact ties
    x[:, :6] += 7.0
    x[:, 10:14] = x[:, 10:11]  # an exact tie group
    temp = torch.tensor([0.6, 1.0, 1.3])[torch.randint(0, 3, (R,), generator=g)]
    x = x / temp[:, None]
    min_p = torch.tensor([0.0, 0.05, 0.2])[torch.randint(0, 3, (R,), generator=g)]
    thr = x.max(1, keepdim=True).values + torch.log(min_p.clamp_min(1e-30))[:, None]
    x = torch.where((min_p[:, None] > 0) & (x < thr), torch.full_like(x, -math.inf), x)
    p = torch.tensor([0.5, 0.8, 0.9, 0.95, 0.99])[torch.randint(0, 5, (R,), generator=g)]
    k = torch.tensor([V, V, 20, 50])[torch.randint(0, 4, (R,), generator=g)].to(torch.int32)
    return x, k, p


def compare(q, x, k, p, device, gpu_blocks, api=False):
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    ref = torch.isfinite(apply_top_k_top_p_pytorch(x.clone(), None if k is None else k.long(), p.clone(),
                                                   allow_cpu_sync=True))
    t0 = time.monotonic()
    xd, kd, pd = x.clone().to(device), None if k is None else k.to(device), p.to(device)
    got = torch.isfinite(q.apply_top_k_top_p_triton(xd, kd, pd) if api else run_kernel(q, xd, kd, pd, gpu_blocks)).cpu()
    dt = time.monotonic() - t0
    diff = (got.sum(1) - ref.sum(1)).tolist()
    # the same kept values (a tie group cut at the boundary may keep other indices of equal values: torch's sort
    # order of equal values is not the kernel's index order)
    bad = [i for i in range(x.shape[0]) if not torch.equal(x[i][got[i]].sort().values, x[i][ref[i]].sort().values)]
    return {"rows": x.shape[0], "rows_differ": len(bad), "kept_minus_nominal": dict(sorted(
        __import__("collections").Counter(diff).items())), "first_bad": bad[:8], "seconds": round(dt, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--which", choices=("unpatched", "patched", "both"), default="both")
    ap.add_argument("--random", type=int, default=0, help="random rows against the sort reference (default 0)")
    ap.add_argument("--vocab", type=int, default=1000, help="vocabulary of the rows (default 1000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", help="captured rows (torch.save of {logits, k, p})")
    ap.add_argument("--cpu-blocks", action="store_true", help="the launch constants vLLM uses for a CPU tensor")
    ap.add_argument("--api", action="store_true",
                    help="call the module's apply_top_k_top_p_triton (vLLM's dispatch: split pipeline, launch "
                         "constants) instead of one direct launch (GPU only)")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when Triton has a GPU)")
    a = ap.parse_args(argv)
    if a.vocab < 16 or a.random < 0:
        print("error: --vocab must be >= 16 and --random >= 0", file=sys.stderr)
        return 2
    if a.rows and not os.path.exists(a.rows):
        print(f"error: no such file: {a.rows}", file=sys.stderr)
        return 2
    import torch
    import vllm

    device = a.device or ("cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()
                          else "cuda")
    if a.api and device == "cpu":
        print("error: --api needs a GPU (vLLM dispatches CPU tensors to other launch constants)", file=sys.stderr)
        return 2
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("error: on the CPU run with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    gpu_blocks = not a.cpu_blocks
    sets = {"constructed": (*constructed(a.vocab), None)}
    cx, cp, _ = sets["constructed"]
    sets["constructed"] = (cx, None, cp)
    if a.api:
        # vLLM sends p-only batches of <= 64 rows to its split-row pipeline (correct here): reported apart; the
        # constructed rows are repeated past that batch size to reach the monolithic kernel
        sets["constructed_split"] = (cx, None, cp)
        reps = 96 // cx.shape[0]
        cx, cp = cx.repeat(reps, 1), cp.repeat(reps)
        sets["constructed"] = (cx, None, cp)
    sets["constructed_topk"] = (cx, torch.full((cx.shape[0],), 20, dtype=torch.int32), cp)
    if a.random:
        sets["random"] = randomized(a.random, a.vocab, a.seed)
    if a.rows:
        d = torch.load(a.rows)
        sets["captured"] = (d["logits"].float(), d["k"].to(torch.int32), d["p"].float())
    out = {"vllm": vllm.__version__, "device": "cpu (Triton interpreter)" if device == "cpu" else
           torch.cuda.get_device_name(), "launch": "gpu blocks 8192/4096" if gpu_blocks else "cpu blocks 256/128",
           "vocab": a.vocab, "api": a.api}
    which = ("unpatched", "patched") if a.which == "both" else (a.which,)
    for w in which:
        q = kernel_module(w == "patched")
        out[w] = {name: compare(q, x, k, p, device, gpu_blocks, a.api) for name, (x, k, p) in sets.items()}
    ok = True
    if "patched" in out:  # the random rows are information: the kernel's top-k/tie handling is not this fix's
        ok &= all(r["rows_differ"] == 0 for name, r in out["patched"].items() if name not in INFO)
    if "unpatched" in out:
        out["unpatched_reproduces"] = out["unpatched"]["constructed"]["rows_differ"] > 0
        ok &= out["unpatched_reproduces"]
    out["ok"] = ok
    print(json.dumps(out))
    if a.out:
        with open(a.out, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
