"""What the plugin costs, plugin on vs off in one run (JSON out; a measurement, never a test).

    python benchmarks/plugin_overhead.py [--rounds 2] [--out benchmarks/results/plugin_overhead-<vllm>.json]

1. start-up: the ``.pth`` hook's import cost in every interpreter (``python -X importtime``).
2. registration per vLLM process (frontend, engine core, worker) from the plugin's own status files,
   plus the pure ``apply_all`` cost once vLLM's modules are imported.
3. per-call overhead of every hook the plugin installs (same wrapper code around a no-op vs the bare
   no-op; and ``EngineArgs(...)`` construction with the explicit-argument capture vs without).
4. end to end: engine start and generate throughput with the plugin on vs off, interleaved rounds, the
   same prompts and the same explicit ``logprobs_mode`` on both sides so only the hooks differ.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ENGINE_SCRIPT = r"""
import json, os, sys, time
if __name__ == "__main__":
    t0 = time.perf_counter()
    import vllm
    llm = vllm.LLM(sys.argv[1], dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=128 << 20,
                   enforce_eager=True, gpu_memory_utilization=0.5, logprobs_mode="processed_logprobs", seed=0)
    t_start = time.perf_counter() - t0
    prompts = ["the quick cat sees", "12 + 7 =", "count: 3 4 5", "spell robot:"] * 8
    sp = vllm.SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, ignore_eos=True, logprobs=1, seed=1)
    llm.generate(prompts[:4], sp, use_tqdm=False)  # warm-up
    runs = []
    for _ in range(3):
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        runs.append({"seconds": dt, "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                     "requests": len(outs)})
    print("RESULT " + json.dumps({"engine_start_s": t_start, "runs": runs}), flush=True)
"""


STARTUP_MODULES = ("vllm_rlpatch", "vllm_rlpatch._postimport", "vllm_rlpatch._startup", "wrapt")


def importtime(enabled: bool, n: int = 9) -> dict:
    """The .pth hook's import cost (``python -X importtime``), median of ``n`` interpreters."""
    env = dict(os.environ, VLLM_RLPATCH_ENABLED="1" if enabled else "0")
    per_run = []
    for _ in range(n):
        p = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True, env=env)
        mods = {}
        for line in p.stderr.splitlines():
            m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
            if m and m.group(4).strip() in STARTUP_MODULES:
                mods[m.group(4).strip()] = int(m.group(2))
        per_run.append(mods)
    names = sorted({k for r in per_run for k in r})
    mods = {k: int(statistics.median([r.get(k, 0) for r in per_run])) for k in names}
    # the .pth line imports vllm_rlpatch._startup; its cumulative time includes everything it pulls in
    return {"modules_cumulative_us": mods, "total_us": mods.get("vllm_rlpatch._startup", 0),
            "imports_wrapt_at_startup": any("wrapt" in r for r in per_run), "interpreters": n}


def interpreter_start(n: int = 10) -> dict:
    out = {}
    for label, extra in (("with_pth", []), ("no_site", ["-S"])):
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            subprocess.run([sys.executable, *extra, "-c", "pass"], check=True)
            ts.append(time.perf_counter() - t)
        out[label + "_median_ms"] = statistics.median(ts) * 1e3
    return out


def hook_microbench(n: int = 200_000) -> dict:
    import wrapt
    from vllm.engine.arg_utils import EngineArgs

    from vllm_rlpatch import plugin
    from vllm_rlpatch.hooks import explicit, weights

    plugin.register()

    def noop(*a, **k):
        return None

    def bench(fn, *args, **kwargs):
        t = time.perf_counter()
        for _ in range(n):
            fn(*args, **kwargs)
        return (time.perf_counter() - t) / n * 1e9

    bare = bench(noop, "generate")
    res = {"bare_noop_ns": bare, "hooks": {}}
    cases = {
        "collective_rpc (non-update method)": (weights._sync_rpc_wrapper, ("some_method",)),
        "collective_rpc (reload_weights: fires the event)": (weights._sync_rpc_wrapper, ("reload_weights",)),
        "worker update method": (weights._worker_update_wrapper("reload_weights"), ()),
    }
    import logging

    logging.getLogger("vllm.rlpatch").setLevel(logging.WARNING)  # the event's INFO line is not the hook's cost
    for name, (wrapper, args) in cases.items():
        w = wrapt.FunctionWrapper(noop, wrapper)
        res["hooks"][name] = {"ns_per_call": bench(w, *args), "overhead_ns": bench(w, *args) - bare,
                              "per": "RPC / weight update (not per request)"}
    model = str(ROOT / "src" / "vllm_rlpatch" / "models" / "llama-tiny")
    m = 200
    t = time.perf_counter()
    for _ in range(m):
        EngineArgs(model=model, dtype="bfloat16")
    with_capture = (time.perf_counter() - t) / m * 1e6
    explicit.uninstall()
    t = time.perf_counter()
    for _ in range(m):
        EngineArgs(model=model, dtype="bfloat16")
    without = (time.perf_counter() - t) / m * 1e6
    explicit.install()
    res["hooks"]["EngineArgs.__init__ (explicit-argument capture)"] = {
        "us_per_call_with": with_capture, "us_per_call_without": without, "overhead_us": with_capture - without,
        "per": "engine construction"}
    res["generate_path_hooks"] = ("none: no plugin hook runs per request or per step (the hooks above run once "
                                  "per engine, per RPC or per weight update)")
    return res


def engine_round(enabled: bool) -> dict:
    from vllm_rlpatch.models import path

    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "bench_engine.py"
        script.write_text(ENGINE_SCRIPT)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_")}
        env.update(VLLM_RLPATCH_ENABLED="1" if enabled else "0", VLLM_RLPATCH_STATUS_DIR=str(Path(d) / "st"))
        p = subprocess.run([sys.executable, str(script), path()], capture_output=True, text=True, env=env, cwd=d,
                           timeout=900)
        lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"engine run failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        r = json.loads(lines[-1][7:])
        r["register_seconds"] = {}
        for f in sorted((Path(d) / "st").glob("*.json")):
            s = json.loads(f.read_text())
            r["register_seconds"][s["role"]] = s["register_seconds"]
        r["tokens_per_s"] = [x["tokens"] / x["seconds"] for x in r["runs"]]
        return r


def main() -> int:
    import vllm

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved off/on engine rounds (default 2)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--startup-only", action="store_true",
                    help="only the start-up hook's import cost (no engines); written to ...-startup.json")
    args = ap.parse_args()
    suffix = "-startup" if args.startup_only else ""
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"plugin_overhead-vllm{vllm.__version__}{suffix}.json")
    result = {"benchmark": "plugin_overhead", "vllm": vllm.__version__, "python": platform.python_version(),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d")}
    print("[1/4] start-up hook import cost", flush=True)
    result["startup"] = {"importtime_enabled": importtime(True), "importtime_disabled": importtime(False),
                         "interpreter_start": interpreter_start()}
    if args.startup_only:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["startup"], indent=2))
        print(f"wrote {out}")
        return 0
    print("[2/4] hook micro-benchmarks", flush=True)
    result["hooks"] = hook_microbench()
    print(f"[3/4] engines, plugin off vs on, {args.rounds} interleaved rounds", flush=True)
    rounds = {"off": [], "on": []}
    for i in range(args.rounds):
        for label in ("off", "on"):
            print(f"      round {i + 1}: plugin {label}", flush=True)
            rounds[label].append(engine_round(label == "on"))
    result["engines"] = rounds
    print("[4/4] summary", flush=True)
    tps = {k: statistics.median([t for r in v for t in r["tokens_per_s"]]) for k, v in rounds.items()}
    start = {k: statistics.median([r["engine_start_s"] for r in v]) for k, v in rounds.items()}
    result["summary"] = {
        "generate_tokens_per_s_median": tps,
        "throughput_ratio_on_over_off": tps["on"] / tps["off"],
        "engine_start_s_median": start,
        "engine_start_ratio_on_over_off": start["on"] / start["off"],
        "register_seconds_by_role_median": {
            role: statistics.median([r["register_seconds"][role] for r in rounds["on"] if role in r["register_seconds"]])
            for role in sorted({k for r in rounds["on"] for k in r["register_seconds"]})},
        "startup_hook_import_us": result["startup"]["importtime_enabled"]["total_us"],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
