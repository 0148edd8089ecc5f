"""One vLLM minor of the version sweep (ci/sweep.sh): what the plugin does there, each patch's state against an
independent behavioural probe of its bug, and the RL checks, on real vLLM; writes one JSON.

    PY ci/sweep/probe.py --out benchmarks/results/sweep/vllm-0.26.0.json

Run with the python of an environment that has that vLLM (and vllm-rlpatch, editable) installed. Two engine
starts (tests/scripts/refit_engine.py with the plugin; tests/scripts/rl_engine.py as vLLM ships, the
`stock` profile) and three engine-free probes on vLLM's real code (tests/portrace.py: the MessageQueue bind
race and the TCPStore port selection; tests/scripts/async_preempt.py: the scheduler). The reference logprobs
come from transformers in fp32 (tests/reference.py). Nothing here trusts the plugin's own gates: a patch
`applied` must meet a reproduced bug, a patch `not_needed` a probe that finds none.

Exit status: 0 when every check passed and every patch's state agrees with its probe, 1 otherwise (the JSON
says which), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))

# vLLM paths the sweep cannot run on a CPU host: their patches are checked in source only (their targets
# resolve, their gate/probe decides) and listed as not run.
NOT_RUN = {
    "wake_order_guard": "CUDA sleep mode (cumem allocator) only",
    "refit_http": "needs `vllm serve` (the CI suite runs it on 0.20.2, 0.25.1 and 0.32.0)",
}
FEATURES = ("weight_events", "worker_extension", "refit_guard", "kv_cache_pin")  # no upstream bug: always on

SHORT = ["the quick cat sees", "12 + 7 =", "count: 3 4 5", "spell robot:"]
TOPK_PROBE = {"temperature": 0.8, "top_k": 3, "max_tokens": 8, "logprobs": 8, "seed": 1}
T1 = {"temperature": 1.0, "max_tokens": 16, "logprobs": 0, "ignore_eos": True, "seed": 3}
ENGINE = {"dtype": "bfloat16", "max_model_len": 512, "block_size": 32, "kv_cache_memory_bytes": 64 << 20,
          "enforce_eager": True, "gpu_memory_utilization": 0.5, "enable_prefix_caching": True}


def say(msg: str) -> None:
    print(f"[sweep {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def topk_probe(requests: list[dict]) -> dict:
    """top_k=3, 8 logprobs asked: processed logprobs put 5 of 8 at -inf at every position, raw ones none."""
    import math

    pos = neg_inf = 0
    masses = []
    for q in requests:
        for step in q["top"]:
            pos += 1
            neg_inf += sum(1 for v in step if v < -1e29)
            masses.append(sum(math.exp(v) for v in step if v > -1e29))
    return {"positions": pos, "neg_inf": neg_inf, "min_mass": min(masses), "max_mass": max(masses)}


def _err(run_requests, weights_dir, sampling) -> dict:
    """The mismatch (tests/reference.py) of the request that agrees worst with the fp32 reference of
    WEIGHTS_DIR."""
    from support import reference as R

    model = R.load(weights_dir)
    ms = [R.mismatch(q["logprobs"], R.token_logprobs(model, q["prompt_token_ids"], q["token_ids"],
                                                     temperature=sampling.get("temperature", 1.0)))
          for q in run_requests]
    return max(ms, key=lambda m: m["token_mult_prob_error"])


class Sweep:
    def __init__(self, work: Path):
        self.work = work
        self.checks: dict[str, dict] = {}
        self.failures: list[str] = []

    def check(self, name: str, ok: bool, **data) -> bool:
        self.checks[name] = {"ok": bool(ok), **data}
        say(f"{'ok  ' if ok else 'FAIL'} {name}: {json.dumps(data, default=str)[:300]}")
        if not ok:
            self.failures.append(name)
        return ok


def run_script(script: str, spec: dict, work: Path, **env) -> tuple[dict | None, str]:
    """tests/scripts/SCRIPT with SPEC written to a JSON file in WORK (the scripts' convention)."""
    f = work / f"{script}.{len(list(work.iterdir()))}.json"
    f.write_text(json.dumps(spec))
    return run_script_args(script, [str(f)], work, **env)


def run_script_args(script: str, args: list[str], work: Path, timeout: float = 900, **env) -> tuple[dict | None, str]:
    """(its `RESULT {...}` line or None, stdout+stderr): unlike conftest.run_script, a failed run is a finding
    recorded in the JSON, not an assertion."""
    import subprocess

    from support.env import SCRIPTS, clean_env

    p = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True,
                       timeout=timeout, env=clean_env(**env), cwd=str(work))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    return (json.loads(lines[-1][7:]) if p.returncode == 0 and lines else None), p.stdout + p.stderr


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON to write")
    ap.add_argument("--keep", metavar="DIR", help="keep the engines' logs and the weights here")
    a = ap.parse_args(argv)
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(f"error: this python has no working vLLM: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    work = Path(a.keep or tempfile.mkdtemp(prefix="rlpatch-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    out = probe(work)
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1, sort_keys=True, default=str) + "\n")
    say(f"vLLM {out['vllm']}: {'PASS' if out['ok'] else 'FAIL ' + ', '.join(out['failures'])} "
        f"({out['seconds']} s) -> {a.out}")
    return 0 if out["ok"] else 1


