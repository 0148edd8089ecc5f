"""OpenRLHF's vLLM-side weight sync against real vLLM on CPU, plugin off and on, and with the one-line adapter.

    python benchmarks/integrations/openrlhf.py --out DIR [--models qwen2-tiny,llama-tiny]

Run it with the interpreter of an environment holding OpenRLHF (ci/envs/integrations/openrlhf.txt) next to vLLM;
it writes ``DIR/openrlhf-vllm<version>-cpu.json``.

What is OpenRLHF's own code here, from the installed package (0.11.2):
  * the worker extension: every engine is built with OpenRLHF's engine arguments (``openrlhf/trainer/ray/
    vllm_engine.py``, lines 264-280) and ``worker_extension_cls="openrlhf.trainer.ray.vllm_worker_wrap
    .WorkerWrap"``; vLLM imports that class from the package and mixes it into the worker;
  * ``WorkerWrap.init_process_group`` and ``WorkerWrap.update_weight`` are called through ``collective_rpc`` as
    OpenRLHF's engine actor calls them (``vllm_engine.py``, lines 107-119); on CPU both fail (their errors are
    recorded: a NCCL communicator, a ``cuda`` tensor).

What is a replay (the same calls, in the same order, citing OpenRLHF 0.11.2):
  * the engine is a ``vllm.LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, OpenRLHF's
    ``full_determinism`` setting, ``vllm_engine.py`` line 100) instead of an ``AsyncLLMEngine`` in a Ray actor;
  * the trainer's ``broadcast_to_vllm`` (``openrlhf/trainer/ray/ppo_actor.py``, lines 409-493): the prefix-cache
    reset first (line 415), then per parameter of ``model.named_parameters()`` (line 486) the worker's
    ``update_weight`` body (``vllm_worker_wrap.py``, lines 39-48) with the broadcast (lines 40-46) replaced by the
    trainer's tensor; that body's ``load_weights`` call (line 48) is OpenRLHF's;
  * with the adapter, the same sequence through ``WorkerWrap.rlpatch_openrlhf_stage`` (the adapter's receive
    without a process group), ``empty_cache=True`` on the last parameter as OpenRLHF marks it (line 427).

The trainer's weights are the embedded model plus seeded noise (one "training step"); its logprobs come from the
Hugging Face model (OpenRLHF's actor is that model under DeepSpeed). ``token_mult_prob_error`` = mean
exp(|trainer - rollout|) over the completion tokens of a sampled rollout; ``vllm_kl`` is OpenRLHF's own
(``openrlhf/models/loss.py``, line 247: mean of rollout - trainer logprobs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# This file is named after the framework: its own directory must not shadow the installed `openrlhf` package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

PROBE_LEN = 300  # > 2 KV blocks of 128 (vLLM CPU's default block size): the prefix cache holds full blocks
MAX_LEN = 512
REPEAT = 5
THEIRS = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"
ADAPTER = "vllm_rlpatch.integrations.openrlhf.WorkerWrap"


def engine(model: str, ext: str | None):
    """An engine with OpenRLHF's arguments (vllm_engine.py 264-280; CPU sizes)."""
    from vllm import LLM

    kw = {"worker_extension_cls": ext} if ext else {}
    return LLM(model=model, enforce_eager=True, seed=0, max_model_len=MAX_LEN, enable_prefix_caching=True,
               dtype="bfloat16", trust_remote_code=True, kv_cache_memory_bytes=128 << 20, **kw)


def probes(vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(PROBE_LEN)] for _ in range(2)]


def greedy(llm, prompts) -> dict:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=8, logprobs=0), use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                         for o in outs],
            "cached": [int(o.num_cached_tokens or 0) for o in outs]}


