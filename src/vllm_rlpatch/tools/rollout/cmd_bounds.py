"""``vllm-rlpatch bounds``: a floor and a ceiling for one statistic from repeated measured runs, with the rule
stated (``[min - margin x range, max + margin x range]``) and warnings when the runs cannot show a spread."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from vllm_rlpatch.tools import options
from vllm_rlpatch.tools.rollout.runs import (
    HIGHER_IS_WORSE,
    STATS,
    RolloutError,
    load_side,
    reference_model,
    run_values,
)


def bounds(argv: list[str]) -> int:
    ap = options.parser(prog="vllm-rlpatch bounds",
                                 description="A floor and a ceiling for one statistic from repeated measured runs.")
    ap.add_argument("runs", nargs="+", help="rollout-dump files (different seeds)")
    ap.add_argument("--metric", required=True, help="one of: " + ", ".join(STATS))
    ap.add_argument("--margin", type=float, default=0.5,
                    help="bounds = [min - m x range, max + m x range] of the run values (default 0.5)")
    ap.add_argument("--reference", help="model path (needed for token_mult_prob_error)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    try:
        if args.metric not in STATS:
            raise RolloutError(f"unknown metric {args.metric!r}; one of: {', '.join(STATS)}")
        if args.margin < 0:
            raise RolloutError("--margin must be >= 0")
        for f in args.runs:
            if not Path(f).is_file():
                raise RolloutError(f"{f}: no such file")
        if len(args.runs) < 2:
            raise RolloutError("need >= 2 runs (different seeds): one run has no spread to set a bound from")
        if args.metric == "token_mult_prob_error" and not args.reference:
            raise RolloutError("token_mult_prob_error needs --reference MODEL")
        reference = reference_model(args.reference)
        runs = load_side(args.runs, reference)
    except (RolloutError, ValueError) as e:
        print(f"vllm-rlpatch bounds: {e}", file=sys.stderr)
        return 2
    vals = run_values(runs, args.metric)
    lo, hi = min(vals), max(vals)
    rng = hi - lo
    n = len(vals)
    mean = sum(vals) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
    seeds = [r["seed"] for r in runs]
    warnings = []
    if n < 3:
        warnings.append(f"n={n}: fewer than 3 runs is not evidence of the spread")
    if len(set(seeds)) < n:
        warnings.append(f"repeated seeds {seeds}: identical runs understate the spread")
    if rng == 0:
        warnings.append("zero spread: the bound is the measured value itself (identical runs, or a statistic "
                        "fixed by the sampling parameters)")
    res = {"metric": args.metric, "n": n, "seeds": seeds, "values": vals, "min": lo, "max": hi, "mean": mean,
           "sd": sd, "range": rng, "margin": args.margin, "floor": lo - args.margin * rng,
           "ceiling": hi + args.margin * rng,
           "rule": f"[min - {args.margin} x range, max + {args.margin} x range] over {n} measured runs",
           "warnings": warnings}
    print(f"{args.metric}: n={n} runs (seeds {seeds}), observed {lo:.6g}..{hi:.6g} (mean {mean:.6g}, sd {sd:.3g})")
    print(f"  floor   {res['floor']:.6g}\n  ceiling {res['ceiling']:.6g}\n  rule    {res['rule']}")
    if args.metric in HIGHER_IS_WORSE:
        print("  (a ceiling is the usual check for this metric; the floor catches a change that makes it "
              "suspiciously good, e.g. a reference that no longer matches what it should)")
    for w in warnings:
        print(f"WARNING: {w}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0
