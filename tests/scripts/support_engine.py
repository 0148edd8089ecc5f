"""One real vllm.LLM for the sampling-support tests: a batch of requests with per-request sampling parameters,
each asking for the engine's support information, the logits the sampler saw captured in the worker.

    python support_engine.py SPEC.json

SPEC: {"engine": {...}, "requests": [{"prompt": text, "sampling": {...SamplingParams kwargs...}}, ...],
       "capture": PATH (where the worker writes the captured logits), "extra": [{"prompt", "sampling"}, ...]}
Prints `RESULT {...}`: per request its prompt/output token ids, returned logprobs and `rlpatch_support`
(read as vLLM returns it to a plain `LLM.generate` caller); the worker's hook state.
"""

import json
import math
import os
import sys
import time


def _lp(x):
    return x if math.isfinite(x) else -1e30


def _out(o):
    comps = []
    for c in o.outputs:
        sup = getattr(c, "rlpatch_support", None)
        comps.append({"token_ids": list(c.token_ids),
                      "logprobs": [_lp(step[t].logprob) if t in step else None
                                   for t, step in zip(c.token_ids, c.logprobs or [])],
                      "support": None if sup is None else {"log_mass_kept": [None if math.isnan(x) else x
                                                                             for x in sup.log_mass_kept],
                                                           "kept_count": list(sup.kept_count),
                                                           "engine": dict(sup.engine)}})
    return {"request_id": o.request_id, "prompt_token_ids": list(o.prompt_token_ids), "outputs": comps}


def main():
    spec = json.loads(open(sys.argv[1]).read())
    import vllm

    kwargs = dict(dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=64 << 20, enforce_eager=True,
                  gpu_memory_utilization=0.5, block_size=32, max_num_batched_tokens=2048,
                  worker_extension_cls="helpers_ext.SupportCaptureExtension")
    kwargs.update(spec.get("engine", {}))
    t0 = time.perf_counter()
    llm = vllm.LLM(**kwargs)
    result = {"pid": os.getpid(), "vllm": vllm.__version__, "startup_s": time.perf_counter() - t0,
              "logprobs_mode": str(llm.llm_engine.vllm_config.model_config.logprobs_mode)}
    result["hooks"] = llm.collective_rpc("support_hooks")
    if spec.get("capture"):
        llm.collective_rpc("support_capture_start")
    for name in ("requests", "extra"):
        reqs = spec.get(name) or []
        if not reqs:
            continue
        params = [vllm.SamplingParams(**r["sampling"]) for r in reqs]
        t0 = time.perf_counter()
        outs = llm.generate([r["prompt"] for r in reqs], params, use_tqdm=False)
        result[name + "_s"] = time.perf_counter() - t0
        result[name] = [_out(o) for o in outs]
    if spec.get("capture"):
        result["captured_rows"] = llm.collective_rpc("support_capture_dump", args=(spec["capture"],))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
