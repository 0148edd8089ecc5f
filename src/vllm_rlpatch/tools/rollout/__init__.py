"""Rollout A/B: dump samples, compare two sets of repeated runs, derive bounds from measured runs.

    vllm-rlpatch rollout-dump --model PATH --embedded|--prompts FILE [--n N] [--seed S | --seeds 1,2,3]
                              [--temperature T --top-p P --top-k K --max-tokens M --ignore-eos]
                              [--engine-args JSON] --out RUN.jsonl        (with --seeds: a {seed} in --out)
    vllm-rlpatch rollout-diff A1.jsonl A2.jsonl ... -- B1.jsonl B2.jsonl ... [--reference MODEL]
                              [--bootstrap N] [--json OUT] [--plot OUT.png]
    vllm-rlpatch bounds RUN.jsonl ... --metric NAME [--margin X] [--json OUT]

A *run* is one dump file: every prompt sampled ``n`` times with one seed. Statistics are computed per run
(generation length, truncation and EOS rates, mean and per-sample minimum logprob, mean logprob per position
bucket, and ``token_mult_prob_error`` against a trainer-side reference when one is given); a side is a set
of runs with different seeds. ``rollout-diff`` reports, per statistic, both sides' run values (mean and the
run-to-run range), the difference of the pooled statistic with a hierarchical bootstrap confidence interval
(runs resampled, then samples within each run) and flags a difference only when the interval excludes 0
**and** it is larger than the run-to-run range inside either side. ``bounds`` turns repeated runs into a
floor and a ceiling with the rule stated. One run per side, or identical seeds, are refused or flagged:
they give zero spread and prove nothing.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from vllm_rlpatch import envs, registry
from vllm_rlpatch.tools import options, parity, plot, usermodel
from vllm_rlpatch.tools.parity import Reference

BUCKETS = ((0, 16), (16, 32), (32, 64), (64, 128), (128, 1 << 30))
STATS = ("length_mean", "length_p90", "truncation_rate", "eos_rate", "abort_rate", "logprob_mean",
         "logprob_min_mean", *(f"logprob_pos_{a}_{b if b < 1 << 30 else 'end'}" for a, b in BUCKETS),
         "token_mult_prob_error")
HIGHER_IS_WORSE = {"token_mult_prob_error", "truncation_rate", "abort_rate"}


class RolloutError(ValueError):
    """Bad input (exit code 2)."""


# ------------------------------------------------------------------------------------------ dump
def _prompts(args) -> list[str] | None:
    """The prompts of --prompts FILE, or None for the embedded grammar's (made to fit the model later)."""
    if args.prompts:
        p = Path(args.prompts)
        if not p.is_file():
            raise RolloutError(f"--prompts {args.prompts}: no such file")
        out = []
        for i, line in enumerate(p.read_text().splitlines()):
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    out.append(json.loads(line)["prompt"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise RolloutError(f"{args.prompts}:{i + 1}: a JSON line needs a \"prompt\" field") from None
            else:
                out.append(line)
        if not out:
            raise RolloutError(f"--prompts {args.prompts}: no prompts in it")
        return out[: args.num_prompts] if args.num_prompts else out
    return None


def _fit(model: str, prompts: list[str] | None, num: int | None, max_model_len: int,
         max_tokens: int) -> tuple[list[Any], str | None]:
    """Prompts that fit ``max_model_len - max_tokens`` tokens of this model: the embedded grammar's with fewer
    sentences where needed, a user's cut to their last tokens (with a note saying how many)."""
    if prompts is None:
        (fitted,), note = parity.fitted_prompts(model, num or 16, 1, 1234, max_model_len, max_tokens, sentences=6)
        return fitted, note
    budget = usermodel.prompt_budget(max_model_len, max_tokens)
    fitted, cut = usermodel.fit_prompts(usermodel.tokenizer(model), prompts, budget)
    note = (f"{cut} of {len(prompts)} prompts were longer than the context leaves ({max_model_len} positions - "
            f"{max_tokens} generated = {budget} tokens) and were cut to their last {budget} tokens") if cut else None
    return fitted, note


def _engine_config(llm) -> dict[str, Any]:
    c = llm.llm_engine.vllm_config
    mc, cc, sc = c.model_config, c.cache_config, c.scheduler_config
    return {"logprobs_mode": str(getattr(mc, "logprobs_mode", None)), "dtype": str(mc.dtype),
            "generation_config": getattr(mc, "generation_config", None), "max_model_len": mc.max_model_len,
            "enable_prefix_caching": cc.enable_prefix_caching, "async_scheduling": sc.async_scheduling,
            "kv_cache_memory_bytes": getattr(cc, "kv_cache_memory_bytes", None), "head_dtype": _head_dtype(mc)}


def _head_dtype(mc) -> str:
    hf = getattr(mc, "hf_overrides", None)
    if isinstance(hf, dict) and "head_dtype" in hf:
        return str(hf["head_dtype"])

    st = {s.name: s.state for s in registry.status()}
    return "float32 (fp32_lm_head, in the workers)" if st.get("fp32_lm_head") == "applied" else "model dtype"


def _rlpatch_status() -> dict[str, Any]:
    st = registry.status()
    return {"enabled": bool(envs.ENABLED.get()), "applied": sorted(s.name for s in st if s.state == "applied")}


@options.scoped_log_level
def dump(argv: list[str]) -> int:
    ap = options.parser("vllm-rlpatch rollout-dump", "Sample every prompt n times with one seed per run; one JSON "
                        "line per sample.")
    usermodel.add_model_options(ap, default="llama-tiny")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--prompts", help="a text file (one prompt per line) or JSONL with a \"prompt\" field")
    g.add_argument("--embedded", action="store_true", help="the embedded grammar's prompts (the default)")
    ap.add_argument("--num-prompts", type=int, default=None, help="use the first K prompts (embedded: 16)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--seed", type=int, default=None, help="seed of this run (default 1)")
    ap.add_argument("--seeds", default=None, help="several runs from one engine: 1,2,3 (--out needs {seed})")
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    ap.add_argument("--top-p", type=float, default=0.9, help="top-p")
    ap.add_argument("--top-k", type=int, default=0, help="top-k, 0 = off")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per sample")
    ap.add_argument("--ignore-eos", action="store_true", help="every sample has --max-tokens tokens")
    ap.add_argument("--engine-args", default=None, help="JSON dict of vllm.LLM arguments (override the defaults)")
    ap.add_argument("--out", required=True, help="RUN.jsonl (with --seeds: a path containing {seed}; {run} is the "
                                                 "run's index)")
    options.add_log_options(ap)
    args = ap.parse_args(argv)
    options.apply_log_options(args)
    try:
        if args.seeds and args.seed is not None:
            raise RolloutError("give --seed or --seeds, not both")
        try:
            seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [1 if args.seed is None else args.seed]
        except ValueError:
            raise RolloutError(f"--seeds {args.seeds!r}: comma-separated whole numbers, e.g. 1,2,3") from None
        if len(seeds) > 1 and "{seed}" not in args.out:
            raise RolloutError("with several --seeds, --out must contain {seed} (one file per run)")
        if len(set(seeds)) < len(seeds) and "{run}" not in args.out:
            raise RolloutError("a seed repeats in --seeds: add {run} (the run's index) to --out so no run overwrites another")
        for name, v, lo in (("--n", args.n, 1), ("--max-tokens", args.max_tokens, 1)):
            if v < lo:
                raise RolloutError(f"{name} must be >= {lo}")
        if not 0 < args.top_p <= 1 or args.temperature < 0:
            raise RolloutError("--top-p must be in (0, 1] and --temperature >= 0")
        extra = {}
        if args.engine_args:
            try:
                extra = json.loads(args.engine_args)
                assert isinstance(extra, dict)
            except (json.JSONDecodeError, AssertionError):
                raise RolloutError(f"--engine-args {args.engine_args!r} is not a JSON object") from None
        model = usermodel.resolve(args.model, allow_download=args.allow_download)
        prompts = _prompts(args)
        usermodel.require_vllm("rollout-dump")
        kw = parity.default_engine_args(model, extra)
        prompts, note = _fit(model, prompts, args.num_prompts, kw["max_model_len"], args.max_tokens)
    except (RolloutError, usermodel.ToolError) as e:
        print(f"vllm-rlpatch rollout-dump: {e}", file=sys.stderr)
        return 2
    import vllm

    if note:
        print(f"[rollout-dump] {note}", file=sys.stderr, flush=True)
    t0 = time.time()
    print(f"[rollout-dump] starting vLLM {vllm.__version__} on {model}", file=sys.stderr, flush=True)
    llm = vllm.LLM(model=model, **kw)
    eng = _engine_config(llm)
    status = _rlpatch_status()
    tok = llm.get_tokenizer()
    eos_ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "n": args.n}
    for run, seed in enumerate(seeds):
        sps = [vllm.SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                                   top_k=args.top_k if args.top_k > 0 else 0,
                                   max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, logprobs=0,
                                   seed=seed * 100003 + i) for i in range(len(prompts))]
        t = time.time()
        outs = llm.generate(prompts, sps, use_tqdm=False)
        path = Path(args.out.format(seed=seed, run=run))
        path.parent.mkdir(parents=True, exist_ok=True)
        n_tok = 0
        with path.open("w") as f:
            for i, o in enumerate(outs):
                for j, c in enumerate(o.outputs):
                    lps = [(step[t].logprob if t in step else None) for t, step in zip(c.token_ids, c.logprobs or [])]
                    lps = [None if (x is None or not math.isfinite(x)) else x for x in lps]
                    ids = list(c.token_ids)
                    n_tok += len(ids)
                    eos = (c.finish_reason == "stop" and c.stop_reason is None) or any(t in eos_ids for t in ids)
                    f.write(json.dumps({"seed": seed, "prompt_id": f"p{i}", "sample": j,
                                        "prompt_token_ids": list(o.prompt_token_ids), "token_ids": ids,
                                        "logprobs": lps, "finish_reason": c.finish_reason, "length": len(ids),
                                        "eos": bool(eos), "vllm": vllm.__version__, "rlpatch": status,
                                        "engine": eng, "sampling": sampling, "model": model}) + "\n")
        print(f"[rollout-dump] seed {seed}: {len(prompts)} prompts x {args.n} -> {n_tok} tokens in "
              f"{time.time() - t:.1f}s -> {path}", file=sys.stderr, flush=True)
    print(f"[rollout-dump] done in {time.time() - t0:.1f}s", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------ statistics
def load_run(path: str) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        raise RolloutError(f"{path}: no such file")
    rows = []
    for i, line in enumerate(p.read_text().splitlines()):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise RolloutError(f"{path}:{i + 1}: not a JSON line (is this a rollout-dump file?)") from None
    if not rows or "token_ids" not in rows[0]:
        raise RolloutError(f"{path}: no samples (is this a rollout-dump file?)")
    return rows


def _arrays(rows: list[dict[str, Any]], errs: list[list[float]] | None = None):
    """Per-sample numbers every statistic is a ratio of sums of (so resampling is vectorised)."""
    import numpy as np

    n = len(rows)
    a = {k: np.zeros(n) for k in ("length", "trunc", "eos", "abort", "lp_sum", "lp_n", "lp_min", "lp_has",
                                  "err_sum", "err_n")}
    for b in range(len(BUCKETS)):
        a[f"b{b}_sum"], a[f"b{b}_n"] = np.zeros(n), np.zeros(n)
    for i, r in enumerate(rows):
        a["length"][i] = r["length"]
        a["trunc"][i] = r["finish_reason"] == "length"
        a["abort"][i] = r["finish_reason"] == "abort"
        a["eos"][i] = bool(r.get("eos"))
        lps = [(pos, x) for pos, x in enumerate(r["logprobs"]) if x is not None and x > -1e29]
        if lps:
            a["lp_sum"][i] = sum(x for _, x in lps)
            a["lp_n"][i] = len(lps)
            a["lp_min"][i] = min(x for _, x in lps)
            a["lp_has"][i] = 1
        for pos, x in lps:
            for b, (lo, hi) in enumerate(BUCKETS):
                if lo <= pos < hi:
                    a[f"b{b}_sum"][i] += x
                    a[f"b{b}_n"][i] += 1
        if errs is not None and errs[i]:
            a["err_sum"][i] = sum(errs[i])
            a["err_n"][i] = len(errs[i])
    return a


def _stat(name: str, a: dict, idx) -> float:
    import numpy as np

    def ratio(num, den):
        d = den[idx].sum()
        return float(num[idx].sum() / d) if d else float("nan")

    one = np.ones(len(a["length"]))
    if name == "length_mean":
        return ratio(a["length"], one)
    if name == "length_p90":
        return float(np.percentile(a["length"][idx], 90)) if len(idx) else float("nan")
    if name == "truncation_rate":
        return ratio(a["trunc"], one)
    if name == "eos_rate":
        return ratio(a["eos"], one)
    if name == "abort_rate":
        return ratio(a["abort"], one)
    if name == "logprob_mean":
        return ratio(a["lp_sum"], a["lp_n"])
    if name == "logprob_min_mean":
        return ratio(a["lp_min"], a["lp_has"])
    if name.startswith("logprob_pos_"):
        b = [f"logprob_pos_{lo}_{hi if hi < 1 << 30 else 'end'}" for lo, hi in BUCKETS].index(name)
        return ratio(a[f"b{b}_sum"], a[f"b{b}_n"])
    if name == "token_mult_prob_error":
        return ratio(a["err_sum"], a["err_n"])
    raise RolloutError(f"unknown statistic {name!r}; one of: {', '.join(STATS)}")


def run_values(runs: list[dict], name: str) -> list[float]:
    import numpy as np

    return [_stat(name, r["arrays"], np.arange(len(r["rows"]))) for r in runs]


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
        out[i] = _stat(name, pooled, idx)
    return out


def _pooled(runs: list[dict], name: str) -> float:
    import numpy as np

    pooled = {k: np.concatenate([r["arrays"][k] for r in runs]) for k in runs[0]["arrays"]}
    return _stat(name, pooled, np.arange(len(pooled["length"])))


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


def load_side(paths: list[str], reference: Any = None) -> list[dict]:
    runs = []
    for p in paths:
        rows = load_run(p)
        errs = _reference_errors(rows, reference) if reference is not None else None
        runs.append({"path": p, "rows": rows, "arrays": _arrays(rows, errs), "seed": rows[0].get("seed"),
                     "vllm": rows[0].get("vllm"), "rlpatch": rows[0].get("rlpatch"), "sampling": rows[0].get("sampling"),
                     "engine": rows[0].get("engine")})
    return runs


def _reference_errors(rows: list[dict], reference: Any) -> list[list[float]]:
    out = []
    for r in rows:
        ref, _ = reference.logprobs("fp32", r["prompt_token_ids"], r["token_ids"], r["sampling"])
        errs = []
        for a, b in zip(r["logprobs"], ref):
            if a is None or b is None or a < -1e29 or b < -1e29 or not math.isfinite(b):
                continue
            errs.append(math.exp(min(abs(a - b), 50.0)))
        out.append(errs)
    return out


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
        reference = _reference(args.reference)
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


def _reference(arg: str | None):
    """A float32 transformers reference for ``--reference MODEL`` (resolved like ``--model``), or None.
    Raises a one-line error for a model that cannot be used or an environment without torch/transformers."""
    if not arg:
        return None
    import importlib.util

    path = usermodel.resolve(arg, flag="--reference")
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise RolloutError(f"--reference needs {' and '.join(missing)} (pip install torch transformers)")
    return Reference(path, "cpu")


# ------------------------------------------------------------------------------------------ bounds
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
        reference = _reference(args.reference)
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
