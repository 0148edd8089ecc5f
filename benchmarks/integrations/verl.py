"""verl's own weight sync against real vLLM, plugin off and on, and with ``vllm_rlpatch.integrations.verl``.

    python benchmarks/integrations/verl.py --out benchmarks/results/integrations/ [--models llama-tiny,qwen2-tiny]
        [--modes off,on] [--repeats 3] [--with-runs earlier.json]

Needs verl installed next to vLLM (``ci/envs/integrations/verl.txt``). Real code, imported from the installed
verl: the trainer side ``ServerAdapter.update_weights`` (``verl/workers/rollout/vllm_rollout/vllm_rollout.py``
line 210 in 0.9.1), its ``BucketedWeightSender`` (shared memory: verl's path where CUDA IPC is missing), and the
vLLM side ``vLLMColocateWorkerExtension.update_weights_from_ipc`` (``vllm_rollout/utils.py`` line 243) running
in vLLM's worker as its ``worker_extension_cls``, which calls ``model.load_weights`` per bucket (line 405) and
``process_weights_after_loading`` once. The one piece not verl's: its Ray actor hop. ``ServerAdapter``'s
server handle (a Ray handle to verl's ``vLLMHttpServer``) is an in-process object with the three calls
``update_weights`` makes (``collective_rpc``, ``clear_kv_cache`` = ``reset_prefix_cache`` as
``vllm_async_server.py`` line 864 does, ``set_global_steps``).

Per model and plugin mode, one process (``--child``): the engine (weights A) and a fresh engine loaded with B.
verl syncs B into the first: greedy tokens and logprobs must equal the fresh engine's, after the prefix cache
was warmed with A's KV. Then rollouts at temperature 1 against a trainer's logprobs (transformers, bf16, the
B weights): verl's own ``calculate_debug_metrics`` (``verl/utils/debug/metrics.py``) and NeMo-RL's
``token_mult_prob_error`` (mean of exp|Δlogprob|). Plugin on: ``install()`` and the same call syncs A back
(must equal the engine's first outputs, which were a fresh load of A), a ``delta_flush`` call is refused
with the engine unchanged. Sync times: every call timed, as-is and adapter, in one process. Timing is
reported, never asserted. Writes ``verl.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

# This file is named like the framework: its directory must not shadow the installed ``verl`` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

VERL_EXT = "verl_cpu_platform.vLLMColocateWorkerExtension"  # verl's own class, re-exported after the platform
# verl 0.9.1 knows no CPU platform: its detection falls back to 'nvidia' (verl/plugin/platform/platform_manager.py
# line 113) and BucketedWeightSender's torch.cuda.synchronize() (bucketed_weight_transfer.py line 162) raises
# "Found no NVIDIA driver", leaving the worker blocked on its ZMQ recv (line 286). A CPU platform, through
# verl's own extension point (PlatformRegistry + set_platform), in both the trainer and the vLLM worker.
CPU_PLATFORM = """
import types
import torch
from verl.plugin.platform.platform_cuda import PlatformCUDA
from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformCUDA):
    device_name = property(lambda self: "cpu")
    vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: types.SimpleNamespace(
        synchronize=lambda *a: None, empty_cache=lambda: None, ipc_collect=lambda: None,
        is_available=lambda: True, current_device=lambda: 0))

    def is_available(self):
        return True

    def current_device(self):
        return 0

    def is_ipc_supported(self):
        return False


set_platform(PlatformCPU())
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension  # noqa: E402
"""
ZMQ = "ipc:///tmp/rl-colocate-zmq-{job}-replica-0-rank-0.sock"
PROMPTS = [("The history of the printing press begins in " * 6) + s
           for s in ("Mainz.", "China.", "Korea.", "Venice.")]


def perturbed(src: str, dst: str, seed: int) -> str:
    import torch
    from safetensors.torch import load_file, save_file

    Path(dst).mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, Path(dst) / f.name)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in sorted(load_file(str(Path(src) / "model.safetensors")).items()):
        noise = torch.randn(t.shape, generator=g) * t.float().std() if t.dim() >= 2 else 0
        out[name] = (t.float() + noise).to(t.dtype).contiguous()
    save_file(out, str(Path(dst) / "model.safetensors"), metadata={"format": "pt"})
    return dst


def trainer_state(path: str):
    """The (name, tensor) stream a trainer's state_dict gives (a tied model's lm_head.weight included)."""
    from safetensors.torch import load_file

    sd = load_file(str(Path(path) / "model.safetensors"))
    cfg = json.loads((Path(path) / "config.json").read_text())
    if cfg.get("tie_word_embeddings") and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


_POOL = concurrent.futures.ThreadPoolExecutor(4)


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        # Started now, as Ray's .remote() dispatches at once: verl's sender then blocks its event loop on the
        # ZMQ handshake with the worker this call starts (a coroutine would never get to run).
        return asyncio.wrap_future(_POOL.submit(self.fn, *args, **kwargs))


class LocalServer:
    """verl's vLLMHttpServer actor, in this process: the calls ServerAdapter.update_weights makes."""

    def __init__(self, llm):
        self.engine = llm
        self.collective_rpc = _Remote(lambda method, timeout=None, args=(), kwargs=None:
                                      llm.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs))
        self.clear_kv_cache = _Remote(llm.reset_prefix_cache)
        self.set_global_steps = _Remote(lambda steps: None)