def trainer_model(model: str, step: int):
    """The 'trained' policy: the model plus seeded noise (``step`` seeds it)."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in m.parameters():
            p.add_((torch.randn(p.shape, generator=g) * 0.05 * p.float().std().clamp_min(1e-3)).to(p.dtype))
    return m


def named(m) -> list:
    return [(n, p.detach().clone()) for n, p in m.named_parameters()]  # ppo_actor.py line 486


def mismatch(llm, m, vocab: int) -> dict:
    """A sampled rollout's logprobs (vLLM) against the trainer's on the same tokens."""
    import random

    import torch
    from vllm import SamplingParams

    rng = random.Random(3)
    prompts = [[rng.randrange(3, vocab) for _ in range(24)] for _ in range(8)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=1.0, max_tokens=16, logprobs=0, seed=0), use_tqdm=False)
    diffs, kl = [], []
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            toks = list(o.outputs[0].token_ids)
            roll = torch.tensor([d[t].logprob for t, d in zip(toks, o.outputs[0].logprobs)])
            ids = torch.tensor([p + toks])
            logits = m(ids).logits[0, len(p) - 1:-1].float()
            old = torch.log_softmax(logits, -1).gather(-1, torch.tensor(toks)[:, None])[:, 0]
            diffs.append((old - roll).abs())
            kl.append(roll - old)
    d, k = torch.cat(diffs), torch.cat(kl)
    return {"tokens": int(d.numel()), "token_mult_prob_error": float(torch.exp(d).mean()),
            "max_mult_prob_error": float(torch.exp(d).max()), "vllm_kl": float(k.mean())}


def failure(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    at = next((f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in reversed(tb)
               if "site-packages/" in f.filename), None)
    theirs = next((f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in reversed(tb)
                   if "site-packages/openrlhf/" in f.filename), None)
    line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {line} (raised at {at}; OpenRLHF frame {theirs})"


def attempt(fn) -> dict:
    try:
        return {"ok": True, "result": fn()}
    except Exception as e:  # noqa: BLE001 - OpenRLHF's own failure on CPU is the measurement
        return {"ok": False, "error": failure(e)}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_code(llm) -> dict:
    """OpenRLHF's WorkerWrap methods as its engine actor calls them (vllm_engine.py 107-119). The engine is
    rank 1 of the update group (``rank_offset`` 1, ppo_actor.py line 133); rank 0, the trainer, hosts the group's
    store and cannot start on CPU (it calls ``torch.cuda.current_device()``, ppo_actor.py line 148), so the
    group's creation fails; ``update_weight`` is then called as OpenRLHF calls it."""
    import torch

    init = attempt(lambda: llm.collective_rpc("init_process_group",
                                              args=("127.0.0.1", free_port(), 1, 2, "openrlhf", "nccl", False)))
    upd = attempt(lambda: llm.collective_rpc("update_weight",
                                             args=("model.norm.weight", torch.bfloat16, (8,), False)))
    return {"init_process_group": init, "update_weight": upd}


def replay_update_weight(worker, name, dtype, shape, tensor):
    """vllm_worker_wrap.py lines 39-48 (OpenRLHF 0.11.2), the broadcast (40-46) replaced by the trainer's tensor."""
    import torch

    assert dtype == worker.model_config.dtype, f"mismatch dtype: src {dtype}, dst {worker.model_config.dtype}"
    weight = torch.empty(shape, dtype=dtype, device=worker.device)
    weight.copy_(tensor)
    worker.model_runner.model.load_weights(weights=[(name, weight)])


def sync_theirs(llm, tensors) -> None:
    llm.reset_prefix_cache()  # ppo_actor.py line 415, before the parameters
    for name, t in tensors:
        llm.collective_rpc(replay_update_weight, args=(name, t.dtype, tuple(t.shape), t))


def sync_adapter(llm, tensors) -> dict:
    llm.reset_prefix_cache()
    out = None
    for i, (name, t) in enumerate(tensors):
        out = llm.collective_rpc("rlpatch_openrlhf_stage", args=(name, t, i == len(tensors) - 1))[0]
    return out