def probe(work: Path) -> dict:
    import importlib.metadata as md

    import torch

    from support.env import amx_host, model_path
    from support.logs import summaries_in
    from vllm_rlpatch import _wrapping, plugin, registry
    from vllm_rlpatch.patches import ALL_PATCHES
    from vllm_rlpatch.tools.targets import all_targets
    from vllm_rlpatch.versions import vllm_info

    plugin.compose()  # the composition root hands the patch list to the registry
    info = vllm_info()
    v = info.version
    s = Sweep(work)
    out: dict = {"vllm": str(v), "distribution": info.distribution, "torch": torch.__version__,
                 "python": platform.python_version(), "evidence": "cpu-sweep",
                 "host": {"machine": platform.machine(), "cores": os.cpu_count(), "amx": amx_host()},
                 "date": datetime.date.today().isoformat(), "rlpatch": md.version("vllm-rlpatch")}
    say(f"vLLM {v} ({info.distribution}), torch {torch.__version__}")

    # -- in this process: every gate, every target (no engine) -------------------------------------------
    decided = {spec.name: registry.decide(spec) for spec in ALL_PATCHES}
    targets = {t: _wrapping.target_exists(t) for t in all_targets(str(v))}
    missing = sorted(t for t, ok in targets.items() if not ok)
    s.check("targets_resolve", not missing, n=len(targets), missing=missing)
    bad_gate = {n: d for n, d in decided.items() if d[0] in ("unsupported", "failed")}
    s.check("no_patch_unsupported_or_failed", not bad_gate, states={n: d[0] for n, d in decided.items()},
            bad=bad_gate)

    from support import reference as R

    weights_b = R.perturbed_copy(model_path(), str(work / "llama-B"), scale=1.0, seed=7)
    from test_rl_correctness import LONG

    prompts_long = LONG[:2]

    # -- engine 1: the plugin as installed ----------------------------------------------------------------
    say("engine 1/2: with the plugin (processed logprobs, fp32 head, a push, a refused push, no stale KV)")
    probe_gen = {"op": "generate", "name": "probe", "prompts": SHORT, "sampling": TOPK_PROBE, "top": True}
    ops = [probe_gen,
           {"op": "rpc", "name": "head", "method": "head_probe"},
           {"op": "generate", "name": "A", "prompts": prompts_long, "sampling": T1},
           {"op": "generate", "name": "A2", "prompts": prompts_long, "sampling": T1},
           {"op": "rpc", "name": "snap", "method": "framework_snapshot"},
           {"op": "push", "name": "nan", "weights": "B", "bad": "nan"},
           {"op": "rpc", "name": "same", "method": "framework_equal_to_snapshot"},
           {"op": "push", "name": "push", "weights": "B"},
           {"op": "version", "name": "version"},
           {"op": "generate", "name": "B", "prompts": prompts_long, "sampling": T1}]
    spec = {"engine": {**ENGINE, "model": model_path(), "worker_extension_cls": "helpers_ext.FrameworkExtension"},
            "weights": {"B": weights_b}, "ops": ops}
    r1, log1 = run_script("refit_engine.py", spec, work)
    (work / "engine1.log").write_text(log1)
    summaries = summaries_in(log1)
    out["plugin"] = {"pids": len({x["pid"] for x in summaries}), "roles": sorted({x["role"] for x in summaries}),
                     "failed": sorted({f for x in summaries for f in x["failed"].split(",") if f}),
                     "applied_in_worker": next((x["applied"].split(",") for x in summaries if x["role"] == "worker"),
                                               [])}
    s.check("plugin_in_every_process", out["plugin"]["pids"] >= 2 and not out["plugin"]["failed"]
            and {"engine_core", "worker"} <= set(out["plugin"]["roles"]), **out["plugin"])
    if r1 is None:
        s.check("engine_with_plugin_ran", False, log_tail=log1[-3000:])
        ops1 = {}
    else:
        ops1 = r1["ops"]
        pr = topk_probe(ops1["probe"]["requests"])
        s.check("processed_logprobs", pr["neg_inf"] >= pr["positions"] * 3 and pr["min_mass"] > 0.999, **pr)
        head = (ops1["head"].get("result") or [{}])[0]
        s.check("fp32_head_exact", head.get("logits_dtype") == "torch.float32"
                and head.get("max_diff_fp32", 1.0) <= 1e-5, **head)
        cached_a2 = [q["num_cached_tokens"] for q in ops1["A2"].get("requests", [])]
        nan = ops1["nan"]
        same = ops1["same"].get("result") or [{}]
        s.check("refused_bad_update_unchanged", nan.get("ok") is False and all(w.get("equal") for w in same),
                push={k: nan.get(k) for k in ("ok", "kind", "state", "message")},
                torch_equal=[w.get("equal") for w in same], tensors=[w.get("tensors") for w in same])
        push = ops1["push"]
        rep = push.get("report") or {}
        s.check("push_round_trip", bool(push.get("ok")) and rep.get("version") == 1
                and ops1["version"].get("version") == 1, version=ops1["version"].get("version"),
                report={k: rep.get(k, push.get(k)) for k in ("ok", "state", "version", "guarantee", "path",
                                                             "message")})
        reqs_b = ops1["B"].get("requests", [])
        spans = sorted({tuple(sp[2:]) for q in reqs_b for sp in q["spans"]})
        err_b = _err(reqs_b, weights_b, T1) if reqs_b else {}
        s.check("no_stale_kv_after_update", bool(reqs_b) and spans == [(1, 1)]
                and all(q["num_cached_tokens"] == 0 for q in reqs_b) and max(cached_a2 or [0]) > 0
                and err_b.get("token_mult_prob_error", 9) <= 1.02,
                spans=spans, cached_after=[q["num_cached_tokens"] for q in reqs_b], cached_before=cached_a2,
                token_mult_prob_error=err_b.get("token_mult_prob_error"))
        out["kv_cache_pin_log"] = next((ln.split("vllm-rlpatch: ", 1)[1][:160] for ln in log1.splitlines()
                                        if "KV cache holds" in ln), None)

    # -- engine 2: vLLM as it ships (the `stock` profile keeps only the host fixes) ----------------------
    say("engine 2/2: vLLM as it ships (raw logprobs? bf16 head? stale KV after reload_weights?)")
    ops2 = [probe_gen,
            {"op": "rpc", "name": "head", "method": "head_probe"},
            {"op": "generate", "name": "A", "prompts": prompts_long, "sampling": T1},
            {"op": "reload", "name": "reload", "path": weights_b},
            {"op": "generate", "name": "B", "prompts": prompts_long, "sampling": T1}]
    spec2 = {"engine": {**ENGINE, "model": model_path(), "worker_extension_cls": "helpers_ext.HeadProbeExtension"},
             "ops": ops2}
    r2, log2 = run_script("rl_engine.py", spec2, work, VLLM_RLPATCH_PROFILE="stock")
    (work / "engine2.log").write_text(log2)
    bugs: dict[str, dict] = {}
    if r2 is None:
        s.check("stock_engine_ran", False, log_tail=log2[-3000:])
    else:
        by = {o["name"]: o for o in r2["ops"]}
        pr = topk_probe([_flatten(q) for q in by["probe"]["requests"]])
        bugs["rl_defaults"] = {"bug": pr["neg_inf"] == 0, "evidence": f"stock logprobs_mode "
                               f"{r2.get('logprobs_mode')}: {pr['neg_inf']} of {pr['positions'] * 8} top-8 logprobs "
                               f"at -inf under top_k=3 (raw: 0)"}
        head = (by["head"].get("result") or [{}])[0]
        bugs["fp32_lm_head"] = {"bug": head.get("logits_dtype") != "torch.float32" or
                                head.get("max_diff_fp32", 0) > 1e-3,
                                "evidence": f"stock logits {head.get('logits_dtype')}, max |logit - fp32| "
                                            f"{head.get('max_diff_fp32')}"}
        reqs = [_flatten(q) for q in by["B"].get("requests", [])]
        cached = [q["num_cached_tokens"] for q in reqs]
        err = (_err(reqs, weights_b, T1) if reqs else {}).get("token_mult_prob_error", float("nan"))
        bugs["prefix_cache"] = {"bug": bool(reqs) and max(cached) > 0,
                                "evidence": f"after reload_weights the same prompts reuse {cached} cached tokens "
                                            f"(token_mult_prob_error {err:.3f} vs the new weights)"}

    # -- engine-free probes on vLLM's real code ------------------------------------------------------------
    from support import portrace

    say("MessageQueue bind race (4 processes, vLLM's probe-then-bind, 1 s window), unpatched")
    try:
        mq = portrace.mq_trial(procs=4, count=2, delay=1.0, patched=False)
        n = mq.get("attempts", mq["created"] + mq["failed"])
        bugs["mq_bind_retry"] = {"bug": mq["failed"] > 0,
                                 "evidence": f"{mq['failed']} of {n} MessageQueue creations failed unpatched"
                                             + (" (Address already in use)" if mq["failed"] else "")}
    except Exception as e:  # noqa: BLE001
        bugs["mq_bind_retry"] = {"bug": None, "evidence": f"probe failed: {type(e).__name__}: {e}"}
    say("TCPStore port selection (4 processes x 8 engine inits), unpatched")
    try:  # vLLM's own selection per release: 0.20 get_open_port(), 0.25 _select_tcpstore_port, 0.29 port 0
        ts = portrace.tcpstore_trial(procs=4, threads=8, hold=2.0, patched=False, vllm_port=portrace.free_band(64))
        bugs["tcpstore_port"] = {"bug": ts["store_bind_failures"] > 0,
                                 "evidence": f"{ts['store_bind_failures']} of {ts['inits']} TCPStore binds failed "
                                             f"unpatched ({', '.join(ts['how'])})"}
    except Exception as e:  # noqa: BLE001
        bugs["tcpstore_port"] = {"bug": None, "evidence": f"probe failed: {type(e).__name__}: {e}"}
    say("async scheduling after a forced preemption (vllm#42043), unpatched")
    ap_r, ap_log = run_script_args("async_preempt.py", [model_path()], work, timeout=600,
                                   VLLM_RLPATCH_ASYNC_PREEMPT_DISCARD="0")
    if ap_r is None:
        bugs["async_preempt_discard"] = {"bug": None, "evidence": "probe failed: " + ap_log[-500:]}
    else:
        bugs["async_preempt_discard"] = {"bug": ap_r["drained"] == [100],
                                         "evidence": f"tokens drained after the resume: {ap_r['drained']} "
                                                     "(the bug drops 102)"}
    bugs["cpu_amx_permission"] = {"bug": None if amx_host() else False,
                                  "evidence": "this host has AMX: see the engines above" if amx_host() else
                                  "this host has no AMX (the SIGILL needs amx_tile)"}

    # -- each patch's state against its probe ------------------------------------------------------------
    applied_worker = set(out.get("plugin", {}).get("applied_in_worker") or [])
    patches = {}
    for spec in ALL_PATCHES:
        state, reason = decided[spec.name]
        state = state or ("applied" if spec.name in applied_worker else "not applied")
        row = {"state": state, "reason": reason}
        if spec.name in NOT_RUN:
            row.update(run="source only", evidence=NOT_RUN[spec.name], agrees=None)
        elif spec.name in FEATURES:
            ok = state == "applied" and all(s.checks.get(c, {}).get("ok") for c in
                                            ("push_round_trip", "refused_bad_update_unchanged"))
            if spec.name == "kv_cache_pin":
                ok = state == "applied" and bool(out.get("kv_cache_pin_log"))
            row.update(run="cpu", evidence="a feature (no upstream bug): exercised by the checks", agrees=ok)
        elif spec.name in bugs:
            b = bugs[spec.name]
            want = None if b["bug"] is None else ("applied" if b["bug"] else "not_needed")
            row.update(run="cpu" if b["bug"] is not None else "not run", evidence=b["evidence"],
                       expected=want, agrees=None if want is None else state == want)
        else:
            row.update(run="not run", evidence="no probe", agrees=None)
        patches[spec.name] = row
        if row["agrees"] is False:
            s.failures.append(f"patch:{spec.name}")
    out["patches"] = patches
    disagree = {n: (p["state"], p.get("expected")) for n, p in patches.items() if p["agrees"] is False}
    say(f"patch states vs probes: {sum(1 for p in patches.values() if p['agrees'])} agree, "
        f"{len(disagree)} disagree {disagree or ''}, {sum(1 for p in patches.values() if p['agrees'] is None)} not run")
    out["checks"] = s.checks
    out["failures"] = s.failures
    out["ok"] = not s.failures
    return out


def _flatten(q: dict) -> dict:
    """rl_engine.py's request (outputs[0]) in refit_engine.py's shape."""
    c = q["outputs"][0]
    return {"prompt_token_ids": q["prompt_token_ids"], "num_cached_tokens": q["num_cached_tokens"],
            "token_ids": c["token_ids"], "logprobs": c["logprobs"], "spans": c["spans"], "top": c.get("top", [])}



if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:  # noqa: BLE001 - the sweep must say what broke, in the JSON's absence
        traceback.print_exc()
        sys.exit(1)
