"""What the rollout commands share: rollout-dump files read back as runs, per-sample arrays every statistic
is a ratio of sums of, the statistics of a run (or of pooled runs), and the optional trainer-side reference
(``--reference MODEL``) for ``token_mult_prob_error``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from vllm_rlpatch.tools import usermodel
from vllm_rlpatch.tools.parity import Reference

BUCKETS = ((0, 16), (16, 32), (32, 64), (64, 128), (128, 1 << 30))
STATS = ("length_mean", "length_p90", "truncation_rate", "eos_rate", "abort_rate", "logprob_mean",
         "logprob_min_mean", *(f"logprob_pos_{a}_{b if b < 1 << 30 else 'end'}" for a, b in BUCKETS),
         "token_mult_prob_error")
HIGHER_IS_WORSE = {"token_mult_prob_error", "truncation_rate", "abort_rate"}


class RolloutError(ValueError):
    """Bad input (exit code 2)."""


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


def stat(name: str, a: dict, idx) -> float:
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

    return [stat(name, r["arrays"], np.arange(len(r["rows"]))) for r in runs]


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


def reference_model(arg: str | None):
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