def timed(fn, n: int = REPEAT) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def phase_engine(model: str, ext: str, work: Path, own: bool = False) -> dict:
    """One engine (OpenRLHF's WorkerWrap, or the adapter): OpenRLHF's own calls (``own``: the group's creation
    waits for the trainer's store until vLLM's store timeout, up to 10 minutes on CPU), then the replayed sync."""
    from transformers import AutoTokenizer

    from vllm_rlpatch.refit import weight_version

    llm = engine(model, ext)
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    prompts = probes(vocab)
    res: dict = {"worker_extension_cls": ext, "own_code": own_code(llm) if own else None,
                 "probe_start": greedy(llm, prompts)}
    m = trainer_model(model, 1)
    tensors = named(m)
    greedy(llm, prompts)  # the probes' KV, computed with the start weights, in the prefix cache
    v0 = attempt(lambda: weight_version(llm))
    sync = sync_adapter if ext == ADAPTER else sync_theirs
    t0 = time.perf_counter()
    first = attempt(lambda: sync(llm, tensors))
    res["sync_first_seconds"] = time.perf_counter() - t0
    res["sync"] = first
    res["versions"] = [v0.get("result"), attempt(lambda: weight_version(llm)).get("result")]
    res["probe_after"] = attempt(lambda: greedy(llm, prompts))
    res["probe_after_again"] = attempt(lambda: greedy(llm, prompts))
    res["mismatch"] = attempt(lambda: mismatch(llm, m, vocab))
    where = work / f"w-{'adapter' if ext == ADAPTER else 'theirs'}"
    m.save_pretrained(str(where))
    AutoTokenizer.from_pretrained(model).save_pretrained(str(where))
    res["weights"] = str(where)
    if first["ok"]:
        res["sync_seconds"] = [res["sync_first_seconds"]] + timed(lambda: sync(llm, tensors))
    if ext == ADAPTER:
        res["refusals"] = refusals(llm, tensors, prompts, work)
    return res


def refusals(llm, tensors, prompts, work: Path) -> dict:
    import torch

    from vllm_rlpatch.refit import weight_version

    def state():
        return greedy(llm, prompts), weight_version(llm)

    def refused(fn) -> dict:
        before, v0 = state()
        r = attempt(fn)
        after, v1 = state()
        return {"refused": not r["ok"], "error": r.get("error"), "versions": [v0, v1],
                "engine_unchanged": after["tokens"] == before["tokens"] and after["logprobs"] == before["logprobs"]}

    out: dict = {}
    bad = [(n, t.clone()) for n, t in tensors]
    bad[0][1].view(-1)[0] = float("nan")
    out["nan"] = refused(lambda: sync_adapter(llm, bad))
    out["sent_twice"] = refused(lambda: sync_adapter(llm, tensors[:2] + tensors))
    out["float32"] = refused(lambda: sync_adapter(llm, [(n, t.float()) for n, t in tensors]))
    fake = work / "fake-dist"
    info = fake / "openrlhf-0.99.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: openrlhf\nVersion: 0.99.0\n")
    sys.path.insert(0, str(fake))  # the worker runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    try:
        out["unknown_version"] = refused(lambda: sync_adapter(llm, tensors))
    finally:
        sys.path.remove(str(fake))
    out["after_refusals"] = attempt(lambda: sync_adapter(llm, tensors))  # the next good sync still lands
    return out


def phase_fresh(dirs: list[str]) -> dict:
    import gc

    out = {}
    for d in dirs:
        llm = engine(d, None)
        out[d] = greedy(llm, probes(llm.llm_engine.model_config.hf_config.vocab_size))
        del llm
        gc.collect()
    return out


# ------------------------------------------------------------------------------------------------ the driver
def sub(args: list[str], env: dict[str, str], log: Path) -> dict:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    with open(log, "a") as fh:
        proc = subprocess.run([sys.executable, __file__, *args, "--json", path], env=env, stdout=fh,
                              stderr=subprocess.STDOUT)
    data = json.loads(Path(path).read_text()) if Path(path).stat().st_size else {}
    os.unlink(path)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}; log: {log}")
    return data


def equal(a: dict, b: dict) -> dict:
    diff = max((abs(x - y) for la, lb in zip(a["logprobs"], b["logprobs"]) for x, y in zip(la, lb)), default=0.0)
    return {"tokens_equal": a["tokens"] == b["tokens"], "max_abs_logprob_diff": diff,
            "equal": a["tokens"] == b["tokens"] and diff <= 1e-6}


