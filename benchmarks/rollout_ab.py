"""Cross-version rollout A/B on real vLLM CPU, and the calibration of `vllm-rlpatch rollout-diff`.

    python benchmarks/rollout_ab.py OUTDIR [--versions 0.20.2,0.25.1,0.32.0] [--calibrate-on 0.32.0]

Uses the test environments (`ci/envs`, built by ci/build_env.sh) and the shipped llama-tiny weights; every
engine is started by `vllm-rlpatch rollout-dump` in that version's environment. Sampling: the embedded
prompts (16), n=4, T=0.7, top-p 0.9, max_tokens 64, EOS allowed.

1. Per version, stock (VLLM_RLPATCH_ENABLED=0) and with rlpatch (defaults): seeds 1, 2, 3.
   Diffs (with a float32 transformers reference for token_mult_prob_error): versions pairwise, stock and
   rlpatch separately; stock vs rlpatch per version.
2. Calibration on one version (rlpatch, max_tokens 16 so that the limit binds): seeds 1..12 of the baseline; null comparisons = random disjoint
   3-vs-3 splits of those 12 (the false-positive rate per statistic); planted differences, 6 seeds each:
   max_tokens -12.5 % (14; -10 % of 16 rounds to it), top-p 0.95, raw logprobs (logprobs_mode=raw_logprobs), ignore_eos; power = the share
   of random 3-vs-3 draws (baseline vs planted) flagged, per statistic. And max_tokens 10 vs 9, where the
   limit binds for most samples, with its own null calibration.
Writes OUTDIR/rollout_ab.json (summaries; the dumps stay in OUTDIR/dumps) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vllm_rlpatch.tools import rollout  # noqa: E402

COMMON = ["--embedded", "--num-prompts", "16", "--n", "4", "--temperature", "0.7", "--top-p", "0.9",
          "--max-tokens", "64"]
# Calibration baseline: max_tokens 16 (the embedded prompts' completions end at ~12 tokens, p90 ~15: a
# max_tokens of 64 would never bind, so "-10 %" would plant nothing)
CAL = ["--max-tokens", "16"]
PLANTED = {"max_tokens_14_vs_16": ["--max-tokens", "14"], "top_p_0.95": ["--top-p", "0.95"],
           "raw_logprobs": ["--engine-args", '{"logprobs_mode": "raw_logprobs"}'], "ignore_eos": ["--ignore-eos"]}


def env_python(version: str) -> str:
    out = subprocess.run(["bash", str(ROOT / "ci" / "envs" / "build_env.sh"), version], capture_output=True, text=True)
    py = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""
    if not py or not os.path.exists(py):
        sys.exit(f"no environment for vLLM {version}: {out.stderr[-2000:]}")
    return py


def dump(py: str, out: str, seeds: list[int], extra: list[str], stock: bool = False) -> float:
    if all(os.path.exists(out.format(seed=s)) for s in seeds):  # reuse the dumps of an earlier run
        return 0.0
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    if stock:
        env["VLLM_RLPATCH_ENABLED"] = "0"
    args = [py, "-m", "vllm_rlpatch.tools.cli", "rollout-dump", *COMMON, *extra, "--seeds", ",".join(map(str, seeds)),
            "--out", out]
    t = time.time()
    p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        sys.exit(f"rollout-dump failed: {' '.join(args)}\n{p.stderr[-4000:]}")
    return round(time.time() - t, 1)


def summary(res: dict) -> dict:
    return {k: {"a": v["a"], "b": v["b"], "diff": v["diff"], "ci95": v["ci95"], "a_runs": v["a_runs"],
                "b_runs": v["b_runs"], "within_side_range": v["within_side_range"], "flag": v["flag"]}
            for k, v in res.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--versions", default="0.20.2,0.25.1,0.32.0")
    ap.add_argument("--calibrate-on", default="0.32.0")
    ap.add_argument("--null-splits", type=int, default=200)
    ap.add_argument("--power-draws", type=int, default=100)
    ap.add_argument("--bootstrap", type=int, default=400)
    args = ap.parse_args()
    out = Path(args.outdir)
    d = out / "dumps"
    d.mkdir(parents=True, exist_ok=True)
    from vllm_rlpatch.models import path as model_path
    from vllm_rlpatch.tools.parity import Reference

    ref = Reference(model_path("llama-tiny"), "cpu")
    versions = args.versions.split(",")
    report: dict = {"sampling": COMMON, "versions": versions, "timings_s": {}, "diffs": {}, "calibration": {}}
    pys = {v: env_python(v) for v in set(versions) | {args.calibrate_on}}
    seeds = [1, 2, 3]
    sides = {}
    for v in versions:
        for cfg in ("stock", "rlpatch"):
            pattern = str(d / f"{v}-{cfg}-{{seed}}.jsonl")
            report["timings_s"][f"{v}-{cfg}"] = dump(pys[v], pattern, seeds, [], stock=cfg == "stock")
            sides[(v, cfg)] = rollout.load_side([pattern.format(seed=s) for s in seeds], ref)
            print(f"[dump] {v} {cfg}: {report['timings_s'][f'{v}-{cfg}']} s", flush=True)
    pairs = [((a, cfg), (b, cfg)) for cfg in ("rlpatch", "stock") for i, a in enumerate(versions)
             for b in versions[i + 1:]] + [((v, "stock"), (v, "rlpatch")) for v in versions]
    for a, b in pairs:
        name = f"{a[0]} {a[1]} vs {b[0]} {b[1]}"
        res = rollout.compare(sides[a], sides[b], reps=1000, seed=0)
        report["diffs"][name] = summary(res)
        print(f"\n=== {name}\n{rollout.table(res)}", flush=True)

    # calibration
    v = args.calibrate_on
    base_seeds = list(range(1, 13))
    pattern = str(d / f"cal-{v}-base-{{seed}}.jsonl")
    report["timings_s"]["cal-base"] = dump(pys[v], pattern, base_seeds, CAL)
    base = rollout.load_side([pattern.format(seed=s) for s in base_seeds], ref)
    rng = random.Random(0)
    stats = [s for s in rollout.STATS if s in rollout.compare(base[:2], base[2:4], reps=100)]
    fp = {s: 0 for s in stats}
    any_flag = 0
    for i in range(args.null_splits):
        pick = rng.sample(range(12), 6)
        res = rollout.compare([base[j] for j in pick[:3]], [base[j] for j in pick[3:]], tuple(stats),
                              reps=args.bootstrap, seed=i)
        for s, r in res.items():
            fp[s] += r["flag"]
        any_flag += any(r["flag"] for r in res.values())
    report["calibration"]["null"] = {"version": v, "baseline": COMMON + CAL, "baseline_seeds": base_seeds, "splits": args.null_splits,
                                     "design": "random disjoint 3-vs-3 splits of 12 baseline runs",
                                     "false_positive_rate": {s: round(fp[s] / args.null_splits, 4) for s in stats},
                                     "any_statistic_flagged_rate": round(any_flag / args.null_splits, 4)}
    print(f"\n=== null ({args.null_splits} splits): " + json.dumps(report["calibration"]["null"]["false_positive_rate"]),
          flush=True)
    report["calibration"]["planted"] = {}
    for name, extra in PLANTED.items():
        pseeds = list(range(101, 107))
        pat = str(d / f"cal-{v}-{name}-{{seed}}.jsonl")
        report["timings_s"][f"cal-{name}"] = dump(pys[v], pat, pseeds, CAL + extra)
        planted = rollout.load_side([pat.format(seed=s) for s in pseeds], ref)
        hits = {s: 0 for s in stats}
        for i in range(args.power_draws):
            a = rng.sample(base, 3)
            b = rng.sample(planted, 3)
            res = rollout.compare(a, b, tuple(stats), reps=args.bootstrap, seed=1000 + i)
            for s, r in res.items():
                hits[s] += r["flag"]
        full = rollout.compare(base, planted, tuple(stats), reps=1000, seed=7)
        report["calibration"]["planted"][name] = {
            "args": extra, "seeds": pseeds, "draws": args.power_draws,
            "power": {s: round(hits[s] / args.power_draws, 3) for s in stats},
            "all_runs_12_vs_6": summary(full)}
        print(f"\n=== planted {name}: power " + json.dumps(report["calibration"]["planted"][name]["power"]), flush=True)
    report["calibration"]["max_tokens_binding"] = binding_max_tokens(pys[v], d, ref, args.bootstrap)
    (out / "rollout_ab.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


def binding_max_tokens(py: str, d: Path, ref, reps: int) -> dict:
    """max_tokens -10 % where the limit binds for most samples: 10 vs 9 (completions end at ~12 tokens).
    Its own null calibration (200 splits of the 12 baseline runs) and power (100 draws)."""
    base_p, mt_p = str(d / "mt-base10-{seed}.jsonl"), str(d / "mt-9-{seed}.jsonl")
    dump(py, base_p, list(range(1, 13)), ["--max-tokens", "10"])
    dump(py, mt_p, list(range(101, 107)), ["--max-tokens", "9"])
    base = rollout.load_side([base_p.format(seed=s) for s in range(1, 13)], ref)
    mt9 = rollout.load_side([mt_p.format(seed=s) for s in range(101, 107)], ref)
    stats = tuple(s for s in rollout.STATS if s in rollout.compare(base[:2], base[2:4], reps=100))
    rng = random.Random(0)
    fp, anyf = {s: 0 for s in stats}, 0
    for i in range(200):
        pick = rng.sample(range(12), 6)
        res = rollout.compare([base[j] for j in pick[:3]], [base[j] for j in pick[3:]], stats, reps=reps, seed=i)
        for s, r in res.items():
            fp[s] += r["flag"]
        anyf += any(r["flag"] for r in res.values())
    hits = {s: 0 for s in stats}
    for i in range(100):
        res = rollout.compare(rng.sample(base, 3), rng.sample(mt9, 3), stats, reps=reps, seed=1000 + i)
        for s, r in res.items():
            hits[s] += r["flag"]
    full = rollout.compare(base, mt9, stats, reps=1000, seed=7)
    out = {"baseline": "max_tokens 10 (binds for most samples)", "baseline_seeds": list(range(1, 13)),
           "planted": "max_tokens 9 (-10 %)", "planted_seeds": list(range(101, 107)), "null_splits": 200,
           "false_positive_rate": {s: fp[s] / 200 for s in stats}, "any_statistic_flagged_rate": anyf / 200,
           "power_draws": 100, "power": {s: hits[s] / 100 for s in stats}, "all_runs_12_vs_6": summary(full)}
    print("\n=== max_tokens 10 vs 9: power " + json.dumps(out["power"]), flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
