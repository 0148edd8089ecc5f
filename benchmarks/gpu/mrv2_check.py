"""vLLM 0.32.0 under Model Runner V2 on a GPU (issue 20, item 4): the sweep's checks (ci/sweep/probe.py) on the
runner GPU users of vLLM >= 0.29 run by default, in one engine start; writes one JSON.

    python benchmarks/gpu/mrv2_check.py OUT.json [--allow-v1] [--keep DIR]

The engine is tests/scripts/refit_engine.py (llama-tiny, shipped in the package; bf16, enforce_eager, prefix
caching), driven through probe.run_script, with a worker extension (MRv2Extension, below) that adds a report of
the runner to the sweep's head probe and torch.equal snapshot. VLLM_USE_V2_MODEL_RUNNER is left as the user
has it (unset: vLLM's default). Checks, each with pass/fail and its numbers:

  a. mrv2_ran: vLLM logged "Using V2 Model Runner" (vllm/v1/worker/gpu_worker.py, 0.32.0), the worker's
     vllm_config.use_v2_model_runner is true and its model_runner is vllm.v1.worker.gpu.model_runner's
     GPUModelRunner (collective_rpc). --allow-v1 records this check but does not fail on it: on a CPU, vLLM
     falls back to the V1 runner ("Model Runner V2 requires Triton"), and the other checks still run.
  b. plugin_in_every_process / no_patch_failed_or_unsupported: the plugin's summary line in >= 2 pids (the
     front end and the engine core), among them the worker's pid (on one GPU vLLM runs the worker inside the
     engine core process), and no patch `failed` or `unsupported` in any process (status files) nor in this
     process's gates; every target resolves.
  c. processed_logprobs (top_k=3: 5 of 8 top logprobs at -inf, mass 1), processed_logprobs_vs_fp32_reference
     (T=0.7, top-p 0.9: token_mult_prob_error against a float32 transformers reference of the same weights,
     below the raw-logprob error) and fp32_head_exact (compute_logits vs F.linear in fp32, <= 1e-5).
  d. push_round_trip (vllm_rlpatch.refit.push_weights, version 0 -> 1, weight_version() = 1, the engine
     core's log line) and no_stale_kv_after_update (the same prompts: 0 cached tokens after the update, spans
     (1, 1), logprobs follow the new weights; and again right after: the cache works within a version).
  e. refused_bad_update_unchanged: a NaN update is refused and every reachable tensor is torch.equal to before.

Exit status: 0 when every check passed, 1 otherwise (the JSON is written either way), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (ROOT / "tests", ROOT / "ci" / "sweep", HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from helpers_ext import FrameworkExtension  # noqa: E402  (tests/: light, imports os only)

MRV2_LOG = "Using V2 Model Runner"  # vllm/v1/worker/gpu_worker.py (0.32.0), logger.info_once in the worker
MRV2_FALLBACK = ("Model Runner V2 requires Triton", "Model Runner V2 does not yet support")
MRV2_RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
TOPP = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 24, "logprobs": 0}  # tests/test_rl_correctness.py
# A bf16 model body against an fp32 reference: 1.001-1.004 measured (CPU at T=0.7 with every fix; H200 greedy
# 1.0037 on 0.25.1); raw logprobs 1.10-1.19. 1.02 is the bound the suite uses after a weight update.
TOPP_BOUND = 1.02


class MRv2Extension(FrameworkExtension):
    """The sweep's worker extension (head probe, torch.equal snapshot) plus what runner this worker built."""

    def mrv2_runner_info(self):
        import torch

        runner = self.model_runner
        cls = type(runner)
        cfg = self.vllm_config
        try:
            import vllm.envs as venvs

            env_value = venvs.VLLM_USE_V2_MODEL_RUNNER
        except Exception as e:  # noqa: BLE001
            env_value = f"unreadable: {e}"
        try:
            from vllm.triton_utils import HAS_TRITON
        except Exception:  # noqa: BLE001
            HAS_TRITON = None
        sampler = getattr(runner, "sampler", None)
        sampler_class = None if sampler is None else f"{type(sampler).__module__}.{type(sampler).__qualname__}"
        cuda = torch.cuda.is_available()
        return {"pid": os.getpid(), "runner_class": f"{cls.__module__}.{cls.__qualname__}",
                "runner_mro": [f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__[:4]],
                "worker_class": f"{type(self).__module__}.{type(self).__qualname__}",
                "worker_use_v2_model_runner": getattr(self, "use_v2_model_runner", None),
                "config_use_v2_model_runner": bool(cfg.use_v2_model_runner),
                "env_VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
                "envs_VLLM_USE_V2_MODEL_RUNNER": env_value, "has_triton": HAS_TRITON,
                "logprobs_mode": str(cfg.model_config.logprobs_mode),
                "sampler_class": sampler_class,
                "device": str(getattr(runner, "device", "")),
                "torch": str(torch.__version__),
                "gpu": torch.cuda.get_device_name(0) if cuda else None,
                "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None}


def lines_with(log: str, *needles: str, n: int = 3) -> list[str]:
    return [ln.strip()[:240] for ln in log.splitlines() if any(x in ln for x in needles)][:n]


@contextlib.contextmanager
def guarded(s, name: str):
    """A check's own code that breaks (an op that returned something unexpected) fails NAME, not the run."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - recorded in the JSON
        s.check(name, False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:])


def status_files(d: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.exists() else []


def run(work: Path, allow_v1: bool, engine_timeout: float = 300) -> dict:
    import importlib.metadata as md

    import probe as P
    import torch
    import vllm

    from support import reference as R
    from support.env import model_path
    from support.logs import summaries_in
    from test_rl_correctness import LONG, SHORT as SHORT8
    from vllm_rlpatch import _wrapping, plugin, registry
    from vllm_rlpatch.patches import ALL_PATCHES
    from vllm_rlpatch.tools.targets import all_targets
    from vllm_rlpatch.versions import vllm_info

    plugin.compose()  # the composition root hands the patch list to the registry
    info = vllm_info()
    s = P.Sweep(work)
    out: dict = {"check": "mrv2_check", "vllm": str(info.version), "distribution": info.distribution,
                 "torch": torch.__version__, "python": platform.python_version(), "allow_v1": allow_v1,
                 "host": {"machine": platform.machine(), "cores": os.cpu_count(), "node": platform.node()},
                 "date": datetime.date.today().isoformat(), "rlpatch": md.version("vllm-rlpatch"),
                 "vllm_file": vllm.__file__, "model": model_path()}
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        out["triton"] = f"not importable: {type(e).__name__}"
    out["env"] = {k: v for k, v in os.environ.items()
                  if k.startswith(("VLLM_USE_V2", "VLLM_USE_FLASHINFER", "VLLM_ATTENTION", "LD_LIBRARY_PATH",
                                   "PYTHONPATH", "VLLM_RLPATCH_", "CUDA_VISIBLE", "TORCHDYNAMO"))}
    P.say(f"vLLM {info.version} ({info.distribution}), torch {torch.__version__}, triton {out['triton']}")

    # -- b (this process): every gate, every target -------------------------------------------------------
    decided = {spec.name: registry.decide(spec) for spec in ALL_PATCHES}
    targets = {t: _wrapping.target_exists(t) for t in all_targets(str(info.version))}
    missing = sorted(t for t, ok in targets.items() if not ok)
    s.check("targets_resolve", not missing, n=len(targets), missing=missing)

    weights_b = R.perturbed_copy(model_path(), str(work / "llama-B"), scale=1.0, seed=7)
    prompts_long = LONG[:2]
    probe_gen = {"op": "generate", "name": "probe", "prompts": P.SHORT, "sampling": P.TOPK_PROBE, "top": True}
    ops = [{"op": "rpc", "name": "runner", "method": "mrv2_runner_info"},
           probe_gen,
           {"op": "rpc", "name": "head", "method": "head_probe"},
           {"op": "generate", "name": "topp", "prompts": SHORT8 * 2, "sampling": TOPP},
           {"op": "generate", "name": "A", "prompts": prompts_long, "sampling": P.T1},
           {"op": "generate", "name": "A2", "prompts": prompts_long, "sampling": P.T1},
           {"op": "rpc", "name": "snap", "method": "framework_snapshot"},
           {"op": "push", "name": "nan", "weights": "B", "bad": "nan"},
           {"op": "rpc", "name": "same", "method": "framework_equal_to_snapshot"},
           {"op": "version", "name": "version_after_nan"},
           {"op": "push", "name": "push", "weights": "B"},
           {"op": "version", "name": "version"},
           {"op": "generate", "name": "B", "prompts": prompts_long, "sampling": P.T1},
           {"op": "generate", "name": "B2", "prompts": prompts_long, "sampling": P.T1}]
    spec = {"engine": {**P.ENGINE, "model": model_path(), "worker_extension_cls": "mrv2_check.MRv2Extension"},
            "weights": {"B": weights_b}, "ops": ops}
    status_dir = work / "status"
    # the engine's processes import this module (the extension): benchmarks/gpu on their path
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    P.say("one engine: llama-tiny, the plugin as installed, the runner vLLM picks")
    t0 = time.perf_counter()
    spec_file = work / "refit_engine.spec.json"
    spec_file.write_text(json.dumps(spec))
    try:
        r1, log = P.run_script_args("refit_engine.py", [str(spec_file)], work, timeout=engine_timeout,
                                    VLLM_RLPATCH_STATUS_DIR=str(status_dir))
    except subprocess.TimeoutExpired as e:  # what it printed until then
        part = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
        r1, log = None, "".join(part) + f"\n[mrv2_check] the engine script timed out after {engine_timeout} s\n"
    out["engine_seconds"] = round(time.perf_counter() - t0, 1)
    (work / "engine.log").write_text(log)
    ops1 = (r1 or {}).get("ops", {})
    if r1 is None:
        s.check("engine_ran", False, log_tail=log[-4000:])
    else:
        out["engine_start_seconds"] = round(r1.get("start_seconds", 0.0), 1)

    # -- a: Model Runner V2 ------------------------------------------------------------------------------
    runner = ((ops1.get("runner") or {}).get("result") or [{}])[0] or {}
    out["runner"] = runner
    out["runner_class"] = runner.get("runner_class")
    out["gpu"] = runner.get("gpu")
    out["attention_backend_log"] = lines_with(log, "attention backend", "Using FLASH", "FA version",
                                              "FlashAttention version")
    mrv2 = {"log_line": MRV2_LOG in log, "log_lines": lines_with(log, MRV2_LOG),
            "fallback_lines": lines_with(log, *MRV2_FALLBACK),
            "runner_class": runner.get("runner_class"),
            "config_use_v2_model_runner": runner.get("config_use_v2_model_runner"),
            "worker_use_v2_model_runner": runner.get("worker_use_v2_model_runner"),
            "env_VLLM_USE_V2_MODEL_RUNNER": runner.get("env_VLLM_USE_V2_MODEL_RUNNER"),
            "sampler_class": runner.get("sampler_class")}
    ran = (mrv2["log_line"] and mrv2["runner_class"] == MRV2_RUNNER and mrv2["config_use_v2_model_runner"] is True
           and mrv2["worker_use_v2_model_runner"] is True)
    if allow_v1 and not ran:
        s.checks["mrv2_ran"] = {"ok": False, "allowed": True, **mrv2}
        P.say(f"skip mrv2_ran (--allow-v1): {json.dumps(mrv2, default=str)[:300]}")
    else:
        s.check("mrv2_ran", ran, **mrv2)

    # -- b: the plugin in every process, every patch's state ------------------------------------------------
    summaries = summaries_in(log)
    files = status_files(status_dir)
    # One GPU: vLLM runs the worker inside the engine core process (executor "uni"); the CPU platform runs it in
    # a process of its own. Either way the worker's process must have loaded the plugin.
    worker_pid = str(runner.get("pid", ""))
    core_pids = sorted({x["pid"] for x in summaries if x["role"] == "engine_core"})
    out["plugin"] = {"pids": len({x["pid"] for x in summaries}), "roles": sorted({x["role"] for x in summaries}),
                     "failed": sorted({f for x in summaries for f in x["failed"].split(",") if f}),
                     "status_files": len(files), "worker_pid": worker_pid, "engine_core_pids": core_pids,
                     "worker_in_engine_core": worker_pid in core_pids,
                     "worker_pid_loaded_plugin": worker_pid in {x["pid"] for x in summaries}}
    s.check("plugin_in_every_process", out["plugin"]["pids"] >= 2 and not out["plugin"]["failed"]
            and bool(core_pids) and out["plugin"]["worker_pid_loaded_plugin"], **out["plugin"])
    states: dict[str, dict[str, str]] = {}
    for f in files:
        for p in f.get("patches", []):
            states.setdefault(p["name"], {})[f"{f.get('role')}:{f.get('pid')}"] = p.get("state")
    for name, (st, _why) in decided.items():
        states.setdefault(name, {})[f"driver:{os.getpid()}"] = st or "would apply"
    bad = {n: {k: v for k, v in by.items() if v in ("failed", "unsupported")} for n, by in states.items()}
    bad = {n: b for n, b in bad.items() if b}
    out["patch_states"] = {n: sorted(set(by.values())) for n, by in sorted(states.items())}
    s.check("no_patch_failed_or_unsupported", bool(files) and not bad, states=out["patch_states"], bad=bad,
            processes=[f"{f.get('role')}:{f.get('pid')}" for f in files])

    if r1 is not None:
        # -- c: processed logprobs, the fp32 head ----------------------------------------------------------
        with guarded(s, "logprobs_checks_ran"):
            pr = P.topk_probe(ops1["probe"].get("requests", []) or [{"top": [[0.0]]}])
            s.check("processed_logprobs", runner.get("logprobs_mode") == "processed_logprobs"
                    and pr["neg_inf"] >= pr["positions"] * 3 and pr["min_mass"] > 0.999,
                    logprobs_mode=runner.get("logprobs_mode"), **pr)
            reqs = ops1["topp"].get("requests", [])
            if reqs:
                model_a = R.load(model_path())
                got, proc, raw = [], [], []
                for q in reqs:
                    got += q["logprobs"]
                    proc += R.token_logprobs(model_a, q["prompt_token_ids"], q["token_ids"], temperature=0.7, top_p=0.9)
                    raw += R.token_logprobs(model_a, q["prompt_token_ids"], q["token_ids"], processed=False)
                m, m_raw = R.mismatch(got, proc), R.mismatch(got, raw)
            else:
                m, m_raw = {"n": 0, "error": ops1["topp"].get("error")}, {}
            s.check("processed_logprobs_vs_fp32_reference", m.get("n", 0) >= 120
                    and m["n_outside"] <= max(2, m["n"] // 50) and m["token_mult_prob_error"] <= TOPP_BOUND
                    and m["token_mult_prob_error"] < m_raw.get("token_mult_prob_error", 0.0),
                    sampling=TOPP, bound=TOPP_BOUND, vs_processed_reference=m, vs_raw_reference=m_raw)
            head = (ops1["head"].get("result") or [{}])[0] or {}
            s.check("fp32_head_exact", head.get("logits_dtype") == "torch.float32"
                    and head.get("max_diff_fp32", 1.0) <= 1e-5, **head)

        # -- e: a refused NaN update changes nothing -----------------------------------------------------------
        with guarded(s, "bad_update_check_ran"):
            nan = ops1["nan"]
            same = ops1["same"].get("result") or [{}]
            s.check("refused_bad_update_unchanged", nan.get("ok") is False and all(w.get("equal") for w in same)
                    and ops1["version_after_nan"].get("version") == 0,
                    push={k: nan.get(k) for k in ("ok", "kind", "state", "message")},
                    torch_equal=[w.get("equal") for w in same], tensors=[w.get("tensors") for w in same],
                    version_after=ops1["version_after_nan"].get("version"))

        # -- d: a push round trip, no stale KV -----------------------------------------------------------------
        with guarded(s, "refit_checks_ran"):
            push = ops1["push"]
            rep = push.get("report") or {}
            logged = "-> weight version 1 (" in log and "new requests salted with weight version 1" in log
            s.check("push_round_trip", bool(push.get("ok")) and rep.get("version") == 1
                    and ops1["version"].get("version") == 1 and logged,
                    version=ops1["version"].get("version"), engine_core_logged=logged,
                    log_lines=lines_with(log, "-> weight version", "salted with weight version"),
                    report={k: rep.get(k, push.get(k)) for k in ("ok", "state", "version", "transport", "guarantee",
                                                                 "path", "seconds", "message")})
            reqs_a = ops1["A"].get("requests", [])
            reqs_b, reqs_b2 = ops1["B"].get("requests", []), ops1["B2"].get("requests", [])
            spans_a = sorted({tuple(sp[2:]) for q in reqs_a for sp in q["spans"]})
            spans_b = sorted({tuple(sp[2:]) for q in reqs_b + reqs_b2 for sp in q["spans"]})
            cached_a2 = [q["num_cached_tokens"] for q in ops1["A2"].get("requests", [])]
            cached_b = [q["num_cached_tokens"] for q in reqs_b]
            cached_b2 = [q["num_cached_tokens"] for q in reqs_b2]
            err_new = P._err(reqs_b, weights_b, P.T1) if reqs_b else {}
            err_old = P._err(reqs_b, model_path(), P.T1) if reqs_b else {}
            tmpe = err_new.get("token_mult_prob_error", 9)
            s.check("no_stale_kv_after_update", bool(reqs_b) and spans_a == [(0, 0)] and spans_b == [(1, 1)]
                    and all(c == 0 for c in cached_b) and max(cached_a2 or [0]) > 0 and min(cached_b2 or [0]) > 0
                    and tmpe <= 1.02 and err_old.get("token_mult_prob_error", 0) > tmpe,
                    spans_before=spans_a, spans_after=spans_b, cached_before=cached_a2, cached_after=cached_b,
                    cached_after_again=cached_b2, token_mult_prob_error_vs_new=err_new.get("token_mult_prob_error"),
                    token_mult_prob_error_vs_old=err_old.get("token_mult_prob_error"))
        out["kv_cache_pin_log"] = next((ln.split("vllm-rlpatch: ", 1)[1][:160] for ln in log.splitlines()
                                        if "KV cache holds" in ln), None)
    out["checks"] = s.checks
    out["failures"] = s.failures
    out["ok"] = not s.failures
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the JSON to write (the engine's log goes next to it: OUT.engine.log)")
    ap.add_argument("--allow-v1", action="store_true",
                    help="record, but do not fail on, a V1 model runner (CPU hosts: MRv2 needs Triton)")
    ap.add_argument("--keep", metavar="DIR", help="keep the engine's log, status files and weights here")
    ap.add_argument("--engine-timeout", type=float, default=300, metavar="S",
                    help="seconds the engine script may take, start and every op (default 300)")
    a = ap.parse_args(argv)
    out_path = Path(a.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    work = Path(a.keep or tempfile.mkdtemp(prefix="rlpatch-mrv2-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        out = run(work, a.allow_v1, a.engine_timeout)
    except Exception as e:  # noqa: BLE001 - the JSON says what broke
        traceback.print_exc()
        out = {"check": "mrv2_check", "ok": False, "failures": ["crashed"],
               "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    log = work / "engine.log"
    if log.exists():
        log_out = out_path.with_name(out_path.stem + ".engine.log")
        log_out.write_text(log.read_text())
        out["engine_log"] = log_out.name
    out_path.write_text(json.dumps(out, indent=1, sort_keys=True, default=str) + "\n")
    print(f"[mrv2 {time.strftime('%H:%M:%S')}] vLLM {out.get('vllm')}, runner {out.get('runner_class')}, "
          f"GPU {out.get('gpu')}: {'PASS' if out['ok'] else 'FAIL ' + ', '.join(out['failures'])} "
          f"({out['seconds']} s) -> {out_path}", flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
