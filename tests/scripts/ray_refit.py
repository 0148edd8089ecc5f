"""A vllm.LLM hosted in a Ray actor (local Ray cluster on loopback), updated through its handle.

    python ray_refit.py SPEC.json      -> prints `RESULT {...}`

SPEC: {"engine": {...LLM kwargs...}, "weights": DIR, "tied": bool, "prompts": [...]}.
1. An actor hosting the engine: generate, push_weights(handle, state dict of DIR), weight_version(handle),
   generate again (greedy tokens, logprobs, version spans), and a bad push (a missing tensor) through the handle.
2. An actor in whose process vllm-rlpatch cannot be imported (tests/hide_rlpatch/sitecustomize.py hides it, as
   in an environment where it is not installed): push_weights(handle) must fail loudly, naming the cause.
"""

import json
import math
import os
import sys
import time


def _lp(x):
    return x if math.isfinite(x) else -1e30


def main():
    spec = json.loads(open(sys.argv[1]).read())
    import ray
    import torch
    from safetensors.torch import load_file

    from vllm_rlpatch.refit import RefitError, push_weights, weight_version

    env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "PYTHONPATH"))}
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": env}, log_to_driver=True)
    res = {"ray_init_seconds": time.perf_counter() - t0}

    @ray.remote(num_cpus=0)
    class Host:
        def __init__(self, engine):
            import vllm

            kw = dict(dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=64 << 20, enforce_eager=True,
                      gpu_memory_utilization=0.5)
            kw.update(engine)
            self.llm = vllm.LLM(**kw)

        def generate(self, prompts):
            import vllm

            sp = vllm.SamplingParams(temperature=0.0, max_tokens=16, logprobs=0)
            out = []
            for o in self.llm.generate(prompts, sp, use_tqdm=False):
                c = o.outputs[0]
                out.append({"prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(c.token_ids),
                            "logprobs": [_lp(s[t].logprob) for t, s in zip(c.token_ids, c.logprobs)],
                            "spans": [list(s) for s in getattr(c, "rlpatch_weight_versions", None) or []]})
            return out

        def pid(self):
            return os.getpid()

    @ray.remote(num_cpus=0)
    class Bare:
        def __init__(self):
            self.note = "an actor whose process cannot import vllm_rlpatch"

    sd = load_file(os.path.join(spec["weights"], "model.safetensors"))
    if spec.get("tied") and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    host = Host.remote(spec["engine"])
    res["actor_pid"] = ray.get(host.pid.remote())
    res["g0"] = ray.get(host.generate.remote(spec["prompts"]))
    rep = push_weights(host, sorted(sd.items()))
    res["push"] = rep.as_dict()
    res["version"] = weight_version(host)
    res["g_new"] = ray.get(host.generate.remote(spec["prompts"]))
    try:
        push_weights(host, [(k, v) for k, v in sorted(sd.items()) if not k.endswith("norm.weight")])
        res["bad"] = {"ok": True}
    except RefitError as e:
        res["bad"] = {"ok": False, "kind": e.kind, "state": e.state, "message": str(e)}
    res["version_after_bad"] = weight_version(host)

    hide = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hide_rlpatch")
    hidden_env = dict(env, PYTHONPATH=os.pathsep.join([hide, env.get("PYTHONPATH", "")]))
    bare = Bare.options(runtime_env={"env_vars": hidden_env}).remote()
    try:
        push_weights(bare, sorted(sd.items()))
        res["missing_plugin"] = {"ok": True}
    except RefitError as e:
        res["missing_plugin"] = {"ok": False, "kind": e.kind, "message": str(e)}
    except Exception as e:  # noqa: BLE001 - anything else is a finding
        res["missing_plugin"] = {"ok": False, "kind": "unexpected", "message": f"{type(e).__name__}: {e}"}
    print("RESULT " + json.dumps(res, default=str), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
