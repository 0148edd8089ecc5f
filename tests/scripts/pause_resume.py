"""vllm#42043's reproduction: with async scheduling, pause_generation(mode="keep") + clear_cache, then
resume, must not drop or shift a token. Greedy, so the reference is the same request run without a pause.

    python pause_resume.py MODEL [engine kwargs as JSON]   -> prints `RESULT {...}`
This script does not import vllm_rlpatch.
"""

import asyncio
import json
import sys


async def main(model, extra):
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kw = dict(model=model, dtype="bfloat16", max_model_len=1024, kv_cache_memory_bytes=64 << 20,
              enforce_eager=True, gpu_memory_utilization=0.5, block_size=32)
    kw.update(extra)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
    prompt = "the quick cat sees the old dog on the mat. 12 + 7 = 19. count: 3 4 5 6 7."
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    res = {"vllm": vllm.__version__, "async_scheduling": engine.vllm_config.scheduler_config.async_scheduling}
    try:
        final = None
        async for out in engine.generate(prompt, sp, request_id="ref"):
            final = out
        ref = list(final.outputs[0].token_ids)
        paused_at = None
        final = None

        async def gen():
            nonlocal final
            async for out in engine.generate(prompt, sp, request_id="paused"):
                final = out

        task = asyncio.create_task(gen())
        while final is None or len(final.outputs[0].token_ids) < 40:
            await asyncio.sleep(0.001)
        await engine.pause_generation(mode="keep", clear_cache=True)
        paused_at = len(final.outputs[0].token_ids)
        await asyncio.sleep(0.3)
        await engine.resume_generation()
        await task
        got = list(final.outputs[0].token_ids)
        first_diff = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        res.update({"paused_at": paused_at, "n_ref": len(ref), "n_got": len(got), "identical": ref == got,
                    "first_difference": first_diff,
                    "shifted_by_one": first_diff is not None and got[first_diff:first_diff + 20] == ref[first_diff + 1:first_diff + 21]})
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}))
