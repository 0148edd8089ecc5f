"""AsyncLLM with requests running while the weights change (what async RL frameworks do).

    python inflight.py SPEC.json      -> prints `RESULT {...}`

SPEC: {"model": DIR, "new_weights": DIR, "prompts": [text, ...], "max_tokens": N, "update_after": K,
       "engine": {...}}. Every prompt is streamed; once the first request has K output tokens the script
awaits collective_rpc("reload_weights", weights_path=new_weights) while all requests keep running, then
collects the final outputs (tokens, the logprob of each sampled token, finish reason, version spans).
Right after the update, while those still run, each prompt is sent again ("during": its old blocks are
still held by the running requests); after all finished, once more ("after": the cache is warm).
With "update": "push" the update is `await vllm_rlpatch.refit.push_weights_async(engine, <new_weights' state
dict>, **push_kw)` instead (the refit API's per-update `inflight`), preceded by the pushes in
"refused_first" (each recorded with its error); otherwise this script does not import vllm_rlpatch.
"""

import asyncio
import json
import math
import sys


def _lp(x):
    return x if math.isfinite(x) else -1e30


async def main(spec):
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kw = dict(model=spec["model"], dtype="bfloat16", max_model_len=1024, kv_cache_memory_bytes=64 << 20,
              enforce_eager=True, gpu_memory_utilization=0.5, block_size=32)
    kw.update(spec.get("engine", {}))
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
    cfg = engine.vllm_config
    res = {"vllm": vllm.__version__, "async_scheduling": cfg.scheduler_config.async_scheduling,
           "enable_prefix_caching": cfg.cache_config.enable_prefix_caching}
    try:
        sp = vllm.SamplingParams(temperature=1.0, max_tokens=spec["max_tokens"], logprobs=0, seed=11,
                                 ignore_eos=True)
        first_tokens = asyncio.Event()
        finals = {}

        async def run(i, prompt):
            final = None
            async for out in engine.generate(prompt, sp, request_id=f"r{i}"):
                final = out
                if i == 0 and len(out.outputs[0].token_ids) >= spec["update_after"]:
                    first_tokens.set()
            finals[i] = final

        tasks = [asyncio.create_task(run(i, p)) for i, p in enumerate(spec["prompts"])]
        await asyncio.wait_for(first_tokens.wait(), 300)
        update_error = None
        try:
            if spec.get("update") == "push":
                import os

                from safetensors.torch import load_file

                from vllm_rlpatch.refit import RefitError, push_weights_async

                sd = load_file(os.path.join(spec["new_weights"], "model.safetensors"))
                for i, kw in enumerate(spec.get("refused_first", [])):  # pushes that must be refused first
                    try:
                        await push_weights_async(engine, sorted(sd.items()), **kw)
                        res.setdefault("refused", []).append({"ok": True})
                    except RefitError as e:
                        res.setdefault("refused", []).append({"ok": False, "kind": e.kind, "state": e.state,
                                                              "message": str(e)})
                rep = await push_weights_async(engine, sorted(sd.items()), **spec.get("push_kw", {}))
                res["push_report"] = rep.as_dict()
            else:
                await engine.collective_rpc("reload_weights", kwargs={"weights_path": spec["new_weights"]})
        except Exception as e:
            update_error = f"{type(e).__name__}: {e}"
            res["update_error_kind"] = getattr(e, "kind", None)
        res["update_error"] = update_error
        # what the front end had seen when the update returned (it may lag the engine core under load)
        res["first_finished_at_update"] = [i in finals for i in range(len(spec["prompts"]))]
        # While the first requests still run (and hold the blocks of their prompts): the same prompts again.
        sp2 = vllm.SamplingParams(temperature=1.0, max_tokens=16, logprobs=0, seed=5, ignore_eos=True)
        during = {}

        async def run_during(i, prompt):
            final = None
            async for out in engine.generate(prompt, sp2, request_id=f"during{i}"):
                final = out
            during[i] = final

        await asyncio.gather(*(run_during(i, p) for i, p in enumerate(spec["prompts"])))
        res["during_finished_first"] = [i not in finals for i in range(len(spec["prompts"]))]
        await asyncio.gather(*tasks)

        def pack(o):
            c = o.outputs[0]
            lps = [(_lp(step[t].logprob) if t in step else None) for t, step in zip(c.token_ids, c.logprobs or [])]
            return {"prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(c.token_ids), "logprobs": lps,
                    "finish_reason": c.finish_reason, "num_cached_tokens": o.num_cached_tokens,
                    "spans": [list(s) for s in getattr(c, "rlpatch_weight_versions", None) or []]}

        res["inflight"] = [pack(finals[i]) for i in range(len(spec["prompts"]))]
        res["during"] = [pack(during[i]) for i in range(len(spec["prompts"]))]
        after = []
        for i, p in enumerate(spec["prompts"]):
            final = None
            async for out in engine.generate(p, sp2, request_id=f"after{i}"):
                final = out
            after.append(pack(final))
        res["after"] = after
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(open(sys.argv[1]).read())))
