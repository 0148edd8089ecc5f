"""vllm#42043 on vLLM's real AsyncScheduler, with no model: the scheduler is built from a real VllmConfig
and a KV-cache config, and the model runner's outputs are played by hand.

    python async_preempt.py MODEL        -> prints `RESULT {...}`

Scenario (what pause_generation(mode="keep") + clear_cache, or a weight update between steps, does): a
request prefills and decodes one token; the engine is drained (no output in flight); then
reset_prefix_cache(reset_running_requests=True) preempts it; it is rescheduled (recomputed) and its next
sampled token comes back. That token must be kept: the bug drops it. Second case: the same with an output
still in flight at the preemption; that stale output must be dropped (it was computed before the reset).
This script does not import vllm_rlpatch (the plugin is loaded by vLLM when EngineArgs is created).
"""

import json
import sys


def main(model):
    import torch
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    cfg = EngineArgs(model=model, dtype="bfloat16", max_model_len=256, block_size=32, enforce_eager=True,
                     kv_cache_memory_bytes=64 << 20, gpu_memory_utilization=0.5,
                     enable_prefix_caching=False).create_engine_config()  # no block hashing needed
    cfg.cache_config.num_gpu_blocks = 64  # what the engine core sets after profiling
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])

    def output(req_id, token):
        return ModelRunnerOutput(req_ids=[req_id], req_id_to_index={req_id: 0}, sampled_token_ids=[[token]])

    def case(req_id, in_flight):
        sched = AsyncScheduler(cfg, kv, StructuredOutputManager(cfg), block_size=32)
        req = Request(req_id, list(range(5, 45)), SamplingParams(max_tokens=8, ignore_eos=True), None)
        sched.add_request(req)
        so = sched.schedule()  # prefill
        sched.update_from_output(so, output(req_id, 100))  # first token; nothing in flight now
        if in_flight:
            so = sched.schedule()  # decode step launched; its output (101) is in flight
        sched.reset_prefix_cache(reset_running_requests=True)  # forced preemption
        if in_flight:
            sched.update_from_output(so, output(req_id, 101))  # stale: computed before the reset
        so = sched.schedule()  # recompute + next decode
        sched.update_from_output(so, output(req_id, 102))
        return list(req.output_token_ids)

    res = {"vllm": vllm.__version__, "drained": case("drained", False), "in_flight": case("in_flight", True)}
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
