"""The trainer twin's Model Runner V2 branch against vLLM itself on a GPU (issue 22): the twin, given the logits
MRv2's sampler received, must reproduce every processed logprob vLLM returned. Writes one JSON.

    python benchmarks/gpu/mrv2_twin.py OUT.json [--allow-v1] [--prompts N] [--tokens N] [--keep DIR]

One engine (tests/scripts/support_engine.py: llama-tiny from the package, bf16, enforce_eager) serves the grid of
tests/test_sampling_support.py: T in {0.6, 1.0, 1.3} x top-p in {1, 0.9, 0.5} x top-k in {0, 20} x min-p in
{0, 0.05}, without and with repetition/presence/frequency penalties (72 settings), `--prompts` prompts x
`--tokens` tokens each (default 8 x 25: 200 sampled tokens per setting), processed logprobs (the plugin's
default). The worker captures the logits its sampler received (tests/helpers_ext.py SupportCaptureExtension: on
MRv2 it wraps Sampler.__call__). Here, on the CPU in fp32, `vllm_rlpatch.trainer.processed_logprobs` runs on
those logits with the engine's rules (`engine={"vllm", "runner", "device"}` as the engine ran) and, to show
what the branch decides, with the other runner's rules too.

Checks: `runner` (the engine ran Model Runner V2: vLLM's "Using V2 Model Runner" line; `--allow-v1` records it
without failing, for a run on a CPU); `twin_matches` (every returned processed logprob within 1e-5 of the
twin's, no token outside the twin's support); `rows_captured` (a captured logits row for every sampled token).
Exit status 0 when every check passed, 1 otherwise (the JSON is written either way), 2 on bad arguments.

`explain` (information, not a check): for every token over the tolerance in a setting without penalties, the row
the engine's top-k/top-p stage received is rebuilt (logits / T, min-p masked in logit space) and given to vLLM's
own `apply_top_k_top_p` (MRv2's call; on a GPU the Triton kernel topk_topp_triton.py) and to its PyTorch
implementation: how many rows keep as many tokens as the engine did (from its returned logprob) with each.
`--from DIR` redoes the comparison and `explain` from a kept run (`--keep DIR` of a GPU run: engine.log, logits.pt)
on this machine; without a GPU the Triton kernel runs in Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (ROOT / "tests", ROOT / "ci" / "sweep"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

PROMPTS = ["the quick cat sees", "12 + 7 =", "count: 3 4 5", "spell robot:", "the old teacher reads",
           "the small model updates the", "30 + 12 =", "the calm river"]  # tests/test_sampling_support.py
PENALTIES = {"repetition_penalty": 1.2, "presence_penalty": 0.4, "frequency_penalty": 0.2}
GRID = [dict(temperature=t, top_p=p, top_k=k, min_p=m, **(PENALTIES if pen else {}))
        for t in (0.6, 1.0, 1.3) for p in (1.0, 0.9, 0.5) for k in (0, 20) for m in (0.0, 0.05)
        for pen in (False, True)]
MRV2_LOG = "Using V2 Model Runner"  # vllm/v1/worker/gpu_worker.py (0.32.0)
TOL = 1e-5


def say(msg: str) -> None:
    print(f"[mrv2-twin {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def label(sp: dict) -> str:
    return (f"T={sp['temperature']} p={sp['top_p']} k={sp['top_k']} min_p={sp['min_p']}"
            + (" pen" if "repetition_penalty" in sp else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the JSON to write")
    ap.add_argument("--allow-v1", action="store_true", help="do not fail when the engine ran the V1 runner (CPU)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per setting (1-8, default 8)")
    ap.add_argument("--tokens", type=int, default=25, help="sampled tokens per request (default 25)")
    ap.add_argument("--keep", metavar="DIR", help="keep the spec, the captured logits and the engine's log here")
    ap.add_argument("--from", dest="from_dir", metavar="DIR",
                    help="no engine: read a kept run's engine.log and logits.pt (from --keep) and compare again")
    ap.add_argument("--engine-info", action="store_true",
                    help="requests ask for rlpatch_support; also check the twin given it (engine_info)")
    ap.add_argument("--dump-rows", metavar="FILE",
                    help="save the rows `explain` rebuilds (top-k/top-p input, k, p) for mrv2_top_p_interp.py --rows")
    a = ap.parse_args(argv)
    if not 1 <= a.prompts <= len(PROMPTS) or a.tokens < 1:
        print(f"error: --prompts must be 1-{len(PROMPTS)} and --tokens >= 1", file=sys.stderr)
        return 2
    try:
        import torch
        import vllm
    except Exception as e:  # noqa: BLE001
        print(f"error: this python has no working vLLM: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    from support.env import model_path
    from probe import run_script_args

    from vllm_rlpatch.trainer import processed_logprobs

    t_start = time.perf_counter()
    # --from reads a kept run where it is; otherwise the engine's files go to --keep or a temporary folder
    work = Path(a.from_dir) if a.from_dir else Path(a.keep or tempfile.mkdtemp(prefix="rlpatch-mrv2-twin-"))
    if not a.from_dir:
        work.mkdir(parents=True, exist_ok=True)
    out: dict = {"check": "mrv2_twin", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 "vllm": vllm.__version__, "torch": torch.__version__,
                 "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                 "settings": len(GRID), "prompts": a.prompts, "tokens": a.tokens, "checks": {}, "failures": []}

    def finish(rc_ok: bool) -> int:
        out["ok"] = rc_ok and not out["failures"]
        out["seconds"] = round(time.perf_counter() - t_start, 1)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1, sort_keys=True, default=str) + "\n")
        say(f"{'PASS' if out['ok'] else 'FAIL ' + ', '.join(out['failures'])} ({out['seconds']} s) -> {a.out}")
        return 0 if out["ok"] else 1

    cap = work / "logits.pt"
    t0 = time.perf_counter()
    if a.from_dir:
        try:
            log = (work / "engine.log").read_text()
        except OSError as e:
            print(f"error: --from {work}: {e.strerror}: {e.filename}", file=sys.stderr)
            return 2
        line = next((ln for ln in log.splitlines() if ln.startswith("RESULT ")), None)
        r = json.loads(line[len("RESULT "):]) if line else None
        if r is not None:  # the kept run's prompts per setting, not this call's --prompts
            a.prompts = max(1, len(r["requests"]) // len(GRID))
            out["prompts"] = a.prompts
        out["from"] = str(work)
        say(f"from {work}: {len(r['requests']) if r else 0} requests")
    else:
        ask = {"extra_args": {"rlpatch_support": True}} if a.engine_info else {}
        reqs = [{"prompt": PROMPTS[j], "sampling": {**sp, "max_tokens": a.tokens, "ignore_eos": True, "logprobs": 0,
                                                    "seed": 1000 * g + j, **ask}}
                for g, sp in enumerate(GRID) for j in range(a.prompts)]
        # every prompt prefilled in one step (no chunked prefill: a captured row is then a sampled token)
        spec = {"engine": {"model": model_path(), "max_num_batched_tokens": 16384, "max_num_seqs": 1024,
                           "kv_cache_memory_bytes": 256 << 20},
                "requests": reqs, "capture": str(cap)}
        say(f"engine: {len(reqs)} requests ({len(GRID)} settings x {a.prompts} prompts x {a.tokens} tokens)")
        f = work / "spec.json"
        f.write_text(json.dumps(spec))
        r, log = run_script_args("support_engine.py", [str(f)], work, timeout=900)
        (work / "engine.log").write_text(log)
    out["engine_s"] = round(time.perf_counter() - t0, 1)
    if r is None:
        out["failures"].append("engine")
        out["error"] = "support_engine.py gave no RESULT: " + " | ".join(log.strip().splitlines()[-5:])
        return finish(False)
    mrv2 = MRV2_LOG in log
    runner = "mrv2" if mrv2 else "v1"
    device = "cuda" if torch.cuda.is_available() or (a.from_dir and mrv2) else "cpu"
    out["checks"]["runner"] = {"ok": mrv2, "runner": runner, "log_line": MRV2_LOG if mrv2 else None,
                               "startup_s": r.get("startup_s"), "logprobs_mode": r.get("logprobs_mode")}
    if not mrv2 and not a.allow_v1:
        out["failures"].append("runner")

    captured = torch.load(cap)
    by_rid: dict = {}
    for (rid, pos), row in captured.items():
        by_rid.setdefault(rid, {})[pos] = row
    logits, toks, sps, prompts, returned, setting, infos = [], [], [], [], [], [], []
    missing = 0
    for i, o in enumerate(r["requests"]):
        c = o["outputs"][0]
        ext = o["request_id"]
        rows = next((v for k, v in by_rid.items() if k == ext or k.rsplit("-", 1)[0] == ext), None)
        if rows is None or any(p not in rows for p in range(len(c["token_ids"]))):
            missing += 1
            continue
        logits.append(torch.stack([rows[p] for p in range(len(c["token_ids"]))]))
        toks.append(c["token_ids"])
        g = i // a.prompts
        sps.append(GRID[g])
        setting.append(g)
        prompts.append(o["prompt_token_ids"])
        returned.append(c["logprobs"])
        sup = c.get("support")
        infos.append(None if sup is None else [math.nan if x is None else x for x in sup["log_mass_kept"]])
    out["checks"]["rows_captured"] = {"ok": missing == 0, "requests": len(r["requests"]), "missing": missing,
                                      "rows": len(captured)}
    if missing:
        out["failures"].append("rows_captured")
    if not logits:
        return finish(False)
    L = torch.stack(logits)
    T = torch.tensor(toks)
    R = torch.tensor(returned, dtype=torch.float64)
    S = torch.tensor(setting)
    engine = {"vllm": vllm.__version__, "runner": runner, "device": device}
    res = {}
    for rules in (runner, "v1" if runner == "mrv2" else "mrv2"):
        t1 = time.perf_counter()
        lp, det = processed_logprobs(L, T, sps, prompt_token_ids=prompts, engine={**engine, "runner": rules},
                                     return_details=True)
        diff = (lp.double() - R).abs()
        finite = torch.isfinite(R)
        d = torch.where(finite, diff, torch.zeros_like(diff)).amax(1)
        per = {}
        for g, sp in enumerate(GRID):
            m = S == g
            if bool(m.any()):
                per[label(sp)] = float(d[m].max())
        res[rules] = {"engine": det["engine"], "verified_flag": det["engine_verified"],
                      "max_abs_diff": float(d.max()), "tokens": int(T.numel()),
                      "tokens_over_tol": int((torch.where(finite, diff, torch.zeros_like(diff)) > TOL).sum()),
                      "returned_nonfinite": int((~finite).sum()),
                      "outside_support": int(det["outside_support"].sum()),
                      "at_boundary": int(det["at_boundary"].sum()) if "at_boundary" in det else None,
                      "settings_over_tol": sorted(k for k, v in per.items() if v > TOL),
                      "per_setting_max_abs_diff": per, "seconds": round(time.perf_counter() - t1, 2)}
        say(f"rules {rules}: max |diff| {res[rules]['max_abs_diff']:.3g} over {res[rules]['tokens']} tokens, "
            f"{res[rules]['tokens_over_tol']} over {TOL}, {len(res[rules]['settings_over_tol'])} settings over, "
            f"outside support {res[rules]['outside_support']}")
    own = res[runner]
    ok = own["tokens_over_tol"] == 0 and own["outside_support"] == 0 and own["returned_nonfinite"] == 0
    out["checks"]["twin_matches"] = {"ok": ok, "tolerance": TOL, "rules": res}
    if a.engine_info:
        out["checks"]["engine_info_matches"] = with_engine_info(L, T, R, sps, prompts, engine, infos)
        if not out["checks"]["engine_info_matches"]["ok"]:
            out["failures"].append("engine_info_matches")
    try:
        lp_own, _ = processed_logprobs(L, T, sps, prompt_token_ids=prompts, engine=engine, return_details=True)
        out["explain"] = explain(L, T, R, sps, lp_own, a.dump_rows)
    except Exception as e:  # noqa: BLE001 - information only: recorded, the checks stand
        out["explain"] = {"error": f"{type(e).__name__}: {e}"}
    say(f"explain: {json.dumps({k: v for k, v in out['explain'].items() if k != 'rows'})}")
    if not ok:
        out["failures"].append("twin_matches")
    return finish(True)


def with_engine_info(L, T, R, sps, prompts, engine, infos) -> dict:
    """The twin given the engine's rlpatch_support: every returned processed logprob within TOL, none
    non-finite, every token with support information."""
    import torch

    from vllm_rlpatch.trainer import processed_logprobs

    missing = sum(1 for i in infos if i is None)
    info = torch.tensor([i if i is not None else [math.nan] * T.shape[1] for i in infos], dtype=torch.float32)
    lp, det = processed_logprobs(L, T, sps, prompt_token_ids=prompts, engine=engine, engine_info=info,
                                 return_details=True)
    finite = torch.isfinite(R)
    diff = torch.where(finite, (lp.double() - R).abs(), torch.zeros_like(R))
    res = {"tokens": int(T.numel()), "tokens_within_tol": int(((diff <= TOL) & finite).sum()),
           "tokens_over_tol": int((diff > TOL).sum()), "max_abs_diff": float(diff.max()),
           "nonfinite_twin": int((~torch.isfinite(lp)).sum()), "requests_without_support": missing,
           "tokens_without_support": int(torch.isnan(info).sum()), "tolerance": TOL}
    res["ok"] = (res["tokens_over_tol"] == 0 and res["nonfinite_twin"] == 0 and missing == 0
                 and res["tokens_without_support"] == 0)
    say(f"engine_info: {res['tokens_within_tol']}/{res['tokens']} within {TOL}, max |diff| {res['max_abs_diff']:.3g}, "
        f"{res['nonfinite_twin']} non-finite, {missing} requests without support")
    return res


def _topk_topp_kernel():
    """vLLM's top-k/top-p as MRv2 calls it (v1/sample/ops/topk_topp_sampler.py apply_top_k_top_p: the Triton kernel
    where Triton runs); on a CPU, topk_topp_triton.py's kernel under Triton's interpreter (its source loaded from
    the installed vLLM against Triton itself, one interpreter-only spelling changed), or None."""
    import importlib.util
    import os

    import torch

    if torch.cuda.is_available():
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
        return "cuda", apply_top_k_top_p
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None, None
    src_path = Path(importlib.util.find_spec("vllm").origin).parent / "v1/sample/ops/topk_topp_triton.py"
    src = src_path.read_text().replace("from vllm.triton_utils import tl, triton",
                                       "import triton\nimport triton.language as tl")
    # the interpreter's tl.range yields Python ints
    src = src.replace("row_id.to(tl.int64) * LOGITS_STRIDE_0", "tl.full((), row_id, tl.int64) * LOGITS_STRIDE_0")
    d = Path(tempfile.mkdtemp(prefix="rlpatch-qrita-"))
    (d / "_rlpatch_qrita.py").write_text(src)  # triton.jit reads the kernel's source from its file
    sys.path.insert(0, str(d))
    import _rlpatch_qrita as q

    def apply(x, k, p):
        n = 4
        q._topk_topp(x, x.new_empty((n, x.shape[1])), x.new_tensor(q._PERCENTILE_TO_STD_TABLE),
                     x.new_tensor(q._NORMAL_CDF_TO_SIGMA_TABLE), k, p, float("-inf"), n)
        return x
    return "cpu (Triton interpreter)", apply


def explain(L, T, R, sps, lp, dump: str | None = None) -> dict:
    """Rows of the tokens over the tolerance (settings without penalties): the kept count the engine used (the
    smallest prefix, by value, whose log-sum-exp gives its returned logprob), vLLM's kernel's and vLLM's PyTorch
    implementation's on the rebuilt row."""
    import math

    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    over = ((lp.double() - R).abs() > TOL) & torch.isfinite(R)
    rows, ks, ps, engine_n, finite_n, where = [], [], [], [], [], []
    for b, j in over.nonzero().tolist():
        sp = sps[b]
        if "repetition_penalty" in sp:
            continue
        x = L[b, j].float() / sp["temperature"]
        if sp["min_p"] > 0:  # MRv2 min_p.py: logits < max + log(min_p) -> -inf
            x = torch.where(x < x.max() + math.log(sp["min_p"]), torch.full_like(x, -math.inf), x)
        log_z = float(x[int(T[b, j])]) - float(R[b, j])  # log-sum-exp of what the engine kept
        cum = torch.logcumsumexp(x.sort(descending=True).values, 0)
        engine_n.append(int((cum - log_z).abs().argmin()) + 1)
        finite_n.append(int(torch.isfinite(x).sum()))
        rows.append(x)
        ks.append(sp["top_k"] or x.shape[0])
        ps.append(sp["top_p"])
        where.append(label(sp))
    out: dict = {"tokens_over_tol": int(over.sum()), "rows_without_penalties": len(rows)}
    if not rows:
        return out
    X = torch.stack(rows)
    k, p = torch.tensor(ks, dtype=torch.int32), torch.tensor(ps, dtype=torch.float32)
    if dump:
        torch.save({"logits": X, "k": k, "p": p, "engine_kept": torch.tensor(engine_n)}, dump)
        out["rows_saved_to"] = dump
    torch_n = torch.isfinite(apply_top_k_top_p_pytorch(X.clone(), k.long(), p, allow_cpu_sync=True)).sum(1).tolist()
    out.update(engine_kept_equals_torch=sum(a == b for a, b in zip(engine_n, torch_n)),
               engine_minus_torch=dict(sorted(__import__("collections").Counter(
                   a - b for a, b in zip(engine_n, torch_n)).items())),
               finite_after_min_p=dict(sorted(__import__("collections").Counter(finite_n).items())))
    dev, kernel = _topk_topp_kernel()
    if kernel is not None:
        on = "cuda" if dev == "cuda" else "cpu"
        kern_n = torch.isfinite(kernel(X.clone().to(on), k.to(on), p.to(on))).sum(1).cpu().tolist()
        out.update(kernel_device=dev, engine_kept_equals_kernel=sum(a == b for a, b in zip(engine_n, kern_n)))
    else:
        kern_n = [None] * len(rows)
        out["kernel_device"] = "not run (no GPU; TRITON_INTERPRET=1 runs it in Triton's interpreter)"
    out["rows"] = [{"setting": w, "finite": f, "engine": e, "torch": t, "kernel": kk}
                   for w, f, e, t, kk in zip(where, finite_n, engine_n, torch_n, kern_n)][:40]
    return out


if __name__ == "__main__":
    sys.exit(main())
