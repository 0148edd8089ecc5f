"""Start a real vllm.LLM in this process, run a scenario, print one JSON line `RESULT {...}`.

Used by the tests through a subprocess so each scenario gets fresh processes (engine core, workers) and
its complete log (every process writes to the inherited stdout/stderr). This script does not import
vllm_rlpatch: what it reports is what vLLM itself returns.

    python run_engine.py '{"engine": {...}, "logprobs_probe": true, "reload": true, "rpc": ["rlpatch_ping"]}'
"""

import json
import math
import os
import sys


def logprob_probe(llm, vllm, processed_expected):
    """Sample with temperature 0.7 and top_k=3, ask for the top-8 logprobs at every position.

    processed_logprobs: tokens outside the top-k are -inf and the finite ones sum to probability 1.
    raw_logprobs: every reported token has a finite logprob and the top-8 mass is < 1 (T=1, no top-k).
    """
    sp = vllm.SamplingParams(temperature=0.7, top_k=3, max_tokens=12, logprobs=8, seed=7)
    prompts = ["the quick cat sees", "12 + 7 =", "count: 3 4 5", "spell robot:"]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    positions = 0
    n_neg_inf = 0
    mass = []
    for o in outs:
        for step in o.outputs[0].logprobs:
            positions += 1
            vals = [v.logprob for v in step.values()]
            n_neg_inf += sum(1 for x in vals if x == -math.inf or x < -1e30)
            finite = [x for x in vals if math.isfinite(x) and x > -1e30]
            if len(finite) < len(vals) or not processed_expected:
                # all kept tokens are among those shown (a bf16 tie can keep more than top_k: skip those)
                mass.append(sum(math.exp(x) for x in finite))
    return {"positions": positions, "mass_positions": len(mass), "neg_inf": n_neg_inf, "min_mass": min(mass), "max_mass": max(mass),
            "texts": [o.outputs[0].text for o in outs]}


def main():
    spec = json.loads(sys.argv[1])
    import vllm

    if spec.get("bare"):  # what a user writes: vllm.LLM(model) (plus what the test machine needs)
        llm = vllm.LLM(spec["engine"]["model"], **spec.get("bare_kwargs", {}))
    else:
        kwargs = dict(dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=64 << 20, enforce_eager=True,
                      gpu_memory_utilization=0.5)
        kwargs.update(spec.get("engine", {}))
        llm = vllm.LLM(**kwargs)
    cfg = llm.llm_engine.vllm_config
    res = {"pid": os.getpid(), "vllm": vllm.__version__,
           "logprobs_mode": str(cfg.model_config.logprobs_mode),
           "worker_extension_cls": cfg.parallel_config.worker_extension_cls}
    if spec.get("logprobs_probe"):
        res["probe"] = logprob_probe(llm, vllm, res["logprobs_mode"] == "processed_logprobs")
    for method in spec.get("rpc", []):
        try:
            res[f"rpc:{method}"] = llm.collective_rpc(method, args=tuple(spec.get("rpc_args", {}).get(method, ())))
        except Exception as e:  # reported, the test decides
            res[f"rpc:{method}"] = {"error": f"{type(e).__name__}: {e}"}
    if spec.get("reload"):
        llm.collective_rpc("reload_weights")
        llm.collective_rpc("reload_weights")
        try:
            import vllm_rlpatch

            res["frontend_weight_version"] = vllm_rlpatch.updates_seen(llm)
        except ImportError:
            res["frontend_weight_version"] = None
        for method in spec.get("rpc_after_reload", []):
            try:
                res[f"after:{method}"] = llm.collective_rpc(method)
            except Exception as e:
                res[f"after:{method}"] = {"error": f"{type(e).__name__}: {e}"}
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