def rollout_for(llm, job: str):
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    r = ServerAdapter.__new__(ServerAdapter)  # __init__ needs Ray's runtime context; these are what it sets
    r.config = SimpleNamespace(checkpoint_engine=SimpleNamespace(update_weights_bucket_megabytes=64),
                               free_cache_engine=False)
    r.server_handle, r._has_server, r.replica_rank, r.rollout_rank = LocalServer(llm), True, 0, 0
    r.zmq_handle, r.use_shm = ZMQ.format(job=job), True
    return r


def greedy(llm, vllm):
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
             "logprobs": [s[t].logprob for t, s in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]}
            for o in outs]


# Equal: the same greedy tokens, logprobs within float noise (a batch's prefix-cache hits change the summation
# order: ~1e-7 seen on the same weights; a weight change moves them by 1e-2 and more).
LOGPROB_TOL = 1e-5


def compare(got, ref) -> dict:
    same = all(g["tokens"] == r["tokens"] for g, r in zip(got, ref))
    diffs = [abs(a - b) for g, r in zip(got, ref) for a, b in zip(g["logprobs"], r["logprobs"])]
    return {"tokens_equal": same, "max_abs_logprob_diff": max(diffs) if diffs else None,
            "equal": same and bool(diffs) and max(diffs) <= LOGPROB_TOL, "tolerance": LOGPROB_TOL,
            # the first prompt runs before the others share its prefix: cached tokens there are KV of older weights
            "stale_kv_tokens": got[0]["cached"] if got else None, "cached_tokens": [g["cached"] for g in got]}


def timed_sync(rollout, path: str) -> tuple[float, str | None]:
    t0 = time.perf_counter()
    try:
        asyncio.run(rollout.update_weights(iter(trainer_state(path).items()), global_steps=None))
        return time.perf_counter() - t0, None
    except Exception as e:  # noqa: BLE001 - what breaks is the finding
        return time.perf_counter() - t0, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def mismatch(llm, vllm, path: str) -> dict:
    """Rollouts at temperature 1 vs a bf16 trainer's logprobs of the same tokens, verl's metric and NeMo-RL's."""
    import torch
    from transformers import AutoModelForCausalLM
    from verl.protocol import DataProto
    from verl.utils.debug.metrics import calculate_debug_metrics

    sp = vllm.SamplingParams(temperature=1.0, max_tokens=24, logprobs=0, seed=1, n=2)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    rows = [(list(o.prompt_token_ids), c) for o in outs for c in o.outputs]
    L = max(len(c.token_ids) for _, c in rows)
    roll, train, mask, resp = (torch.zeros(len(rows), L) for _ in range(4))
    for i, (p, c) in enumerate(rows):
        ids = torch.tensor([p + list(c.token_ids)])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits.float()[0, len(p) - 1:-1], -1)
        n = len(c.token_ids)
        train[i, :n] = lp[torch.arange(n), torch.tensor(c.token_ids)]
        roll[i, :n] = torch.tensor([s[t].logprob for t, s in zip(c.token_ids, c.logprobs)])
        mask[i, :n], resp[i, :n] = 1, torch.tensor(c.token_ids, dtype=torch.float)
    data = DataProto.from_dict(tensors={"rollout_log_probs": roll, "old_log_probs": train,
                                        "response_mask": mask, "responses": resp.long()})
    m = calculate_debug_metrics(data)
    err = (torch.exp((roll - train).abs()) * mask).sum() / mask.sum()
    return {"verl_rollout_probs_diff_mean": m["training/rollout_probs_diff_mean"],
            "verl_rollout_probs_diff_max": m["training/rollout_probs_diff_max"],
            "token_mult_prob_error": float(err), "tokens": int(mask.sum())}


