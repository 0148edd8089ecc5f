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
"""

from __future__ import annotations

import argparse
import datetime
import json
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
    from conftest import model_path
    from probe import run_script_args

    from vllm_rlpatch.trainer import processed_logprobs

    t_start = time.perf_counter()
    work = Path(a.keep or tempfile.mkdtemp(prefix="rlpatch-mrv2-twin-"))
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

    reqs = []
    for g, sp in enumerate(GRID):
        for j in range(a.prompts):
            reqs.append({"prompt": PROMPTS[j], "sampling": {**sp, "max_tokens": a.tokens, "ignore_eos": True,
                                                            "logprobs": 0, "seed": 1000 * g + j}})
    cap = work / "logits.pt"
    # every prompt prefilled in one step (no chunked prefill: a captured row is then a sampled token)
    spec = {"engine": {"model": model_path(), "max_num_batched_tokens": 16384, "max_num_seqs": 1024,
                       "kv_cache_memory_bytes": 256 << 20},
            "requests": reqs, "capture": str(cap)}
    say(f"engine: {len(reqs)} requests ({len(GRID)} settings x {a.prompts} prompts x {a.tokens} tokens)")
    t0 = time.perf_counter()
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
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out["checks"]["runner"] = {"ok": mrv2, "runner": runner, "log_line": MRV2_LOG if mrv2 else None,
                               "startup_s": r.get("startup_s"), "logprobs_mode": r.get("logprobs_mode")}
    if not mrv2 and not a.allow_v1:
        out["failures"].append("runner")

    captured = torch.load(cap)
    by_rid: dict = {}
    for (rid, pos), row in captured.items():
        by_rid.setdefault(rid, {})[pos] = row
    logits, toks, sps, prompts, returned, setting = [], [], [], [], [], []
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
    if not ok:
        out["failures"].append("twin_matches")
    return finish(True)


if __name__ == "__main__":
    sys.exit(main())
