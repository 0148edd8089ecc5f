"""``vllm-rlpatch rollout-diff``: side A vs side B over repeated runs. Per statistic: both sides' run values, the
pooled difference B - A with a hierarchical bootstrap confidence interval (runs resampled, then samples within
each run), flagged only when the interval excludes 0 **and** the difference is larger than the run-to-run
range inside either side."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from vllm_rlpatch.tools import options, plot
from vllm_rlpatch.tools.rollout.runs import STATS, RolloutError, load_side, reference_model, run_values, stat


def _bootstrap(runs: list[dict], name: str, reps: int, rng) -> "Any":
    """Hierarchical bootstrap of the pooled statistic: runs with replacement, then samples within each."""
    import numpy as np

    out = np.empty(reps)
    sizes = [len(r["rows"]) for r in runs]
    offsets = np.cumsum([0] + sizes[:-1])
    pooled = {k: np.concatenate([r["arrays"][k] for r in runs]) for k in runs[0]["arrays"]}
    for i in range(reps):
        pick = rng.integers(0, len(runs), len(runs))
        idx = np.concatenate([offsets[j] + rng.integers(0, sizes[j], sizes[j]) for j in pick])
        out[i] = stat(name, pooled, idx)
    return out


def _pooled(runs: list[dict], name: str) -> float:
    import numpy as np

    pooled = {k: np.concatenate([r["arrays"][k] for r in runs]) for k in runs[0]["arrays"]}
    return stat(name, pooled, np.arange(len(pooled["length"])))


def compare(side_a: list[dict], side_b: list[dict], stats: tuple[str, ...] = STATS, reps: int = 1000,
            seed: int = 0) -> dict[str, dict[str, Any]]:
    """Per statistic: run values, within-side range, pooled difference B-A, bootstrap CI, flag."""
    import numpy as np

    rng = np.random.default_rng(seed)
    res = {}
    for name in stats:
        va, vb = run_values(side_a, name), run_values(side_b, name)
        if all(math.isnan(x) for x in va + vb):
            continue
        pa, pb = _pooled(side_a, name), _pooled(side_b, name)
        ba, bb = _bootstrap(side_a, name, reps, rng), _bootstrap(side_b, name, reps, rng)
        d = bb - ba
        d = d[~np.isnan(d)]
        lo, hi = (float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))) if len(d) else (math.nan, math.nan)
        spread = max(_range(va), _range(vb))
        diff = pb - pa
        ci_excludes_0 = lo > 0 or hi < 0
        res[name] = {"a_runs": va, "b_runs": vb, "a": pa, "b": pb, "diff": diff, "ci95": [lo, hi],
                     "within_side_range": spread, "ci_excludes_0": ci_excludes_0,
                     "flag": bool(ci_excludes_0 and abs(diff) > spread)}
    return res


def _range(v: list[float]) -> float:
    v = [x for x in v if not math.isnan(x)]
    return (max(v) - min(v)) if v else 0.0


def _describe(runs: list[dict]) -> dict[str, Any]:
    seeds = [r["seed"] for r in runs]
    return {"runs": [r["path"] for r in runs], "seeds": seeds, "vllm": sorted({str(r["vllm"]) for r in runs}),
            "rlpatch_enabled": sorted({bool((r["rlpatch"] or {}).get("enabled")) for r in runs}),
            "samples_per_run": [len(r["rows"]) for r in runs], "sampling": runs[0]["sampling"],
            "engine": runs[0]["engine"]}


def _check_sides(a: list[dict], b: list[dict]) -> list[str]:
    warnings = []
    for name, side in (("A", a), ("B", b)):
        seeds = [r["seed"] for r in side]
        if len(set(seeds)) < len(seeds):
            warnings.append(f"side {name} repeats a seed ({seeds}): identical runs add no spread")
    if {r["sampling"] and json.dumps(r["sampling"], sort_keys=True) for r in a} != \
            {r["sampling"] and json.dumps(r["sampling"], sort_keys=True) for r in b}:
        warnings.append("the sides were sampled with different parameters: " +
                        f"A {a[0]['sampling']} vs B {b[0]['sampling']}")
    return warnings


def table(res: dict[str, dict[str, Any]]) -> str:
    def side(v):
        v = [x for x in v if not math.isnan(x)]
        return f"{sum(v) / len(v):.4g} [{min(v):.4g}..{max(v):.4g}]" if v else "n/a"

    lines = [f"{'statistic':<26} {'A runs: mean [range]':<30} {'B runs: mean [range]':<30} {'B-A':>10}  "
             f"{'95% CI':<22} flag"]
    for name, r in res.items():
        ci = "[%+.3g, %+.3g]" % tuple(r["ci95"])
        lines.append(f"{name:<26} {side(r['a_runs']):<30} {side(r['b_runs']):<30} {r['diff']:>+10.4g}  {ci:<22} "
                     f"{'DIFFERENT' if r['flag'] else '-'}")
    return "\n".join(lines)


_VALUED = ("--reference", "--bootstrap", "--json", "--plot", "--stats", "--seed")


def _split(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """``A... -- B...`` with options anywhere: (A paths, B paths, options with their values)."""
    if "--" not in argv:
        raise RolloutError("separate the two sides with --: rollout-diff A1.jsonl A2.jsonl -- B1.jsonl B2.jsonl")
    i = argv.index("--")
    opts: list[str] = []
    sides = []
    for half in (argv[:i], argv[i + 1:]):
        paths = []
        it = iter(half)
        for x in it:
            if x.startswith("--"):
                opts.append(x)
                if x in _VALUED:
                    opts.append(next(it, ""))
            else:
                paths.append(x)
        sides.append(paths)
    return sides[0], sides[1], opts


def diff(argv: list[str]) -> int:
    ap = options.parser(prog="vllm-rlpatch rollout-diff",
                                 description="A vs B over repeated runs (>= 2 per side, different seeds).")
    ap.add_argument("--reference", help="model path: adds token_mult_prob_error against a float32 transformers "
                                        "reference with each run's sampling transform")
    ap.add_argument("--bootstrap", type=int, default=1000, help="bootstrap replicates")
    ap.add_argument("--stats", help="comma-separated subset of: " + ", ".join(STATS))
    ap.add_argument("--seed", type=int, default=0, help="bootstrap RNG seed")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--plot", help="PNG: each statistic's difference in units of the within-side range")
    if any(a in ("-h", "--help") for a in argv):
        ap.print_help()
        print("\npositional: A1.jsonl A2.jsonl ... -- B1.jsonl B2.jsonl ... (rollout-dump files, >= 2 per side)")
        return 0
    try:
        a_paths, b_paths, opts = _split(argv)
        args = ap.parse_args(opts)
        for f in [*a_paths, *b_paths]:
            if not Path(f).is_file():
                raise RolloutError(f"{f}: no such file")
        if len(a_paths) < 2 or len(b_paths) < 2:
            raise RolloutError(f"need >= 2 runs per side (got {len(a_paths)} and {len(b_paths)}): one run per side "
                               "has no run-to-run spread, so no difference can be told from noise")
        stats = tuple(s.strip() for s in args.stats.split(",")) if args.stats else STATS
        bad = [s for s in stats if s not in STATS]
        if bad:
            raise RolloutError(f"unknown statistic(s) {bad}; one of: {', '.join(STATS)}")
        if args.bootstrap < 100:
            raise RolloutError("--bootstrap must be >= 100")
        reference = reference_model(args.reference)
        if reference is None and "token_mult_prob_error" in stats:
            stats = tuple(s for s in stats if s != "token_mult_prob_error")
        side_a, side_b = load_side(a_paths, reference), load_side(b_paths, reference)
    except (RolloutError, ValueError) as e:
        print(f"vllm-rlpatch rollout-diff: {e}", file=sys.stderr)
        return 2
    warnings = _check_sides(side_a, side_b)
    res = compare(side_a, side_b, stats, args.bootstrap, args.seed)
    report = {"a": _describe(side_a), "b": _describe(side_b), "warnings": warnings, "bootstrap": args.bootstrap,
              "rule": "flag = the 95% bootstrap CI of B-A excludes 0 AND |B-A| > the larger run-to-run range "
                      "inside A or B", "stats": res}
    print(f"A: {len(side_a)} runs, vLLM {','.join(report['a']['vllm'])}, seeds {report['a']['seeds']}   "
          f"B: {len(side_b)} runs, vLLM {','.join(report['b']['vllm'])}, seeds {report['b']['seeds']}")
    for w in warnings:
        print(f"WARNING: {w}")
    print(table(res))
    flagged = [k for k, v in res.items() if v["flag"]]
    print(f"{len(flagged)} of {len(res)} statistics differ beyond the run-to-run spread"
          + (f": {', '.join(flagged)}" if flagged else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    if args.plot:
        if plot.available():
            plot.diff_plot(report, args.plot)
        else:
            print(plot.missing_message(f"vllm-rlpatch rollout-diff: plot {args.plot}"), file=sys.stderr)
    return 0
