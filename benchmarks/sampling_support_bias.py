"""The log(S) bias on the embedded model: how much of the temperature-scaled distribution's mass the engine's
kept set (after min-p / top-k / top-p) holds, per sampling setting (JSON out; a measurement, never a test).

    python benchmarks/sampling_support_bias.py [--model llama-tiny] [--out benchmarks/results/sampling_support_bias-<vllm>-cpu.json]

One engine, the plugin's defaults; 8 prompts x 8 samples x 48 tokens per setting (seeded), every request asking
for the engine's support information. Per setting: the mean over sampled tokens of log_mass_kept = log S (S =
the kept set's mass), its 10th percentile, and the mean kept-set size. A trainer that scores the rollouts with
full-vocabulary logprobs at the rollout temperature computes lp_T = lp_processed + log S: every token's
logprob is too low by -log S, and every importance ratio pi_trainer / pi_rollout is off by the factor S.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ENGINE = r"""
import json, sys
if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    import vllm
    llm = vllm.LLM(spec["model"], dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=64 << 20,
                   enforce_eager=True, gpu_memory_utilization=0.5, max_num_batched_tokens=2048, seed=0)
    prompts, params, keys = [], [], []
    for g, sp in enumerate(spec["grid"]):
        for j, prompt in enumerate(spec["prompts"]):
            for n in range(spec["samples"]):
                prompts.append(prompt)
                params.append(vllm.SamplingParams(**sp, max_tokens=spec["tokens"], ignore_eos=True, logprobs=0,
                                                  seed=100000 * g + 100 * j + n,
                                                  extra_args={"rlpatch_support": True}))
                keys.append(g)
    outs = llm.generate(prompts, params, use_tqdm=False)
    per = [[] for _ in spec["grid"]]
    for g, o in zip(keys, outs):
        s = o.outputs[0].rlpatch_support
        per[g].append({"log_mass_kept": list(s.log_mass_kept), "kept_count": list(s.kept_count)})
    print("RESULT " + json.dumps({"vllm": vllm.__version__, "per_setting": per, "engine": dict(s.engine)}), flush=True)
"""

PROMPTS = ["the quick cat sees", "12 + 7 =", "count: 3 4 5", "spell robot:", "the old teacher reads",
           "the small model updates the", "30 + 12 =", "the calm river"]
GRID = [dict(temperature=t, top_p=p, top_k=k, min_p=m) for t in (0.6, 0.7, 1.0, 1.3) for p in (1.0, 0.9, 0.5)
        for k in (0, 20) for m in (0.0, 0.05) if (p, k, m) != (1.0, 0, 0.0)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--out")
    args = ap.parse_args()
    from vllm_rlpatch.models import path

    model = path(args.model)
    spec = {"model": model, "grid": GRID, "prompts": PROMPTS, "samples": 8, "tokens": 48}
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_")}
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", ENGINE, json.dumps(spec)], capture_output=True, text=True, env=env,
                       timeout=3600)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise SystemExit((p.stdout + p.stderr)[-4000:])
    raw = json.loads(lines[-1][7:])
    rows = []
    for sp, samples in zip(GRID, raw["per_setting"]):
        lm = sorted(x for s in samples for x in s["log_mass_kept"])
        kc = [x for s in samples for x in s["kept_count"]]
        rows.append({**sp, "tokens": len(lm), "mean_log_mass_kept": statistics.fmean(lm),
                     "p10_log_mass_kept": lm[len(lm) // 10], "mean_kept_count": statistics.fmean(kc),
                     "mean_ratio_factor": statistics.fmean(math.exp(x) for x in lm)})
    result = {"tool": "benchmarks/sampling_support_bias.py", "vllm": raw["vllm"], "engine": raw["engine"],
              "model": args.model, "prompts": len(PROMPTS), "samples_per_prompt": 8, "tokens": 48,
              "seconds": time.time() - t0, "date": time.strftime("%Y-%m-%d"), "settings": rows}
    out = args.out or str(ROOT / "benchmarks" / "results" / f"sampling_support_bias-vllm{raw['vllm']}-cpu.json")
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print("| T | top-p | top-k | min-p | mean log S | 10th pct | mean kept size |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['temperature']} | {r['top_p']} | {r['top_k'] or 'off'} | {r['min_p'] or 'off'} | "
              f"{r['mean_log_mass_kept']:.4f} | {r['p10_log_mass_kept']:.4f} | {r['mean_kept_count']:.1f} |")
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