def as_is(llm, vllm, spec, out) -> None:
    """verl's own sync: A -> B must equal a fresh load of B, the prefix cache warm with A's KV."""
    r = rollout_for(llm, spec["job"])
    out["as_is"] = {"seconds": [], "errors": []}
    for i in range(spec["repeats"]):
        greedy(llm, vllm)  # the prefix cache holds KV of the weights before the sync
        secs, err = timed_sync(r, spec["B"] if i % 2 == 0 else spec["A"])
        out["as_is"]["seconds"].append(secs)
        out["as_is"]["errors"].append(err)
        if i == 0:
            out["as_is"]["vs_fresh"] = compare(greedy(llm, vllm), out["fresh_B"])
        if err:  # one failure is the finding; a retry would only meet the same one
            break
    if spec["repeats"] % 2 == 0:  # end on B for the mismatch rollouts
        timed_sync(r, spec["B"])


def adapter(llm, vllm, spec, out) -> None:
    """install(): the same ServerAdapter.update_weights call, now through push_weights."""
    import vllm_rlpatch.integrations.verl as rl
    from vllm_rlpatch.integrations.support import IntegrationError

    out["adapter"] = {"verl": str(rl.install()), "seconds": [], "errors": []}
    r = rollout_for(llm, spec["job"])
    try:
        for i in range(spec["repeats"]):
            greedy(llm, vllm)
            secs, err = timed_sync(r, spec["A"] if i % 2 == 0 else spec["B"])
            out["adapter"]["seconds"].append(secs)
            out["adapter"]["errors"].append(err)
            if i == 0:
                out["adapter"]["vs_fresh"] = compare(greedy(llm, vllm), out["initial_A"])
                rep = getattr(r, "rlpatch_report", None)
                out["adapter"]["report"] = None if rep is None else {
                    k: getattr(rep, k) for k in ("guarantee", "version", "transport", "path", "state")}
        if spec["repeats"] % 2 == 0:
            timed_sync(r, spec["A"])
        unsafe = {"delta_flush": {"wire_format": "delta_flush"}, "lora": {"peft_config": {"r": 8}}}
        for name, kw in unsafe.items():
            before = greedy(llm, vllm)
            try:
                asyncio.run(r.update_weights(iter(trainer_state(spec["B"]).items()), **kw))
                res = {"refused": False}
            except IntegrationError as e:
                res = {"refused": True, "message": str(e)}
            res["state_unchanged"] = compare(greedy(llm, vllm), before)["equal"]
            out["adapter"][f"unsafe_{name}"] = res
        out["adapter"]["unsafe_refused"] = all(out["adapter"][f"unsafe_{n}"]["refused"] for n in unsafe)
        out["adapter"]["unsafe_state_unchanged"] = all(out["adapter"][f"unsafe_{n}"]["state_unchanged"]
                                                       for n in unsafe)
    finally:
        rl.uninstall()


def finish(out: dict, *llms) -> None:
    """Print the result, stop the engines' processes (none left behind), exit without the slow teardown."""
    print("RESULT " + json.dumps(out), flush=True)
    for llm in llms:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort; the result is out
            pass
    os._exit(0)


def child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ["VERL_RAY_JOB_ID"] = spec["job"]
    import verl_cpu_platform  # noqa: F401 - the CPU platform, before verl's code runs
    import vllm
    import zmq

    # verl's sender waits on its REQ socket with no timeout: when the worker's load_weights raises, the worker
    # never answers and the sync hangs. A receive timeout on new sockets (pyzmq's context defaults) turns that
    # into an error the benchmark records.
    zmq.Context.instance().setsockopt(zmq.RCVTIMEO, 20_000)

    kw = dict(dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=64 << 20, enforce_eager=True,
              enable_prefix_caching=True, logprobs_mode="processed_logprobs", seed=0)
    out = {"mode": spec["mode"], "model": spec["model"], "vllm": vllm.__version__, "verl": metadata.version("verl")}
    if spec.get("fresh_only"):  # a fresh load of B, in a process of its own (one engine per process)
        fresh = vllm.LLM(model=spec["B"], **kw)
        out["fresh_B"] = greedy(fresh, vllm)
        out["mismatch_fresh"] = mismatch(fresh, vllm, spec["B"])
        finish(out, fresh)
    out["fresh_B"] = spec["fresh_B"]
    llm = vllm.LLM(model=spec["A"], worker_extension_cls=VERL_EXT, **kw)
    out["initial_A"] = greedy(llm, vllm)
    as_is(llm, vllm, spec, out)
    try:
        out["mismatch_as_is"] = mismatch(llm, vllm, spec["B"])
    except Exception as e:  # noqa: BLE001
        out["mismatch_error"] = f"{type(e).__name__}: {e}"
    if spec["mode"] == "on" and spec.get("adapter", True):
        adapter(llm, vllm, spec, out)
    finish(out, llm)