def one_model(model: str, work: Path, log: Path, own: bool = False) -> dict:
    from vllm_rlpatch.models import path

    mdir = path(model)
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_")}
    base["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    w = work / model
    runs = {}
    for name, ext, env in (("on", THEIRS, base), ("adapter", ADAPTER, base),
                           ("off", THEIRS, {**base, "VLLM_RLPATCH_ENABLED": "0"})):
        flag = ["--own-code"] if own and name == "on" else []
        runs[name] = sub(["--phase", "engine", "--model", mdir, "--ext", ext, "--work", str(w / name), *flag], env,
                         log)
    fresh = sub(["--phase", "fresh", "--dirs", runs["on"]["weights"]], base, log)
    ref = fresh[runs["on"]["weights"]]  # the same seeded weights in every run
    checks = {}
    for name, r in runs.items():
        pa = r["probe_after"]
        checks[name] = equal(pa["result"], ref) if pa["ok"] and r["sync"]["ok"] else \
            {"equal": False, "sync_error": r["sync"].get("error"), "probe_error": pa.get("error")}
    off = runs["off"]
    if off["probe_after"]["ok"]:
        checks["off_vs_start"] = equal(off["probe_after"]["result"], off["probe_start"])
    return {"model": model, "runs": runs, "fresh": fresh, "checks": checks}


def med(r: dict) -> float | None:
    return statistics.median(r["sync_seconds"]) if r.get("sync_seconds") else None


def row(per_model: list[dict], vllm_version: str, release: str) -> dict:
    on = {m["model"]: med(m["runs"]["on"]) for m in per_model}
    ad = {m["model"]: med(m["runs"]["adapter"]) for m in per_model}
    mm = {k: {m["model"]: (m["runs"][k]["mismatch"].get("result") or {}).get("token_mult_prob_error")
              for m in per_model} for k in ("off", "on", "adapter")}
    own = per_model[0]["runs"]["on"]["own_code"] or {}
    return {
        "framework": "OpenRLHF", "release": release, "vllm": vllm_version, "vllm_pinned": "0.29.0",
        "code": "replay",
        "what_runs": "OpenRLHF's WorkerWrap (worker_extension_cls) imported by vLLM from the installed package; "
                     "its init_process_group/update_weight fail on CPU; the broadcast_to_vllm sequence replayed",
        "own_code_on_cpu": {k: v.get("error") for k, v in own.items()},
        "sync_correct_off": all(m["checks"]["off"]["equal"] for m in per_model),
        "sync_correct_on": all(m["checks"]["on"]["equal"] for m in per_model),
        "sync_correct_adapter": all(m["checks"]["adapter"]["equal"] for m in per_model),
        "sync_off_failure": per_model[0]["runs"]["off"]["sync"].get("error"),
        "sync_seconds_off_until_failure": {m["model"]: m["runs"]["off"]["sync_first_seconds"] for m in per_model},
        "sync_seconds_on": on, "sync_seconds_adapter": ad,
        "adapter_speedup": {k: on[k] / ad[k] for k in on if on[k] and ad[k]},
        "mismatch_off": mm["off"], "mismatch_on": mm["on"], "mismatch_adapter": mm["adapter"],
        "weight_versions_per_sync": {m["model"]: {k: (m["runs"][k]["versions"][1] or 0) - (m["runs"][k]["versions"][0]
                                                                                        or 0)
                                                  for k in ("on", "adapter")} for m in per_model},
        "plugin_fixed": fixed(per_model),
    }


def fixed(per_model: list[dict]) -> list[str]:
    """What the plugin changed, from the checks: the stock outcome, then the plugin's and the adapter's."""
    out = []
    for m in per_model:
        off, chk = m["runs"]["off"], m["checks"]
        if off["sync"].get("error"):
            stock = f"stock vLLM CPU fails OpenRLHF's sync ({off['sync']['error'].split(' (raised')[0]})"
        elif not chk["off"]["equal"]:
            stock = (f"stock vLLM CPU runs OpenRLHF's sync but differs from a fresh load (largest logprob difference "
                     f"{chk['off']['max_abs_logprob_diff']:.3f})")
        else:
            stock = "stock vLLM CPU: OpenRLHF's sync equals a fresh load"
        on = "equals a fresh load" if chk["on"]["equal"] else "differs from a fresh load"
        v = (m["runs"]["on"]["versions"][1] or 0) - (m["runs"]["on"]["versions"][0] or 0)
        out.append(f"{m['model']}: {stock}; with the plugin it {on}; the adapter: one validated, versioned update "
                   f"per sync instead of {v}")
    return out


def summary(per_model: list[dict]) -> dict:
    """Per model and plugin mode (``off``, ``on``, ``adapter``): what the integrations table shows."""
    out = {}
    for m in per_model:
        for mode, r in m["runs"].items():
            mm = r["mismatch"].get("result") or {}
            out[f"{m['model']}/{mode}"] = {
                "sync_correct": m["checks"][mode]["equal"],
                "sync_s_median": med(r) if mode != "adapter" else med(m["runs"]["on"]),
                "adapter_s_median": med(r) if mode == "adapter" else None,
                "token_mult_prob_error": mm.get("token_mult_prob_error"),
                "sync_error": r["sync"].get("error")}
    return out


def document(per_model: list[dict], ver: str, release: str, seconds: float) -> dict:
    flags = Path("/proc/cpuinfo").read_text()
    amx, avx512 = "amx_tile" in flags, "avx512f" in flags
    return {"benchmark": "integrations/openrlhf", "framework": "OpenRLHF", "release": release, "vllm": ver,
            "real_code": False, "row": row(per_model, ver, release), "summary": summary(per_model),
            "models": per_model,
            "host": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "amx": amx,
                     "avx512": avx512,
                     "note": "CPU timings; the host may have been shared with other work"},
            "seconds": seconds}


