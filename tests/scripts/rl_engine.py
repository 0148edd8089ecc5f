"""Run a sequence of RL-style operations on one real vllm.LLM and print `RESULT {...}`.

    python rl_engine.py SPEC.json

SPEC: {"engine": {...engine kwargs...}, "ops": [op, ...]} where op is one of
  {"op": "generate", "name": N, "prompts": [text, ...], "sampling": {...SamplingParams kwargs...}}
  {"op": "reload", "path": DIR}                      collective_rpc("reload_weights", weights_path=DIR)
  {"op": "rpc", "method": M, "args": [...]}          any collective_rpc (e.g. a framework extension's)
  {"op": "reset"}                                    llm.reset_prefix_cache()

This script does not import vllm_rlpatch: everything it reports is what vLLM returns (outputs carry the
plugin's `rlpatch_weight_versions` attribute when the plugin is active).
"""

import json
import math
import os
import sys
import time


def _lp(x):
    return x if math.isfinite(x) else (-1e30 if x < 0 else 1e30)


def generate(llm, vllm, op):
    sp = vllm.SamplingParams(**op.get("sampling", {}))
    t0 = time.perf_counter()
    outs = llm.generate(op["prompts"], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    res = []
    for o in outs:
        comps = []
        for c in o.outputs:
            lps = []
            for tok, step in zip(c.token_ids, c.logprobs or []):
                lps.append(_lp(step[tok].logprob) if tok in step else None)
            comps.append({"token_ids": list(c.token_ids), "logprobs": lps, "finish_reason": c.finish_reason,
                          "spans": [list(s) for s in getattr(c, "rlpatch_weight_versions", None) or []],
                          **({"top": [[_lp(x.logprob) for x in step.values()] for step in c.logprobs or []]}
                             if op.get("top") else {})})
        res.append({"prompt_token_ids": list(o.prompt_token_ids), "num_cached_tokens": o.num_cached_tokens,
                    "outputs": comps})
    return {"requests": res, "seconds": dt}


def main():
    spec = json.loads(open(sys.argv[1]).read())
    import vllm

    kwargs = dict(dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=64 << 20, enforce_eager=True,
                  gpu_memory_utilization=0.5, block_size=32)
    kwargs.update(spec.get("engine", {}))
    llm = vllm.LLM(**kwargs)
    cfg = llm.llm_engine.vllm_config
    result = {"pid": os.getpid(), "vllm": vllm.__version__,
              "logprobs_mode": str(cfg.model_config.logprobs_mode),
              "generation_config": cfg.model_config.generation_config,
              "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
              "async_scheduling": cfg.scheduler_config.async_scheduling,
              "block_size": cfg.cache_config.block_size, "ops": []}
    for op in spec["ops"]:
        kind = op["op"]
        try:
            if kind == "generate":
                r = generate(llm, vllm, op)
            elif kind == "reload":
                t0 = time.perf_counter()
                llm.collective_rpc("reload_weights", kwargs={"weights_path": op["path"]})
                r = {"seconds": time.perf_counter() - t0}
            elif kind == "rpc":
                r = {"result": llm.collective_rpc(op["method"], args=tuple(op.get("args", ())))}
            elif kind == "reset":
                r = {"result": llm.reset_prefix_cache()}
            else:
                raise SystemExit(f"unknown op {kind}")
        except Exception as e:  # reported; the test decides
            r = {"error": f"{type(e).__name__}: {e}"}
        r["op"] = kind
        r["name"] = op.get("name", kind)
        result["ops"].append(r)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
