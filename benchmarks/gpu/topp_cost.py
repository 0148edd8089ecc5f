"""Cost per decode step of the mrv2_top_p patch: vLLM's `apply_top_k_top_p_triton` (the call MRv2's sampler makes
for top-k/top-p) from the installed module and from the patched kernel module, on the same logits, timed with
CUDA events. Writes one JSON.

    python benchmarks/gpu/topp_cost.py OUT.json [--vocab 131072] [--batches 1,8,64,256] [--iters 200]

Rows: fp32 logits (bf16-rounded randn * 2.5, a peaked head), top-p 0.9 on every row, with and without top-k 50 on
half the rows, min-p 0.05 on half the rows (logit-space masking, as MRv2 does before top-k/top-p). Per (batch,
case): the median and p90 of `--iters` timed calls after 20 warm-up calls, each on a fresh copy of the logits
(the copy is outside the timed region), for `off` (vLLM's module) and `on` (the patched one), interleaved in
blocks of 10 so clock drift hits both. Information, not a check: exit 0 unless the run fails.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT / "src", ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def rows(B: int, V: int, topk: bool, minp: bool, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, V, generator=g) * 2.5).to(torch.bfloat16).float()
    x[:, :8] += 6.0
    if minp:
        half = torch.arange(B) % 2 == 0
        thr = x.max(1, keepdim=True).values + math.log(0.05)
        x = torch.where(half[:, None] & (x < thr), torch.full_like(x, -math.inf), x)
    k = torch.where(torch.arange(B) % 2 == 0, 50, V).to(torch.int32) if topk else None
    p = torch.full((B,), 0.9)
    return x.cuda(), None if k is None else k.cuda(), p.cuda()


def time_calls(fn, x, k, p, iters: int) -> list[float]:
    import torch

    out = []
    for _ in range(iters):
        xc = x.clone()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(xc, k, p)
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) * 1000.0)  # microseconds
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--iters", type=int, default=100)
    a = ap.parse_args(argv)
    try:
        batches = [int(b) for b in a.batches.split(",")]
    except ValueError:
        print("error: --batches is a comma-separated list of integers", file=sys.stderr)
        return 2
    if a.vocab < 16 or a.iters < 10 or not batches or min(batches) < 1:
        print("error: --vocab >= 16, --iters >= 10, batches >= 1", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("error: needs a GPU (the kernels' cost on a GPU is what this measures)", file=sys.stderr)
        return 2
    import vllm
    from vllm.v1.sample.ops import topk_topp_triton as stock

    from vllm_rlpatch.patches import mrv2_top_p

    patched = mrv2_top_p._patched_module()
    patched.apply_top_k_top_p_triton  # loaded (and its source written) before timing

    def on(x, k, p):  # the patch's wrapper as vLLM calls it (the module lookup included)
        return mrv2_top_p._apply_wrapper(stock.apply_top_k_top_p_triton, None, (x, k, p), {})

    fns = {"off": stock.apply_top_k_top_p_triton, "on": on}
    res = []
    for B in batches:
        for topk in (False, True):
            for minp in (False, True):
                x, k, p = rows(B, a.vocab, topk, minp, B)
                for fn in fns.values():
                    time_calls(fn, x, k, p, 20)  # compile + warm
                t = {n: [] for n in fns}
                for _ in range(a.iters // 10):
                    for n, fn in fns.items():
                        t[n] += time_calls(fn, x, k, p, 10)
                same = torch.equal(torch.isfinite(fns["off"](x.clone(), k, p)), torch.isfinite(fns["on"](x.clone(), k, p)))
                r = {"batch": B, "top_k_half_rows": topk, "min_p_half_rows": minp, "same_kept_sets": same}
                for n in fns:
                    q = sorted(t[n])
                    r[f"{n}_median_us"] = round(statistics.median(q), 1)
                    r[f"{n}_p90_us"] = round(q[int(0.9 * (len(q) - 1))], 1)
                r["on_over_off"] = round(r["on_median_us"] / r["off_median_us"], 3)
                res.append(r)
                print(json.dumps(r), flush=True)
    out = {"check": "mrv2_top_p_cost", "vllm": vllm.__version__, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(), "vocab": a.vocab, "iters": a.iters, "top_p": 0.9, "results": res,
           "note": "apply_top_k_top_p_triton per call (one decode step's top-k/top-p), CUDA events, microseconds"}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
