"""One ``vllm-rlpatch parity`` configuration: an engine in its own process (the patches are chosen by the
environment before vLLM is imported), rollouts before and after a weight update.

    python -m vllm_rlpatch.tools._parity_engine SPEC.json

Progress goes to stdout as ``@@parity {json}`` lines; the result is written to ``spec["out"]``.
The stock configuration updates weights with vLLM's own ``reload_weights`` (what a user without the plugin
has); every other one through :func:`vllm_rlpatch.refit.push_weights`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

from vllm_rlpatch import registry
from vllm_rlpatch.patches import fp32_lm_head


def _say(**kw) -> None:
    print("@@parity " + json.dumps(kw), flush=True)


def _lp(x: float) -> float:
    return x if math.isfinite(x) else (-1e30 if x < 0 else 1e30)


def _tensors(d: str):
    from pathlib import Path

    from safetensors.torch import load_file

    out = []
    for f in sorted(Path(d).glob("*.safetensors")):
        out.extend(sorted(load_file(str(f)).items()))
    return out


def _warm_up_prompt(p):
    if isinstance(p, str):
        return "Warm-up. " + p
    ids = list(p["prompt_token_ids"])
    return {"prompt_token_ids": ids[-1:] + ids[:-1]}  # rotated: another first block, the same length


def _generate(llm, vllm, prompts, sampling, seeds, support=False):
    extra = {"extra_args": {"rlpatch_support": True}} if support else {}
    params = [vllm.SamplingParams(**sampling, logprobs=0, seed=s, detokenize=False, **extra) for s in seeds]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    samples = []
    for o in outs:
        c = o.outputs[0]
        lps = [_lp(step[tok].logprob) if step is not None and tok in step else None
               for tok, step in zip(c.token_ids, c.logprobs or [])]
        sup = getattr(c, "rlpatch_support", None)
        samples.append({"prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(c.token_ids),
                        "logprobs": lps, "finish_reason": c.finish_reason,
                        "support": None if sup is None else {"log_mass_kept": list(sup.log_mass_kept),
                                                             "kept_count": list(sup.kept_count),
                                                             "engine": dict(sup.engine)},
                        "num_cached_tokens": getattr(o, "num_cached_tokens", None),
                        "weight_versions": [list(s) for s in getattr(c, "rlpatch_weight_versions", None) or []]})
    n_tok = sum(len(s["token_ids"]) for s in samples)
    return {"seconds": dt, "tokens": n_tok, "tokens_per_s": n_tok / dt if dt > 0 else None, "samples": samples}


def _refit(llm, spec, target_dir):
    t0 = time.perf_counter()
    if spec["refit_method"] == "reload_weights":
        llm.collective_rpc("reload_weights", kwargs={"weights_path": target_dir})
        return {"method": "reload_weights", "seconds": time.perf_counter() - t0}
    from vllm_rlpatch.refit import push_weights

    tensors = _tensors(target_dir)
    import torch

    if torch.cuda.is_available():  # colocated trainer on the engine's GPU: the cuda_ipc transport
        tensors = [(n, t.cuda()) for n, t in tensors]
    rep = push_weights(llm, tensors)
    del tensors
    return {"method": "push_weights", "seconds": time.perf_counter() - t0, "transport": rep.transport,
            "mode": rep.mode, "version": rep.version, "gbps": rep.gbps, "bytes": rep.bytes}


def main() -> int:
    spec = json.loads(open(sys.argv[1]).read())
    out = {"config": spec["config"], "pid": os.getpid(), "runs": []}
    try:
        _say(stage="start")
        t0 = time.perf_counter()
        import vllm

        llm = vllm.LLM(model=spec["model"], **spec["engine_args"])
        cfg = llm.llm_engine.vllm_config
        mc = cfg.model_config
        out.update({"vllm": vllm.__version__, "startup_seconds": time.perf_counter() - t0,
                    "engine": {"logprobs_mode": str(getattr(mc, "logprobs_mode", None)),
                               "head_dtype": str(getattr(mc.hf_config, "head_dtype", None) or "model"),
                               "fp32_lm_head_patch": fp32_lm_head.SPEC.env.raw() or "default",
                               "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
                               "block_size": cfg.cache_config.block_size,
                               "dtype": str(mc.dtype)}})
        try:
            out["patches"] = {s.name: s.state for s in registry.status()}
        except Exception:
            out["patches"] = None
        _say(stage="ready", seconds=out["startup_seconds"])
        # tok/s after a warm-up: an engine's first batches pay one-time costs (allocations, CPU kernels built per
        # shape). The same batch with each prompt changed at its start (no measured prompt finds blocks of the
        # warm-up in the prefix cache) and as many tokens; nothing of it is recorded.
        sup = bool(spec.get("support"))
        _generate(llm, vllm, [_warm_up_prompt(p) for p in spec["prompts"][0]], spec["sampling"], spec["seeds"][0], sup)
        for r, (prompts, seeds) in enumerate(zip(spec["prompts"], spec["seeds"])):
            run = {"run": r}
            if r > 0:
                run["refit_back"] = _refit(llm, spec, spec["model"])
            run["before_refit"] = _generate(llm, vllm, prompts, spec["sampling"], seeds, sup)
            _say(stage="generated", run=r, phase="before_refit")
            run["refit"] = _refit(llm, spec, spec["refit_to"])
            _say(stage="refit", run=r, seconds=run["refit"]["seconds"])
            run["after_refit"] = _generate(llm, vllm, prompts, spec["sampling"], seeds, sup)
            _say(stage="generated", run=r, phase="after_refit")
            out["runs"].append(run)
        out["ok"] = True
    except BaseException as e:  # reported to the parent, which prints the log
        out["ok"] = False
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
    with open(spec["out"], "w") as f:
        json.dump(out, f)
    _say(stage="done", ok=out["ok"])
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
