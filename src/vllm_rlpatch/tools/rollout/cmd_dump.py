"""``vllm-rlpatch rollout-dump``: sample every prompt ``n`` times with one seed per run, from one engine; one
JSON line per sample (tokens, logprobs, finish reason, the engine's RL settings and the plugin's state)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from vllm_rlpatch import envs, registry
from vllm_rlpatch.tools import options, parity, usermodel
from vllm_rlpatch.tools.rollout.runs import RolloutError


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


def fit_to_context(model: str, prompts: list[str] | None, num: int | None, max_model_len: int,
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


def _parser() -> argparse.ArgumentParser:
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
    return ap


def _prepare(args) -> tuple[list[int], str, dict[str, Any], list[Any], str | None]:
    """(seeds, model directory, engine arguments, prompts fitted to the context, a note on the fitting)."""
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
    prompts, note = fit_to_context(model, prompts, args.num_prompts, kw["max_model_len"], args.max_tokens)
    return seeds, model, kw, prompts, note


@options.scoped_log_level
def dump(argv: list[str]) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    options.apply_log_options(args)
    try:
        seeds, model, kw, prompts, note = _prepare(args)
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
        _sample_run(llm, prompts, args, run, seed, {"vllm": vllm.__version__, "rlpatch": status, "engine": eng,
                                                    "sampling": sampling, "model": model}, eos_ids)
    print(f"[rollout-dump] done in {time.time() - t0:.1f}s", file=sys.stderr)
    return 0


def _sample_run(llm, prompts: list[Any], args, run: int, seed: int, meta: dict[str, Any], eos_ids: set) -> None:
    """One run (one seed): every prompt sampled ``args.n`` times, one JSON line per sample."""
    import vllm

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
                                    "eos": bool(eos), **meta}) + "\n")
    print(f"[rollout-dump] seed {seed}: {len(prompts)} prompts x {args.n} -> {n_tok} tokens in "
          f"{time.time() - t:.1f}s -> {path}", file=sys.stderr, flush=True)
