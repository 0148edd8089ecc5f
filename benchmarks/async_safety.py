"""Is async scheduling safe for RL with the plugin? Evidence run (GPU: async scheduling is on there).

    python benchmarks/async_safety.py --out OUT.json

1. vllm#42043's reproduction (tests/scripts/pause_resume.py): greedy request, pause_generation(keep,
   clear_cache=True) mid-generation, resume; the tokens must equal the same request without a pause.
   Run with vLLM as installed (every patch off but the CPU AMX fix) and with the plugin.
2. A weight update while requests run (tests/scripts/inflight.py), in-flight policy ``recompute`` and
   ``keep``: every request must still have exactly max_tokens tokens (none dropped or doubled by the
   async batch in flight), its version spans must cover them, and every token's logprob must match a
   float32 transformers reference of the weights of its span's version (``recompute``), or the mixing
   must be reported (``keep``).
Writes JSON with the vLLM version, device, async_scheduling as resolved, and every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _run(script: str, args: list[str], env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_")}
    env.update(env_extra)
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / script), *args], capture_output=True,
                       text=True, env=env, timeout=600)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        return {"error": f"exit {p.returncode}", "log_tail": (p.stdout + p.stderr)[-3000:]}
    return json.loads(lines[-1][7:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=480)
    args = ap.parse_args(argv)
    import torch

    from support import reference as R
    from grpo_rollout import stock_env

    from vllm_rlpatch.models import path

    model = path("llama-tiny")
    tmp = tempfile.mkdtemp(prefix="rlpatch-async-")
    new = R.perturbed_copy(model, os.path.join(tmp, "llama-B"), scale=1.0)
    gpu = torch.cuda.is_available()
    engine = {"kv_cache_memory_bytes": 1 << 30, "gpu_memory_utilization": 0.1} if gpu else {}
    doc = {"benchmark": "async_safety", "device": torch.cuda.get_device_name(0) if gpu else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "pause_resume": {}, "inflight": {}}
    for name, env in (("vllm_as_installed", stock_env()), ("rlpatch", {})):
        r = _run("pause_resume.py", [model, json.dumps(engine)], env)
        doc["pause_resume"][name] = r
        print(f"[pause/resume] {name}: {r}", flush=True)
    mA, mB = R.load(model), R.load(new)
    prompts = ["the quick cat sees the old dog on the mat. 12 + 7 = 19. count: 3 4 5 6 7. the small robot reads "
               "the red token in the garden. " * 3,
               "the bright student finds the stale reward on the server. 30 + 12 = 42. count: 10 11 12 13. the "
               "large worker moves the fresh policy. " * 3]
    for policy in ("recompute", "keep"):
        spec = {"model": model, "new_weights": new, "prompts": prompts, "max_tokens": args.max_tokens,
                "update_after": 8, "engine": engine}
        spec_path = os.path.join(tmp, f"spec-{policy}.json")
        Path(spec_path).write_text(json.dumps(spec))
        r = _run("inflight.py", [spec_path], {"VLLM_RLPATCH_INFLIGHT": policy})
        if "error" in r:
            doc["inflight"][policy] = r
            print(f"[in-flight {policy}] {r}", flush=True)
            continue
        reqs = []
        for q in r["inflight"]:
            refA = R.token_logprobs(mA, q["prompt_token_ids"], q["token_ids"])
            refB = R.token_logprobs(mB, q["prompt_token_ids"], q["token_ids"])
            spans = []
            for s, e, v, kv in q["spans"]:
                m = R.mismatch(q["logprobs"][s:e], (refA if v == 0 else refB)[s:e])
                spans.append({"start": s, "end": e, "version": v, "kv_version": kv,
                              "token_mult_prob_error": m["token_mult_prob_error"], "max": m["max"]})
            covered = sum(sp["end"] - sp["start"] for sp in spans)
            reqs.append({"n_tokens": len(q["token_ids"]), "finish_reason": q["finish_reason"],
                         "spans_cover_all_tokens": covered == len(q["token_ids"]), "spans": spans})
        doc["inflight"][policy] = {"async_scheduling": r["async_scheduling"], "requests": reqs,
                                   "all_max_tokens": all(x["n_tokens"] == args.max_tokens for x in reqs)}
        print(f"[in-flight {policy}] {json.dumps(doc['inflight'][policy])}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
