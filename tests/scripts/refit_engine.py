"""Drive one real vllm.LLM through weight updates with the refit API and print `RESULT {...}`.

    python refit_engine.py SPEC.json

SPEC: {"engine": {...LLM kwargs...}, "weights": {"A": DIR, "B": DIR, ...}, "tied": bool, "ops": [op, ...]}

ops (each result is recorded under its "name"):
  {"op": "generate", "prompts": [...], "sampling": {...}}          tokens, logprobs, version spans
  {"op": "push", "weights": "B", "kw": {...}, "bad": CASE}          push_weights; report or error
  {"op": "fingerprint"}                                             per-worker fingerprints
  {"op": "version"}                                                 vllm_rlpatch.refit.weight_version
  {"op": "rpc", "method": M, "args": [...]}                         collective_rpc (a framework's extension)
  {"op": "reload", "path": DIR}                                     collective_rpc("reload_weights", weights_path=DIR)
  {"op": "rpc_each", "method": M, "path": FILE, "generate_after": S, "generate": {...}}
                                                                    collective_rpc(M, args=(FILE, name)) per tensor
                                                                    of FILE (sorted names); a generate op after the
                                                                    first name containing S
  {"op": "sleep", "level": 1} / {"op": "wake_up", "tags": [...]}
  {"op": "session", "weights": "B", "parts": 3, "kw": {...}, "abort_after": K}
                                                                    refit_session: the state dict in `parts`
                                                                    interleaved parts (a fused layer's q, k, v
                                                                    land in different parts); abort before part K
Bad-input CASEs mutate the state dict of "weights" before pushing: unknown, missing, shape, dtype, nan, inf,
duplicate, empty, not_tensor, old_version, tied_mismatch, half_layer, sender_stops, direct_nan, asleep,
hf_fused_experts.
"""

import json
import math
import os
import sys
import time


def _lp(x):
    return x if math.isfinite(x) else (-1e30 if x < 0 else 1e30)


def state_dict(weights_dir, tied):
    import torch
    from safetensors.torch import load_file

    sd = load_file(os.path.join(weights_dir, "model.safetensors"))
    if tied and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # what a trainer's HF state_dict() carries
    return dict(sorted(sd.items()))


def mutate(sd, case, torch):
    items = list(sd.items())
    first_w = next(k for k in sd if k.endswith("q_proj.weight"))
    if case == "unknown":
        k, v = items[3]
        return [(k.replace("layers", "layer"), v) if i == 3 else (n, t) for i, (n, t) in enumerate(items)], {}
    if case == "missing":
        return [(n, t) for n, t in items if n != first_w], {}
    if case == "shape":
        return [(n, t[:-1] if n == first_w else t) for n, t in items], {}
    if case == "dtype":
        return [(n, t.float() if n == first_w else t) for n, t in items], {}
    if case in ("nan", "direct_nan"):
        return [(n, _poke(t, float("nan")) if n == first_w else t) for n, t in items], (
            {"mode": "direct"} if case == "direct_nan" else {})
    if case == "inf":
        return [(n, _poke(t, float("inf")) if n == first_w else t) for n, t in items], {}
    if case == "duplicate":
        return items + [items[0]], {}
    if case == "empty":
        return [], {}
    if case == "not_tensor":
        return [(n, t.tolist() if n == first_w else t) for n, t in items], {}
    if case == "old_version":
        return items, {"version": 1}
    if case == "tied_mismatch":
        return [(n, t * 2 if n == "lm_head.weight" else t) for n, t in items], {}
    if case == "half_layer":  # q of one fused qkv without k and v, as a partial update
        return [(first_w, sd[first_w])], {"partial": True}
    if case == "hf_fused_experts":  # transformers >= 5 in-memory MoE naming: experts packed per layer
        out = [(n, t) for n, t in items if ".experts." not in n]
        for layer in sorted({n.split(".experts.")[0] for n, _ in items if ".experts." in n}):
            e = sorted({int(n.split(".experts.")[1].split(".")[0]) for n, _ in items if n.startswith(layer + ".experts.")})
            w1 = torch.stack([sd[f"{layer}.experts.{i}.w1.weight"] for i in e])
            w3 = torch.stack([sd[f"{layer}.experts.{i}.w3.weight"] for i in e])
            w2 = torch.stack([sd[f"{layer}.experts.{i}.w2.weight"] for i in e])
            base = layer.replace("block_sparse_moe", "mlp")
            out += [(f"{base}.experts.gate_up_proj", torch.cat([w1, w3], dim=1)), (f"{base}.experts.down_proj", w2)]
        return out, {}
    if case == "sender_stops":
        return items, {"transport": "dist", "timeout_s": 8.0, "bucket_bytes": 64 << 10, "_stop_after": 2}
    raise SystemExit(f"unknown case {case}")