def run_child(py: str, spec: dict, tmp: Path) -> dict:
    f = tmp / f"spec-{spec['model']}-{spec['mode']}{'-fresh' if spec.get('fresh_only') else ''}.json"
    f.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_")}
    (tmp / "verl_cpu_platform.py").write_text(CPU_PLATFORM)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(tmp), env.get("PYTHONPATH")) if x)
    if spec["mode"] == "off":
        env["VLLM_RLPATCH_ENABLED"] = "0"
    log = tmp / f"{f.stem}.log"
    with open(log, "w") as fh:  # a file, not a pipe: helpers the child leaves behind must not hold our read open
        p = subprocess.run([py, __file__, "--child", str(f)], stdout=fh, stderr=subprocess.STDOUT, env=env,
                           timeout=600)
    text = log.read_text()
    Path("/tmp", log.name).write_text(text)
    # the first exception vLLM's worker logged (the root cause behind the RPC error the sync sees)
    worker = next((ln.split("] ", 1)[-1].strip() for ln in text.splitlines()
                   if "(Worker" in ln and re.search(r"\] \w+(Error|Exception): ", ln)), None)
    for line in text.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]) | {"worker_error": worker}
    return {"mode": spec["mode"], "model": spec["model"], "error": f"exit {p.returncode}",
            "tail": text[-3000:]}


def summary(runs: list[dict]) -> dict:
    import statistics as st

    def med(xs):
        return st.median(xs) if xs else None
    rows = {}
    for r in runs:
        a = r.get("as_is", {})
        rows[f"{r['model']}/{r['mode']}"] = {
            "sync_correct": a.get("vs_fresh", {}).get("equal"), "sync_error": next((e for e in a.get("errors", [])
                                                                                      if e), None),
            "sync_s_median": med([s for s, e in zip(a.get("seconds", []), a.get("errors", [])) if not e]),
            "adapter_correct": r.get("adapter", {}).get("vs_fresh", {}).get("equal"),
            "adapter_s_median": med(r.get("adapter", {}).get("seconds", [])[1:] or
                                    r.get("adapter", {}).get("seconds", [])),
            "token_mult_prob_error": r.get("mismatch_as_is", {}).get("token_mult_prob_error"),
            "verl_rollout_probs_diff_mean": r.get("mismatch_as_is", {}).get("verl_rollout_probs_diff_mean")}
    return rows


def _by_model(runs, mode, get):
    return {r["model"]: get(r) for r in runs if r.get("mode") == mode and "error" not in r} or None


def _all(d):
    return None if not d else all(v is True for v in d.values())


def fixed(runs) -> list[str]:
    """What the plugin changed, from the evidence in the runs (nothing claimed that was not observed)."""
    out = []
    for r in runs:
        a, m = r.get("as_is", {}), r["model"]
        bad = [e for e in a.get("errors", []) if e]
        if r.get("mode") == "off" and bad:
            cause = f" (vLLM's worker: {r['worker_error']})" if r.get("worker_error") else ""
            on_ok = any(o["model"] == m and o.get("mode") == "on" and o.get("as_is", {}).get("vs_fresh", {})
                        .get("equal") for o in runs)
            out.append(f"{m}: verl's own sync fails on stock vLLM CPU: {bad[0]}{cause}"
                       + ("; with the plugin the same sync equals a fresh load" if on_ok else ""))
        elif r.get("mode") == "off" and a.get("vs_fresh", {}).get("equal") is False:
            out.append(f"{m}: after verl's own sync on stock vLLM the engine differs from a fresh load "
                       f"(tokens equal: {a['vs_fresh']['tokens_equal']}, max |dlogprob| "
                       f"{a['vs_fresh']['max_abs_logprob_diff']})")
        ad = r.get("adapter", {})
        if ad.get("vs_fresh", {}).get("equal") and ad.get("report"):
            out.append(f"{m}, adapter: one validated, versioned update per sync ({ad['report'].get('guarantee')} "
                       f"guarantee); a delta_flush call refused with the engine unchanged: "
                       f"{bool(ad.get('unsafe_refused') and ad.get('unsafe_state_unchanged'))}")
    if not any("stock vLLM" in x for x in out):
        out.insert(0, "nothing to fix in verl's own sync on this path: it equals a fresh load with the plugin off "
                      "and on (verl resets the prefix cache itself)")
    return out


