"""AsyncLLM (what `vllm serve` and async RL frameworks use): logprobs mode, probe, async weight update.

    python run_async_engine.py MODEL      -> prints `RESULT {...}`
"""

import asyncio
import json
import math
import sys


async def main(model):
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=64 << 20, enforce_eager=True,
        gpu_memory_utilization=0.5))
    try:
        sp = vllm.SamplingParams(temperature=0.7, top_k=3, max_tokens=8, logprobs=8, seed=3)
        final = None
        async for out in engine.generate("the quick cat sees", sp, request_id="r1"):
            final = out
        steps = final.outputs[0].logprobs
        neg_inf = sum(1 for s in steps for v in s.values() if v.logprob == -math.inf)
        await engine.collective_rpc("reload_weights")
        import vllm_rlpatch

        res = {"logprobs_mode": str(engine.vllm_config.model_config.logprobs_mode),
               "positions": len(steps), "neg_inf": neg_inf,
               "frontend_weight_version": vllm_rlpatch.updates_seen(engine),
               "worker_weight_version": await engine.collective_rpc("rlpatch_weight_version")}
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
