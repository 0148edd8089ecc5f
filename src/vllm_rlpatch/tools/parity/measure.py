"""The numbers of ``vllm-rlpatch parity``: the agreement of one set of tokens (NeMo-RL's
``token_mult_prob_error``, a KL estimate, ...), each configuration's per-run and summary metrics, and the
`all` configuration's worst error (what ``--max-error`` checks)."""

from __future__ import annotations

import math
from typing import Any

from vllm_rlpatch.tools.parity.configs import BOUND, METRICS, PHASES, REFERENCES


def metrics(vllm_lps: list, ref_lps: list) -> dict[str, Any]:
    """Agreement of one set of tokens. A token whose logprob is non-finite (or <= -1e29, vLLM's -inf as
    reported) on either side counts in ``non_finite`` and is left out of the means."""
    finite, non_finite = [], 0
    for a, b in zip(vllm_lps, ref_lps):
        if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or a < -1e29 or b < -1e29:
            non_finite += 1
            continue
        finite.append((a, b))
    n = len(finite)
    if not n:
        return {"tokens": len(vllm_lps), "non_finite": non_finite, "token_mult_prob_error": float("nan"),
                "max_mult_prob_error": float("nan"), "mean_abs_diff": float("nan"), "kl_k3": float("nan"),
                "frac_outside_bound": float("nan")}
    errs = [math.exp(min(abs(a - b), 50.0)) for a, b in finite]
    k3 = [math.exp(min(b - a, 50.0)) - 1.0 - (b - a) for a, b in finite]
    return {"tokens": len(vllm_lps), "non_finite": non_finite,
            "token_mult_prob_error": sum(errs) / n, "max_mult_prob_error": max(errs),
            "mean_abs_diff": sum(abs(a - b) for a, b in finite) / n, "kl_k3": sum(k3) / n,
            "frac_outside_bound": sum(e > BOUND for e in errs) / n}


def _agg(values: list[float]) -> dict[str, Any]:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return {"mean": float("nan"), "spread": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    mean = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return {"mean": mean, "spread": sd, "min": min(vals), "max": max(vals), "n": len(vals)}


def score(res: dict, keep_samples: bool, references: tuple[str, ...] = REFERENCES) -> dict:
    per_run: list[dict] = []
    for run_ in res["runs"]:
        entry: dict[str, Any] = {"run": run_["run"], "refit": run_["refit"]}
        for phase in PHASES:
            g = run_[phase]
            vl = [x for s in g["samples"] for x in s["logprobs"]]
            m = {kind: metrics(vl, [x for s in g["samples"] for x in s["reference"][kind]]) for kind in references}
            for kind in references:
                m[kind]["tokens_per_s"] = g["tokens_per_s"]
                counts = [s.get("reference_counts", {}).get(kind) or {} for s in g["samples"]]
                if any(counts):
                    m[kind]["outside_support"] = sum(c.get("outside_support", 0) for c in counts)
                    m[kind]["at_boundary"] = sum(c.get("at_boundary", 0) for c in counts)
                masses = [x for c in counts for x in c.get("log_mass_kept", [])]
                if masses:
                    m[kind]["mean_log_mass_kept"] = sum(masses) / len(masses)
            ph = {"metrics": m, "seconds": g["seconds"], "tokens": g["tokens"], "tokens_per_s": g["tokens_per_s"],
                  "cached_prompt_tokens": sum((s.get("num_cached_tokens") or 0) for s in g["samples"])}
            if keep_samples:
                for s in g["samples"]:
                    s["reference"] = {k: [x if math.isfinite(x) else -1e30 for x in v] for k, v in s["reference"].items()}
                ph["samples"] = g["samples"]
            entry[phase] = ph
        per_run.append(entry)
    summary = {kind: {phase: {k: _agg([r[phase]["metrics"][kind].get(k) for r in per_run]) for k in METRICS}
                      for phase in PHASES} for kind in references}
    return {"engine": res.get("engine"), "patches": res.get("patches"), "env": res.get("env"),
            "startup_seconds": res.get("startup_seconds"), "refit_method": per_run[0]["refit"]["method"],
            "summary": summary, "runs": per_run, "log": res.get("log")}


def worst_all(report: dict, reference: str = "fp32") -> float | None:
    r = report["configs"].get("all")
    if r is None:
        return None
    return max(r["summary"][reference][p]["token_mult_prob_error"]["mean"] for p in PHASES)
