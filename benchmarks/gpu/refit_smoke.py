"""Refit correctness on a GPU (vLLM 0.25.1 from the offline bundle): the CUDA-IPC paths and quantized heads.

    python benchmarks/gpu/refit_smoke.py OUT.json

1. llama-tiny (bf16) on the GPU: the first complete update goes through vLLM's layerwise reload and records
   the copy plan; the next ones are plan copies (cuda_ipc, direct and atomic), then a zero-pack update
   (EngineLayout). Greedy outputs after each are compared with a float32 transformers reference of the
   pushed weights, and a bad update (NaN) must leave the fingerprint unchanged.
2. The same model with online fp8 quantization (quantization="fp8"): a refit must work (outputs follow the
   new weights within fp8 tolerance) or fail with a clear error.
Writes one JSON with every figure; asserts nothing (the figures are read and committed).
"""

import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))

PROMPTS = ["the quick cat sees", "12 + 7 =", "count: 3 4 5", "the small model updates the"]


def greedy(llm, vllm):
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=16, logprobs=0)
    out = []
    for o in llm.generate(PROMPTS, sp, use_tqdm=False):
        c = o.outputs[0]
        lps = [s[t].logprob for t, s in zip(c.token_ids, c.logprobs)]
        out.append({"prompt": list(o.prompt_token_ids), "tokens": list(c.token_ids),
                    "logprobs": [x if math.isfinite(x) else -1e30 for x in lps],
                    "spans": [list(s) for s in getattr(c, "rlpatch_weight_versions", None) or []]})
    return out


def vs_reference(outs, weights_dir):
    from support import reference as R

    model = R.load(weights_dir)
    got, ref = [], []
    for q in outs:
        got += q["logprobs"]
        ref += R.token_logprobs(model, q["prompt"], q["tokens"])
    return R.mismatch(got, ref)


def state(weights_dir, device):
    from safetensors.torch import load_file

    return sorted((k, v.to(device)) for k, v in load_file(os.path.join(weights_dir, "model.safetensors")).items())


def run_engine(res, key, base, weights, **engine):
    import torch
    import vllm

    from vllm_rlpatch.refit import EngineLayout, RefitError, push_weights

    r = res[key] = {}
    t0 = time.perf_counter()
    llm = vllm.LLM(model=base, dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.2, enforce_eager=True,
                   **engine)
    r["start_s"] = time.perf_counter() - t0
    steps = [("B", "cuda_ipc", "atomic"), ("C", "cuda_ipc", "direct"), ("B", "cuda_ipc", "atomic"),
             ("C", "shm", "atomic")]
    for name, transport, mode in steps:
        try:
            rep = push_weights(llm, state(weights[name], "cuda"), transport=transport, mode=mode)
            outs = greedy(llm, vllm)
            r[f"{name}_{transport}_{mode}"] = {"ok": True, "seconds": rep.seconds, "path": rep.path,
                                               "guarantee": rep.guarantee, "backup": rep.backup,
                                               "post_check": rep.post_check,
                                               "plan": rep.workers[0].get("plan"), "checks": rep.checks,
                                               "stages": rep.stages, "version": rep.version,
                                               "spans": outs[0]["spans"], "vs_ref": vs_reference(outs, weights[name])}
        except RefitError as e:
            r[f"{name}_{transport}_{mode}"] = {"ok": False, "kind": e.kind, "state": e.state, "message": str(e)}
            return llm
    fp0 = llm.collective_rpc("rlpatch_fingerprint")
    bad = state(weights["B"], "cuda")
    bad[3] = (bad[3][0], bad[3][1].clone().fill_(float("nan")))
    try:
        push_weights(llm, bad, transport="cuda_ipc", mode="atomic")
        r["bad_nan"] = {"ok": True}
    except RefitError as e:
        r["bad_nan"] = {"ok": False, "kind": e.kind, "state": e.state, "message": str(e)[:300],
                        "fingerprint_unchanged": llm.collective_rpc("rlpatch_fingerprint") == fp0}
    try:
        layout = EngineLayout(llm)
        layout.copy_from(state(weights["B"], "cuda"))
        torch.cuda.synchronize()
        rep = push_weights(llm, layout, mode="direct")
        outs = greedy(llm, vllm)
        r["layout_B"] = {"ok": True, "seconds": rep.seconds, "path": rep.path, "guarantee": rep.guarantee,
                         "transport": rep.transport, "vs_ref": vs_reference(outs, weights["B"])}
    except RefitError as e:
        r["layout_B"] = {"ok": False, "kind": e.kind, "message": str(e)}
    return llm


def main():
    from support import reference as R
    import torch

    from vllm_rlpatch.models import path

    out = sys.argv[1]
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    import vllm

    res["vllm"] = vllm.__version__
    base = path("llama-tiny")
    wdir = "/tmp/rlpatch-w"
    weights = {"B": R.perturbed_copy(base, f"{wdir}/B", scale=1.0, seed=7),
               "C": R.perturbed_copy(base, f"{wdir}/C", scale=1.0, seed=8)}
    for key, engine in (("bf16", {}), ("fp8", {"quantization": "fp8"})):
        try:
            llm = run_engine(res, key, base, weights, **engine)
            del llm
        except Exception as e:  # noqa: BLE001 - recorded
            res.setdefault(key, {})["error"] = f"{type(e).__name__}: {e}"
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        json.dump(res, open(out, "w"), indent=1, default=str)
    print(json.dumps(res, indent=1, default=str)[:6000])


if __name__ == "__main__":
    main()