def _poke(t, value):
    t = t.clone()
    t.view(-1)[t.numel() // 2] = value
    return t


def session(llm, op, spec):
    from vllm_rlpatch.refit import RefitError, refit_session

    items = list(state_dict(spec["weights"][op.get("weights", "B")], spec.get("tied", False)).items())
    n = int(op.get("parts", 3))
    chunks = [items[i::n] for i in range(n)]
    s = refit_session(llm, **op.get("kw", {})).begin()
    parts = []
    try:
        for k, chunk in enumerate(chunks):
            if op.get("abort_after") == k:
                rep = s.abort()
                return {"ok": rep.ok, "aborted": True, "report": rep.as_dict(), "parts": parts}
            parts.append(s.push(chunk).as_dict())
        rep = s.commit()
        return {"ok": True, "report": rep.as_dict(), "parts": parts}
    except RefitError as e:
        if s.open:
            s.abort()
        return {"ok": False, "kind": e.kind, "state": e.state, "message": str(e), "parts": parts,
                "report": e.report.as_dict() if e.report is not None else None}


def generate(llm, vllm, op):
    sp = vllm.SamplingParams(**op.get("sampling", {"temperature": 0.0, "max_tokens": 16, "logprobs": 0}))
    try:
        outs = llm.generate(op["prompts"], sp, use_tqdm=False)
    except Exception as e:  # refused while the weights are mixed
        return {"error": f"{type(e).__name__}: {e}"}
    res = []
    for o in outs:
        c = o.outputs[0]
        lps = [(_lp(step[t].logprob) if t in step else None) for t, step in zip(c.token_ids, c.logprobs or [])]
        res.append({"prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(c.token_ids), "logprobs": lps,
                    "finish_reason": c.finish_reason, "num_cached_tokens": o.num_cached_tokens,
                    "spans": [list(s) for s in getattr(c, "rlpatch_weight_versions", None) or []],
                    **({"top": [[_lp(x.logprob) for x in step.values()] for step in c.logprobs or []]}
                       if op.get("top") else {})})
    return {"requests": res}


def rpc_each(llm, vllm, op):
    from safetensors import safe_open

    with safe_open(op["path"], "pt") as f:
        names = sorted(f.keys())
    out = {"names": len(names), "calls": 0, "errors": [], "between": None}
    for name in names:
        try:
            llm.collective_rpc(op["method"], args=(op["path"], name))
            out["calls"] += 1
        except Exception as e:  # noqa: BLE001 - reported; the test decides
            out["errors"].append(f"{name}: {type(e).__name__}: {e}")
        if out["between"] is None and op.get("generate_after") and op["generate_after"] in name:
            out["between"] = generate(llm, vllm, op["generate"])
    return out


def push(llm, op, spec):
    import torch

    from vllm_rlpatch.refit import RefitError, push_weights
    from vllm_rlpatch.refit import dist as T

    sd = state_dict(spec["weights"][op.get("weights", "B")], spec.get("tied", False))
    kw = dict(op.get("kw", {}))
    if op.get("bad"):
        items, extra = mutate(sd, op["bad"], torch)
        kw.update(extra)
    else:
        items = list(sd.items())
    stop_after = kw.pop("_stop_after", None)
    orig_run = T.DistSender._run
    if stop_after is not None:  # the sender dies after `stop_after` buckets (its process group goes away)
        def _run(self):
            def on_bucket(seg):
                if seg >= stop_after:
                    raise RuntimeError("sender killed")
            self.on_bucket = on_bucket
            orig_run(self)
        T.DistSender._run = _run
    t0 = time.perf_counter()
    try:
        rep = push_weights(llm, items, **kw)
        return {"ok": True, "report": rep.as_dict(), "seconds": time.perf_counter() - t0}
    except RefitError as e:
        return {"ok": False, "kind": e.kind, "state": e.state, "message": str(e),
                "report": e.report.as_dict() if e.report is not None else None}
    except Exception as e:  # noqa: BLE001 - a non-RefitError is itself a finding
        return {"ok": False, "kind": "unexpected", "state": "?", "message": f"{type(e).__name__}: {e}"}
    finally:
        T.DistSender._run = orig_run


def main():
    spec = json.loads(open(sys.argv[1]).read())
    import vllm

    from vllm_rlpatch.refit import weight_version

    kwargs = dict(dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=64 << 20, enforce_eager=True,
                  gpu_memory_utilization=0.5)
    kwargs.update(spec.get("engine", {}))
    t0 = time.perf_counter()
    llm = vllm.LLM(**kwargs)
    result = {"pid": os.getpid(), "vllm": vllm.__version__, "start_seconds": time.perf_counter() - t0, "ops": {}}
    for op in spec["ops"]:
        kind, name = op["op"], op.get("name", op["op"])
        t1 = time.perf_counter()
        try:
            if kind == "generate":
                r = generate(llm, vllm, op)
            elif kind == "push":
                r = push(llm, op, spec)
            elif kind == "session":
                r = session(llm, op, spec)
            elif kind == "fingerprint":
                r = {"workers": llm.collective_rpc("rlpatch_fingerprint")}
            elif kind == "version":
                r = {"version": weight_version(llm)}
            elif kind == "rpc":
                r = {"result": llm.collective_rpc(op["method"], args=tuple(op.get("args", ())))}
            elif kind == "rpc_each":
                r = rpc_each(llm, vllm, op)
            elif kind == "reload":
                llm.collective_rpc("reload_weights", kwargs={"weights_path": op["path"]})
                r = {}
            elif kind == "sleep":
                llm.sleep(level=op.get("level", 1))
                r = {}
            elif kind == "wake_up":
                llm.wake_up(tags=op.get("tags"))
                r = {}
            else:
                raise SystemExit(f"unknown op {kind}")
        except Exception as e:  # noqa: BLE001 - reported; the test decides
            r = {"error": f"{type(e).__name__}: {e}"}
        r["seconds"] = time.perf_counter() - t1
        result["ops"][name] = r
    print("RESULT " + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
