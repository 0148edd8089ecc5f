"""The twin's Model Runner V2 rules against MRv2's own sampling kernels, run on the CPU by Triton's interpreter.

    TRITON_INTERPRET=1 python mrv2_twin_interp.py      -> prints one JSON line

MRv2 (vLLM >= 0.29, GPU only) processes logits in v1/worker/gpu/sample/sampler.py `apply_sampling_params`:
penalties -> temperature (gumbel.py `_temperature_kernel`) -> min-p in *logit* space (min_p.py `_min_p_kernel`)
-> top-k/top-p (`apply_top_k_top_p`). vLLM's own module imports Triton through `vllm.triton_utils`, which turns
Triton off on a CPU-only host, so the kernel sources are loaded from the installed vLLM and compiled against
Triton itself (`import triton`, interpreted). Top-k/top-p run vLLM's PyTorch implementation
(`apply_top_k_top_p_pytorch`): on a GPU MRv2 uses a Triton kernel (topk_topp_triton.py) that this does not run.

The logits are seeded, peaked, and built with exact ties and tokens close to min-p's threshold; the twin
(`processed_logprobs(..., engine="<vllm>/mrv2/cuda")`) must match MRv2's processed logprobs for sampled tokens,
with the engine's kept-set size on every row. (V1's min-p, `prob < max_prob * min_p`, is the same set up to
rounding: `v1_rules_differ_rows` counts the rows where the V1 rules give another answer, for information.)
"""

import importlib.util
import json
import os
import sys
import types

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"


def _load(relpath: str, name: str) -> types.ModuleType:
    spec = importlib.util.find_spec("vllm")
    path = os.path.join(os.path.dirname(spec.origin), relpath)
    src = open(path).read()
    assert "from vllm.triton_utils import tl, triton" in src, path
    src = src.replace("from vllm.triton_utils import tl, triton",
                      "import triton\nimport triton.language as tl")
    mod = types.ModuleType(name)
    mod.__file__ = path
    sys.modules[name] = mod  # triton.jit reads the function's module globals
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod


def main():
    import torch
    import vllm

    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
    from vllm_rlpatch.trainer import processed_logprobs

    gumbel = _load("v1/worker/gpu/sample/gumbel.py", "_mrv2_gumbel")
    min_p_mod = _load("v1/worker/gpu/sample/min_p.py", "_mrv2_min_p")

    g = torch.Generator().manual_seed(0)
    V = 1000
    settings = [(t, p, k, m) for t in (0.6, 1.0, 1.3) for p in (1.0, 0.9, 0.5) for k in (0, 20) for m in (0.0, 0.05)]
    R = len(settings)
    base = torch.randn(R, V, generator=g) * 3.0
    base[:, :8] += 6.0  # peaked
    base[:, 100:104] = base[:, 100:101]  # an exact tie group
    logits = base.clone()
    # tokens right at min-p's logit-space threshold (max + log(min_p), times T), one on each side
    for i, (t, p, k, m) in enumerate(settings):
        if m > 0:
            thr = (logits[i].max() / t + torch.log(torch.tensor(m))) * t
            logits[i, 200] = thr + 1e-3
            logits[i, 201] = thr - 1e-3
            logits[i, 202] = thr + 1e-6 * thr.abs()  # within rounding of the threshold
            logits[i, 203] = thr - 1e-6 * thr.abs()

    temp = torch.tensor([s[0] for s in settings], dtype=torch.float32)
    top_p = torch.tensor([s[1] for s in settings], dtype=torch.float32)
    top_k = torch.tensor([s[2] if s[2] > 0 else V for s in settings], dtype=torch.int64)
    min_p = torch.tensor([s[3] for s in settings], dtype=torch.float32)
    idx = torch.arange(R, dtype=torch.int32)

    # MRv2, as apply_sampling_params does it: fp32 copy, temperature, min-p (in place), then top-k/top-p
    x = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
    gumbel.apply_temperature(x, idx, temp)
    min_p_mod.apply_min_p(x, idx, min_p)
    x = apply_top_k_top_p_pytorch(x, top_k, top_p, allow_cpu_sync=True)
    engine_lp = torch.log_softmax(x, dim=-1)
    kept_engine = torch.isfinite(x).sum(-1)

    # sampled tokens: every kept token of each row (all of the kept set, the boundary tokens included)
    n_tok, max_err, outside, rows_checked = 0, 0.0, 0, 0
    sps = [{"temperature": t, "top_p": p, "top_k": k, "min_p": m} for t, p, k, m in settings]
    differs_from_v1 = 0
    for i in range(R):
        toks = torch.nonzero(torch.isfinite(x[i])).flatten()
        L = int(toks.numel())
        lg = logits[i].expand(L, V).contiguous().unsqueeze(0)
        lp, det = processed_logprobs(lg, toks.unsqueeze(0), [sps[i]], engine=f"{vllm.__version__}/mrv2/cuda",
                                     return_details=True)
        err = (lp[0] - engine_lp[i, toks]).abs().max().item()
        max_err = max(max_err, err)
        outside += int(det["outside_support"].sum()) + int(det["at_boundary"].sum())
        assert int(det["kept_count"][0, 0]) == int(kept_engine[i]), (settings[i], det["kept_count"][0, 0],
                                                                    kept_engine[i])
        lp1 = processed_logprobs(lg, toks.unsqueeze(0), [sps[i]], engine=f"{vllm.__version__}/v1/cpu")
        if (lp1[0] - engine_lp[i, toks]).abs().max().item() > 1e-4:
            differs_from_v1 += 1
        n_tok += L
        rows_checked += 1
    print(json.dumps({"vllm": vllm.__version__, "rows": rows_checked, "tokens": n_tok, "max_abs_err": max_err,
                      "twin_outside_or_boundary": outside, "v1_rules_differ_rows": differs_from_v1,
                      "min_p_rows": sum(1 for s in settings if s[3] > 0)}))


if __name__ == "__main__":
    main()