def _mismatch_off(r):
    if any(r.get("as_is", {}).get("errors", [])):
        return r.get("fresh_run", {}).get("mismatch_fresh", {}).get("token_mult_prob_error")
    return r.get("mismatch_as_is", {}).get("token_mult_prob_error")


def table_row(runs, vllm_version) -> dict:
    def secs(xs):
        import statistics as st
        return st.median(xs) if xs else None
    on = _by_model(runs, "on", lambda r: secs([s for s, e in zip(r["as_is"]["seconds"], r["as_is"]["errors"])
                                               if not e]))
    ad = _by_model(runs, "on", lambda r: secs(r.get("adapter", {}).get("seconds", [])))
    return {
        "framework": "verl", "release": next((r.get("verl") for r in runs if r.get("verl")), None),
        "vllm": vllm_version, "code": "real",
        "what_runs": "ServerAdapter.update_weights, BucketedWeightSender (shared memory) and "
                     "vLLMColocateWorkerExtension.update_weights_from_ipc from the installed package; the Ray "
                     "server actor is an in-process stand-in; verl's platform registry gets a CPU platform",
        "sync_correct_off": _all(_by_model(runs, "off", lambda r: r["as_is"].get("vs_fresh", {}).get("equal"))),
        "sync_correct_on": _all(_by_model(runs, "on", lambda r: r["as_is"].get("vs_fresh", {}).get("equal"))),
        "sync_correct_adapter": _all(_by_model(runs, "on", lambda r: r.get("adapter", {}).get("vs_fresh",
                                                                                             {}).get("equal"))),
        "sync_seconds_off": _by_model(runs, "off", lambda r: secs([s for s, e in zip(
            r["as_is"]["seconds"], r["as_is"]["errors"]) if not e])),
        "sync_seconds_on": on, "sync_seconds_adapter": ad,
        "adapter_speedup": {k: on[k] / v for k, v in (ad or {}).items() if v and on and on.get(k)} or None,
        "mismatch_off": _by_model(runs, "off", _mismatch_off),
        "mismatch_off_basis": "after verl's sync where it succeeded; where it failed (the engine then holds a mix "
                              "of weights), a fresh stock-vLLM load of the same weights",
        "mismatch_on": _by_model(runs, "on", lambda r: r.get("mismatch_as_is", {}).get("token_mult_prob_error")),
        "plugin_fixed": fixed(runs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/integrations/")
    ap.add_argument("--models", default="llama-tiny,qwen2-tiny")
    ap.add_argument("--modes", default="off,on")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--with-runs", help="an earlier result JSON: its runs join this one's (those of a model and "
                                         "mode run again here are replaced)")
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        child(a.child)
        return 0
    try:
        import verl  # noqa: F401

        from vllm_rlpatch.models import path
    except ImportError as e:
        print(f"verl.py: {e} (install ci/envs/integrations/verl.txt next to vLLM)", file=sys.stderr)
        return 2
    runs = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for model in a.models.split(","):
            A = path(model)
            B = perturbed(A, str(tmp / f"{model}-B"), seed=7)
            for mode in a.modes.split(","):
                spec = {"model": model, "mode": mode, "A": A, "B": B, "repeats": a.repeats,
                        "job": f"rlpatch{os.getpid()}"}
                fresh = run_child(sys.executable, {**spec, "fresh_only": True}, tmp)
                spec["fresh_B"] = fresh.get("fresh_B")
                runs.append(run_child(sys.executable, spec, tmp) | {"fresh_run": fresh})
                print(json.dumps(summary(runs[-1:])), flush=True)
    if a.with_runs:
        again = {(r["model"], r["mode"]) for r in runs}
        runs = [r for r in json.loads(Path(a.with_runs).read_text())["runs"]
                if (r["model"], r["mode"]) not in again] + runs
    import vllm

    res = {"framework": "verl", "release": runs[0].get("verl"), "vllm": vllm.__version__, "real_code": True,
           "row": table_row(runs, vllm.__version__.split("+")[0]),
           "hardware": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "amx": "amx_tile" in Path("/proc/cpuinfo").read_text()},
           "loadavg_start": os.getloadavg(), "summary": summary(runs), "runs": runs}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    name = f"verl-vllm{vllm.__version__.split('+')[0]}-cpu.json"
    (Path(a.out) / name).write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res["summary"], indent=1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
