"""``vllm-rlpatch demo``: doctor, then a short generate on an embedded model, showing what the plugin did.

Starts a real ``vllm.LLM`` on a shipped model (no download), samples at T=0.7 / top-p 0.9 with logprobs,
and reports: which vLLM processes loaded the plugin, the RL settings and their provenance, whether the
returned logprobs are those of the distribution that was actually sampled (tokens outside the top-p
nucleus must come back as -inf), and a weight reload bumping the weight version.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import vllm_rlpatch
from vllm_rlpatch import models
from vllm_rlpatch.hooks import config as config_hook
from vllm_rlpatch.tools import doctor, options, usermodel

PROMPTS = ["the quick cat sees", "12 + 7 =", "count: 3 4 5", "spell robot:", "the old teacher reads"]


def _step(i: int, n: int, msg: str) -> None:
    print(f"[{i}/{n}] {msg}", flush=True)


def _parse(argv: list[str]):
    ap = options.parser("vllm-rlpatch demo", __doc__.split("\n\n")[0].replace("``", ""))
    usermodel.add_model_options(ap, default=models.DEFAULT)
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    ap.add_argument("--top-p", type=float, default=0.9, help="top-p")
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens per sample")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    options.add_log_options(ap)
    args = ap.parse_args(argv)
    options.apply_log_options(args)
    if not 0 < args.top_p <= 1:
        ap.error("--top-p must be in (0, 1]")
    if args.temperature <= 0:
        ap.error("--temperature must be > 0 (the demo samples)")
    return args


def _generate(llm: Any, prompts: list, args) -> tuple[list[dict], int, int, float]:
    """(completions, positions with logprobs, positions where a token outside the nucleus came back -inf,
    seconds)."""
    import vllm

    sp = [vllm.SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                              logprobs=5, seed=args.seed + i) for i in range(len(PROMPTS))]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    t_gen = time.perf_counter() - t0
    positions = masked = 0
    completions = []
    for o in outs:
        c = o.outputs[0]
        completions.append({"prompt": o.prompt if o.prompt is not None else f"<{len(o.prompt_token_ids)} tokens>",
                            "text": c.text, "tokens": len(c.token_ids),
                            "finish_reason": c.finish_reason})
        for step in c.logprobs or []:
            positions += 1
            masked += any(v.logprob == -math.inf for v in step.values())
    return completions, positions, masked, t_gen


def _processes(status_dir: str) -> list[dict]:
    procs = []
    for p in sorted(Path(status_dir).glob("*.json")):
        d = json.loads(p.read_text())
        procs.append({"pid": d["pid"], "role": d["role"],
                      "applied": [x["name"] for x in d["patches"] if x["state"] == "applied"]})
    return procs


def _print_report(r: dict) -> None:
    print()
    print("completions:")
    for c in r["completions"]:
        print(f"  {c['prompt']!r} -> {c['text']!r} ({c['tokens']} tokens, {c['finish_reason']})")
    print()
    print("vLLM processes that loaded the plugin:")
    for p in r["processes"]:
        print(f"  pid {p['pid']:<7} {p['role']:<12} applied: {', '.join(p['applied']) or '-'}")
    print()
    mode = r["logprobs_mode"]
    s = r["settings"].get("logprobs_mode")
    print(f"logprobs_mode = {mode} ({s['source'] + ', ' + s['reason'] if s else 'stock vLLM'})")
    masked, positions = r["masked_positions"], r["positions"]
    frac = masked / positions if positions else 0.0
    verdict = ("returned logprobs are the sampled (behaviour-policy) distribution"
               if mode == "processed_logprobs" else
               "returned logprobs are RAW (T=1, no top-p): not the behaviour policy at these sampling settings")
    print(f"positions with tokens outside the top-p nucleus reported as -inf: {masked}/{positions} "
          f"({frac:.0%}) -> {verdict}")
    wv = r["weight_version"]
    print(f"weight version after one reload: frontend {wv['frontend']}, workers {wv['workers']}")
    print(f"engine start {r['seconds']['engine_start']:.1f} s, generate {r['seconds']['generate']:.2f} s")


@options.scoped_log_level
def main(argv: list[str]) -> int:
    args = _parse(argv)
    try:
        model = usermodel.resolve_for(args, "demo")
        budget = usermodel.prompt_budget(usermodel.default_max_model_len(model, 512), args.max_tokens)
    except usermodel.ToolError as e:
        print(f"vllm-rlpatch demo: {e}", file=sys.stderr)
        return 2

    n = 4
    status_dir = tempfile.mkdtemp(prefix="vllm-rlpatch-demo-")
    os.environ["VLLM_RLPATCH_STATUS_DIR"] = status_dir  # every vLLM process reports here
    _step(1, n, "doctor")
    report = doctor.collect()
    print(doctor.render(report), flush=True)

    _step(2, n, f"starting vLLM on {model} (engine start takes ~20-60 s on a CPU)")
    import vllm
    from vllm.platforms import current_platform

    kwargs = {}
    if current_platform.is_cpu():  # sized to the model: max_model_len = min(512, its positions)
        kwargs = usermodel.engine_args(model, cpu=True, seed=None, ours=512)
    prompts, cut = usermodel.fit_prompts(usermodel.tokenizer(model), PROMPTS, budget)
    if cut:
        print(f"  ({cut} prompt(s) cut to the {budget} tokens the context leaves)", flush=True)
    t0 = time.perf_counter()
    llm = vllm.LLM(model, **kwargs)
    t_start = time.perf_counter() - t0

    _step(3, n, f"generating {len(PROMPTS)} prompts at T={args.temperature}, top-p={args.top_p}")
    completions, positions, masked, t_gen = _generate(llm, prompts, args)
    mode = str(llm.llm_engine.vllm_config.model_config.logprobs_mode)
    settings = {k: s.as_dict() for k, s in config_hook.last_settings().items()}

    _step(4, n, "reloading weights (a weight update) and reading the weight version")
    llm.collective_rpc("reload_weights")
    frontend_version = vllm_rlpatch.updates_seen(llm)
    try:
        worker_versions = llm.collective_rpc("rlpatch_weight_version")
    except Exception as e:  # plugin disabled: no worker extension
        worker_versions = f"unavailable ({type(e).__name__})"

    r = {"doctor": report, "completions": completions, "processes": _processes(status_dir), "logprobs_mode": mode,
         "settings": settings, "masked_positions": masked, "positions": positions,
         "weight_version": {"frontend": frontend_version, "workers": worker_versions},
         "seconds": {"engine_start": t_start, "generate": t_gen}}
    _print_report(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0