def driver(out: Path, models: list[str], own: bool = False) -> Path:
    from importlib import metadata

    import vllm

    ver = vllm.__version__.split("+")[0]
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rlpatch-openrlhf-"))
    log = work / "openrlhf.log"  # the processes' output (vLLM logs); named in the error if one fails
    log.write_text("")
    t0 = time.time()
    per_model = [one_model(m, work, log, own) for m in models]
    doc = document(per_model, ver, metadata.version("openrlhf"), time.time() - t0)
    dest = out / f"openrlhf-vllm{ver}-cpu.json"
    dest.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="directory for the JSON (the driver)")
    ap.add_argument("--models", default="qwen2-tiny,llama-tiny")
    ap.add_argument("--phase", choices=("engine", "fresh"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--ext", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--dirs", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--own-code", action="store_true",
                    help="also call OpenRLHF's init_process_group/update_weight on the engine (they fail on CPU; "
                         "the group's creation waits up to vLLM's store timeout first)")
    ap.add_argument("--rerow", help=argparse.SUPPRESS)  # recompute a result file's row and summary
    a = ap.parse_args(argv)
    if a.rerow:
        d = json.loads(Path(a.rerow).read_text())
        Path(a.rerow).write_text(json.dumps(document(d["models"], d["row"]["vllm"], d["row"]["release"],
                                                     d["seconds"]), indent=1, default=str) + "\n")
        return 0
    if a.phase is None:
        if not a.out:
            print("openrlhf.py: --out DIR is required", file=sys.stderr)
            return 2
        models = [m for m in a.models.split(",") if m]
        unknown = [m for m in models if m not in ("qwen2-tiny", "llama-tiny")]
        if not models or unknown:
            print(f"openrlhf.py: --models: expected qwen2-tiny and/or llama-tiny, got {a.models!r}", file=sys.stderr)
            return 2
        print(driver(Path(a.out), models, a.own_code))
        return 0
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if a.phase == "fresh":
        res = phase_fresh(a.dirs)
    else:
        work = Path(a.work)
        work.mkdir(parents=True, exist_ok=True)
        res = phase_engine(a.model, a.ext, work, a.own_code)
    Path(a.json).write_text(json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
