"""The text of ``vllm-rlpatch parity``: the table per reference, the twin's and the support information's
lines, the legend; and the report made JSON-safe."""

from __future__ import annotations

import math
from typing import Any

from vllm_rlpatch.tools.parity.configs import BOUND, PHASES


def _fmt(a: dict, digits: int = 4, pct: bool = False, count: bool = False) -> str:
    m = a["mean"]
    if m is None or (isinstance(m, float) and math.isnan(m)):
        return "n/a"
    if count:  # a count: an integer for one run, a mean with one decimal over several
        return f"{round(m)}" if a["n"] <= 1 else f"{m:.1f}±{a['spread']:.1f}"
    if pct:
        s = f"{100 * m:.1f}%"
        return s + (f"±{100 * a['spread']:.1f}" if a["n"] > 1 else "")
    s = f"{m:.{digits}f}"
    return s + (f"±{a['spread']:.{digits}f}" if a["n"] > 1 else "")


def table(report: dict, reference: str = "fp32") -> str:
    cols = ["config", "phase", "mult_prob_err", "max", "mean|Δlp|", "KL(k3)", f">{BOUND}", "non-finite",
            "tok/s"]
    rows = []
    for name, r in report["configs"].items():
        for phase in PHASES:
            s = r["summary"][reference][phase]
            rows.append([name if phase == "before_refit" else "", phase.replace("_", " "),
                         _fmt(s["token_mult_prob_error"]), _fmt(s["max_mult_prob_error"], 3),
                         _fmt(s["mean_abs_diff"]), _fmt(s["kl_k3"], 5), _fmt(s["frac_outside_bound"], pct=True),
                         _fmt(s["non_finite"], count=True), _fmt(s["tokens_per_s"], 0)])
    widths = [max(len(str(x[i])) for x in rows + [cols]) for i in range(len(cols))]
    line = lambda xs: "  ".join(str(x).ljust(w) if i < 2 else str(x).rjust(w) for i, (x, w) in enumerate(zip(xs, widths)))
    out = [line(cols), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def render(report: dict) -> str:
    s = report["sampling"]
    head = (f"vllm-rlpatch parity: vLLM {report['vllm']} on {report['device']}, model {report['model']}\n"
            f"sampling T={s['temperature']} top_p={s['top_p']} top_k={s['top_k'] or 'off'} max_tokens={s['max_tokens']}; "
            f"{report['prompts']} prompts x {report['runs']} run(s); weights after refit: "
            f"{report['weights_after_refit']['how']}")
    if report.get("prompt_note"):
        head += f"\n{report['prompt_note']}"
    parts = [head]
    for ref in report["references"]:
        parts.append("")
        parts.append(f"reference: {report['references'][ref]}")
        parts.append(table(report, ref))
    for name in ("twin", "support"):
        r = report["configs"].get(name)
        if r is None:
            continue
        s0 = r["summary"][main_reference(report)]
        if name == "twin":
            parts.append(f"twin: {_fmt(s0['before_refit']['outside_support'], count=True)} / "
                         f"{_fmt(s0['after_refit']['outside_support'], count=True)} tokens (before / after refit) outside "
                         f"its own support, {_fmt(s0['before_refit']['at_boundary'], count=True)} / "
                         f"{_fmt(s0['after_refit']['at_boundary'], count=True)} at its boundary (near-ties)")
        else:
            parts.append(f"log(S) bias: the kept set's mean log mass per token is "
                         f"{_fmt(s0['before_refit']['mean_log_mass_kept'])} (before refit): a trainer that uses "
                         f"full-vocabulary logprobs at the rollout temperature is off by that much per token")
    parts.append("")
    parts.append("configurations: " + "; ".join(f"{k} = {v}" for k, v in report["config_doc"].items()))
    if report.get("jobs", 1) > 1:
        parts.append(f"tok/s measured with {report['jobs']} engines running at once (--jobs): compare with care")
    runs = report["runs"]
    parts.append(f"mult_prob_err = NeMo-RL's token_mult_prob_error, mean exp(|Δ logprob|) (1 = identical; its "
                 f"bound is {BOUND}); max = largest per-token value; >{BOUND} = share of tokens above the bound; "
                 "non-finite = tokens with -inf on one side; tok/s = generation after a warm-up; "
                 + (f"values are mean±sd over {runs} runs" if runs > 1 else "one run (--runs N gives mean±sd)"))
    return "\n".join(parts)


def main_reference(report: dict) -> str:
    return "fp32" if "fp32" in report["references"] else next(iter(report["references"]))


def json_safe(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: json_safe(v) for k, v in o.items()}
    if isinstance(o, list):
        return [json_safe(v) for v in o]
    return o
