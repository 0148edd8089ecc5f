"""TRL's own GRPOTrainer (colocate mode) against real vLLM, plugin off and on, and with the one-line adapter.

    python benchmarks/integrations/trl.py --out DIR [--models qwen2-tiny,llama-tiny] [--steps 2]

Run it with the interpreter of an environment holding TRL (ci/envs/integrations/trl.txt) next to vLLM; it writes
``DIR/trl-vllm<version>-<device>.json``. Nothing of TRL is copied: the trainer, its ``VLLMGeneration`` (the
engine TRL builds itself, ``distributed_executor_backend="external_launcher"``), its weight sync
(``VLLMGeneration.sync_weights``) and its importance-sampling inputs all come from the installed package.

Per model, three processes (the plugin is per process):
  * ``--phase on`` (plugin on): ``trainer.train()`` for ``--steps`` steps (TRL syncs before each generation),
    then TRL's own ``sync_weights()`` of the trained policy, timed; the engine's greedy tokens/logprobs on two
    long probe prompts (warmed in the prefix cache with the old weights first) are saved with the trainer's
    weights; then ``use_push_weights(trainer)``, ``trainer.train()`` again (the adapter now syncs inside TRL's
    loop), the adapter's sync timed and probed the same way; then the refusals (a NaN in the policy, an unknown
    TRL release from a dist-info placed first on ``sys.path``, a trainer without vLLM);
  * ``--phase off`` (``VLLM_RLPATCH_ENABLED=0``): ``trainer.train()``, which fails in TRL's sync on vLLM CPU;
    then the policy is moved away from its start (seeded noise) and TRL's sync called again, so the engine's
    state after the failure can be compared with both weight sets;
  * ``--phase fresh``: a new engine (same arguments TRL passes) loads each saved weight set; its greedy
    tokens/logprobs are the reference for "the engine equals a fresh load".

``token_mult_prob_error`` is computed from TRL's own tensors: the rollout logprobs vLLM returned
(``sampling_per_token_logps``) against the trainer's (``old_per_token_logps``, TRL's
``_get_per_token_logps_and_entropies``) over TRL's ``completion_mask``: mean exp(|difference|).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# This file is named after the framework: its own directory must not shadow the installed `trl` package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

PROBE_LEN = 300  # > 2 KV blocks of 128 (vLLM CPU's default block size): the prefix cache holds full blocks
MAX_LEN = 512
REPEAT = 5


def engine_env() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; TRL passes gpu_memory_utilization only


def probes(vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(PROBE_LEN)] for _ in range(2)]


def greedy(llm, prompts: list[list[int]]) -> dict:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                         for o in outs],
            "cached": [int(o.num_cached_tokens or 0) for o in outs]}


# ------------------------------------------------------------------------------------------------ the trainer
def make_trainer(model: str, steps: int, out: str, use_vllm: bool = True):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    ds = Dataset.from_dict({"prompt": ["the cat sat on", "a b c d e f", "once upon a time", "one two three"] * 8})

    def reward(completions, **kw):
        return [float(len(set(c.split()))) for c in completions]

    args = GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      max_steps=steps, logging_steps=1, use_cpu=True, bf16=False, use_vllm=use_vllm,
                      vllm_mode="colocate", vllm_gpu_memory_utilization=0.1, vllm_max_model_length=MAX_LEN,
                      report_to=[], save_strategy="no", learning_rate=1e-3, seed=0)
    return GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds)


class Mismatch:
    """Observes TRL's ``_generate_and_score_completions`` (its output is returned unchanged): per rollout, the
    token_mult_prob_error between vLLM's and the trainer's logprobs, and TRL's own mean |difference|."""

    def __init__(self, trainer):
        self.rows: list[dict] = []
        inner = trainer._generate_and_score_completions

        def observed(*a, **kw):
            out = inner(*a, **kw)
            self.record(out)
            return out

        trainer._generate_and_score_completions = observed

    def record(self, out: dict) -> None:
        import torch

        if "sampling_per_token_logps" not in out or "old_per_token_logps" not in out:
            return
        mask = out["completion_mask"].bool()
        d = (out["old_per_token_logps"] - out["sampling_per_token_logps"]).abs()[mask]
        d = d[~torch.isnan(d)]
        self.rows.append({"tokens": int(d.numel()), "token_mult_prob_error": float(torch.exp(d).mean()),
                          "max_mult_prob_error": float(torch.exp(d).max()),
                          "trl_sampling_logp_difference_mean": float(d.mean())})


def save_policy(trainer, where: Path) -> str:
    where.mkdir(parents=True, exist_ok=True)
    trainer.model.save_pretrained(str(where))
    trainer.processing_class.save_pretrained(str(where))
    return str(where)


def timed(fn, n: int = REPEAT) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def train(trainer) -> dict:
    t0 = time.perf_counter()
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 - TRL's own failure is the measurement
        return {"ok": False, "error": failure(e), "seconds": time.perf_counter() - t0}
    return {"ok": True, "error": None, "seconds": time.perf_counter() - t0}


def failure(e: BaseException) -> str:
    import traceback

    tb = traceback.extract_tb(e.__traceback__)
    where = next((f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in reversed(tb)
                  if "site-packages/vllm/" in f.filename), None)
    trl = next((f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in reversed(tb)
                if "site-packages/trl/" in f.filename), None)
    return f"{type(e).__name__}: {e} (raised at {where}; TRL frame {trl})"


def phase_on(model: str, steps: int, work: Path) -> dict:
    from vllm_rlpatch.integrations import trl as adapter
    from vllm_rlpatch.refit import weight_version

    trainer = make_trainer(model, steps, str(work / "out"))
    gen = trainer.vllm_generation
    mm = Mismatch(trainer)
    prompts = probes(trainer.model.config.vocab_size)
    res: dict = {"plugin": "on"}
    greedy(gen.llm, prompts)  # the probes' KV, computed with the start weights, in the prefix cache
    res["train_trl_sync"] = train(trainer)
    res["mismatch_trl_sync"] = list(mm.rows)
    greedy(gen.llm, prompts)  # old-weights KV again (the policy moved in the last optimizer step)
    v0 = weight_version(gen.llm)
    t0 = time.perf_counter()
    gen.sync_weights()  # TRL's own method
    first = time.perf_counter() - t0
    res["weight_version_trl_sync"] = [v0, weight_version(gen.llm)]
    res["probe_trl_sync"] = greedy(gen.llm, prompts)
    res["probe_trl_sync_again"] = greedy(gen.llm, prompts)
    res["sync_seconds_trl"] = [first] + timed(gen.sync_weights)
    res["weights_trl_sync"] = save_policy(trainer, work / "w-trl")

    sync = adapter.use_push_weights(trainer)  # the one line
    mm.rows.clear()
    res["train_adapter"] = train(trainer)
    res["mismatch_adapter"] = list(mm.rows)
    greedy(gen.llm, prompts)
    v0 = weight_version(gen.llm)
    t0 = time.perf_counter()
    report = gen.sync_weights()
    first = time.perf_counter() - t0
    res["adapter_report"] = {k: report.as_dict()[k] for k in ("state", "version", "guarantee", "path", "transport",
                                                               "tensors", "bytes", "checks", "post_check")}
    res["weight_version_before_after"] = [v0, weight_version(gen.llm)]
    res["probe_adapter"] = greedy(gen.llm, prompts)
    res["probe_adapter_again"] = greedy(gen.llm, prompts)
    res["sync_seconds_adapter"] = [first] + timed(gen.sync_weights)
    res["weights_adapter"] = save_policy(trainer, work / "w-adapter")
    res["refusals"] = refusals(trainer, gen, prompts, model, work)
    return res


def refusals(trainer, gen, prompts, model: str, work: Path) -> dict:
    import torch

    from vllm_rlpatch.integrations import trl as adapter
    from vllm_rlpatch.integrations.support import IntegrationError
    from vllm_rlpatch.refit import RefitError, weight_version

    out: dict = {}
    before, v0 = greedy(gen.llm, prompts), weight_version(gen.llm)
    p = next(iter(trainer.model.parameters()))
    keep = p.data.clone()
    p.data[0, 0] = float("nan")
    try:
        gen.sync_weights()
        out["nan"] = {"refused": False}
    except RefitError as e:
        after = greedy(gen.llm, prompts)
        out["nan"] = {"refused": True, "kind": e.kind, "state": e.state, "message": str(e).splitlines()[0],
                      "engine_unchanged": after["tokens"] == before["tokens"]
                      and after["logprobs"] == before["logprobs"], "version": [v0, weight_version(gen.llm)]}
    finally:
        p.data.copy_(keep)

    adapter.restore(trainer)
    fake = work / "fake-dist"
    info = fake / "trl-1.99.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: trl\nVersion: 1.99.0\n")
    sys.path.insert(0, str(fake))
    try:
        adapter.use_push_weights(trainer)
        out["unknown_version"] = {"refused": False}
    except IntegrationError as e:
        out["unknown_version"] = {"refused": True, "message": str(e),
                                  "trainer_unchanged": "sync_weights" not in gen.__dict__}
    finally:
        sys.path.remove(str(fake))
    try:
        adapter.use_push_weights(make_trainer(model, 1, str(work / "out-novllm"), use_vllm=False))
        out["no_vllm"] = {"refused": False}
    except IntegrationError as e:
        out["no_vllm"] = {"refused": True, "message": str(e)}
    return out


def phase_off(model: str, steps: int, work: Path) -> dict:
    import torch

    trainer = make_trainer(model, steps, str(work / "out"))
    gen = trainer.vllm_generation
    mm = Mismatch(trainer)
    prompts = probes(trainer.model.config.vocab_size)
    res: dict = {"plugin": "off", "probe_start": greedy(gen.llm, prompts)}
    res["train_trl_sync"] = train(trainer)
    res["mismatch_trl_sync"] = list(mm.rows)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for prm in trainer.model.parameters():
            prm.add_(torch.randn(prm.shape, generator=g) * 0.02 * prm.float().std().clamp_min(1e-3))
    t0 = time.perf_counter()
    try:
        gen.sync_weights()
        res["sync_trl"] = {"ok": True, "error": None}
    except Exception as e:  # noqa: BLE001
        res["sync_trl"] = {"ok": False, "error": failure(e)}
    res["sync_seconds_trl_until_failure"] = time.perf_counter() - t0
    res["probe_trl_sync"] = greedy(gen.llm, prompts)
    res["weights_trl_sync"] = save_policy(trainer, work / "w-off")
    return res


def make_larger(where: Path, layers: int, hidden: int) -> str:
    """A randomly initialised Qwen2 of ``layers`` x ``hidden`` (qwen2-tiny's tokenizer and vocabulary), saved in
    bfloat16: sync timing where the weights, not the fixed costs, dominate."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from vllm_rlpatch.models import path

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256,
                      max_position_embeddings=1024, tie_word_embeddings=False, dtype="bfloat16")
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(where))
    AutoTokenizer.from_pretrained(path("qwen2-tiny")).save_pretrained(str(where))
    return str(where)


def phase_timing(layers: int, hidden: int, work: Path) -> dict:
    """TRL's own sync vs the adapter's on one trainer and engine (no training): ``REPEAT`` timed syncs each after
    one untimed, alternating blocks; the engine's greedy output after each way must be the same."""
    from vllm_rlpatch.integrations import trl as adapter

    model = make_larger(work / "larger", layers, hidden)
    trainer = make_trainer(model, 1, str(work / "out"))
    gen = trainer.vllm_generation
    prompts = probes(512)
    n = sum(p.numel() for p in trainer.model.parameters())
    res: dict = {"model": f"random Qwen2 {layers}x{hidden}", "parameters": n, "trl": [], "adapter": []}
    for _ in range(2):
        adapter.restore(trainer)
        gen.sync_weights()
        res["trl"] += timed(gen.sync_weights)
        after_trl = greedy(gen.llm, prompts)
        sync = adapter.use_push_weights(trainer)
        gen.sync_weights()
        res["adapter"] += timed(gen.sync_weights)
        after_adapter = greedy(gen.llm, prompts)
        res["same_output"] = after_trl["tokens"] == after_adapter["tokens"] and \
            after_trl["logprobs"] == after_adapter["logprobs"]
    res["report"] = {k: sync.last.as_dict()[k] for k in ("guarantee", "path", "transport", "bytes", "stages")}
    return res


def phase_fresh(dirs: list[str]) -> dict:
    import gc

    from vllm import LLM

    out = {}
    for d in dirs:
        llm = LLM(model=d, dtype="bfloat16", max_model_len=MAX_LEN, max_num_batched_tokens=4096, seed=0,
                  logprobs_mode="processed_logprobs", gpu_memory_utilization=0.1)
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


def mean_err(rows: list[dict]) -> float | None:
    rows = [r for r in rows if r["tokens"]]
    if not rows:
        return None
    return sum(r["token_mult_prob_error"] * r["tokens"] for r in rows) / sum(r["tokens"] for r in rows)


def one_model(model: str, steps: int, work: Path, log: Path) -> dict:
    from vllm_rlpatch.models import path

    mdir = path(model)
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_")}
    on = sub(["--phase", "on", "--model", mdir, "--steps", str(steps), "--work", str(work / model / "on")], base,
             log)
    off = sub(["--phase", "off", "--model", mdir, "--steps", str(steps), "--work", str(work / model / "off")],
              {**base, "VLLM_RLPATCH_ENABLED": "0"}, log)
    fresh_on = sub(["--phase", "fresh", "--dirs", on["weights_trl_sync"], on["weights_adapter"]], base, log)
    fresh_off = sub(["--phase", "fresh", "--dirs", off["weights_trl_sync"]], {**base, "VLLM_RLPATCH_ENABLED": "0"},
                    log)
    start_off = off["probe_start"]
    checks = {
        "trl_sync_plugin_on": equal(on["probe_trl_sync"], fresh_on[on["weights_trl_sync"]]),
        "adapter": equal(on["probe_adapter"], fresh_on[on["weights_adapter"]]),
        "trl_sync_plugin_off_vs_fresh": equal(off["probe_trl_sync"], fresh_off[off["weights_trl_sync"]]),
        "trl_sync_plugin_off_vs_start": equal(off["probe_trl_sync"], start_off),
    }
    return {"model": model, "on": on, "off": off, "fresh_on": fresh_on, "fresh_off": fresh_off, "checks": checks,
            "stale_kv": {"trl_sync_cached_after": on["probe_trl_sync"]["cached"],
                         "adapter_cached_after": on["probe_adapter"]["cached"],
                         "adapter_cached_second_pass": on["probe_adapter_again"]["cached"]}}


def row(per_model: list[dict], timing: dict | None, vllm_version: str, trl_version: str) -> dict:
    def med(key):
        return {m["model"]: statistics.median(m["on"][key]) for m in per_model}

    t_trl, t_ad = med("sync_seconds_trl"), med("sync_seconds_adapter")
    if timing:
        name = f"{timing['model']} ({timing['parameters'] / 1e6:.0f}M parameters)"
        t_trl[name], t_ad[name] = statistics.median(timing["trl"]), statistics.median(timing["adapter"])
    off_err = [m["off"]["train_trl_sync"]["error"] or m["off"]["sync_trl"]["error"] for m in per_model]
    return {
        "framework": "TRL", "release": trl_version, "vllm": vllm_version, "code": "real",
        "what_runs": "GRPOTrainer (colocate) from the installed package: train(), VLLMGeneration.sync_weights",
        "sync_correct_off": all(m["checks"]["trl_sync_plugin_off_vs_fresh"]["equal"] for m in per_model)
        and all(m["off"]["train_trl_sync"]["ok"] for m in per_model),
        "sync_correct_on": all(m["checks"]["trl_sync_plugin_on"]["equal"] for m in per_model),
        "sync_correct_adapter": all(m["checks"]["adapter"]["equal"] for m in per_model),
        "sync_seconds_off": None, "sync_off_failure": off_err[0],
        "sync_seconds_on": t_trl, "sync_seconds_adapter": t_ad,
        "adapter_speedup": {k: t_trl[k] / t_ad[k] for k in t_trl},
        "mismatch_off": None,
        "mismatch_on": {m["model"]: mean_err(m["on"]["mismatch_trl_sync"]) for m in per_model},
        "mismatch_adapter": {m["model"]: mean_err(m["on"]["mismatch_adapter"]) for m in per_model},
        "weight_versions_per_sync": {m["model"]: {"trl": m["on"]["weight_version_trl_sync"][1]
                                                  - m["on"]["weight_version_trl_sync"][0],
                                                  "adapter": m["on"]["weight_version_before_after"][1]
                                                  - m["on"]["weight_version_before_after"][0]} for m in per_model},
        "plugin_fixed": [
            "TRL's own colocate sync raises on vLLM CPU without the plugin (" + off_err[0] + ") after writing the "
            "tensors before the failing one: the engine then matches neither the old nor the new weights; with "
            "the plugin each direct load_weights goes through a strict layerwise reload and the engine equals a "
            "fresh load",
            "with the adapter: one validated, versioned update per sync (rollback guarantee, NaN refused before "
            "any write) instead of one engine update event per completed layer, and no KV of older weights "
            "served without TRL's reset_prefix_cache",
        ],
    }


def driver(out: Path, models: list[str], steps: int, larger: str) -> Path:
    import trl
    import vllm

    ver = vllm.__version__.split("+")[0]
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rlpatch-trl-"))
    log = work / "trl.log"  # the processes' output (vLLM logs); named in the error if one fails
    log.write_text("")
    t0 = time.time()
    per_model = [one_model(m, steps, work, log) for m in models]
    timing = None
    if larger:
        base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_")}
        timing = sub(["--phase", "timing", "--larger", larger, "--work", str(work / "timing")], base, log)
    amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    doc = {"benchmark": "integrations/trl", "row": row(per_model, timing, ver, trl.__version__),
           "models": per_model, "timing_larger": timing,
           "host": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "amx": amx,
                    "note": "CPU timings; the host may have been shared with other work"},
           "seconds": time.time() - t0, "steps": steps}
    dest = out / f"trl-vllm{ver}-cpu.json"
    dest.write_text(json.dumps(doc, indent=1) + "\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="directory for the JSON (the driver)")
    ap.add_argument("--models", default="qwen2-tiny,llama-tiny")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--larger", default="8x1024", help="LAYERSxHIDDEN of the random model for sync timing ('' skips)")
    ap.add_argument("--phase", choices=("on", "off", "fresh", "timing"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--dirs", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.phase is None:
        if not a.out:
            print("trl.py: --out DIR is required", file=sys.stderr)
            return 2
        if a.steps < 1:
            print("trl.py: --steps must be >= 1", file=sys.stderr)
            return 2
        m = re.fullmatch(r"(\d+)x(\d+)", a.larger)
        if a.larger and (m is None or int(m[1]) < 1 or int(m[2]) % 256):
            print(f"trl.py: --larger {a.larger!r}: expected LAYERSxHIDDEN, hidden a multiple of 256 (8x1024)",
                  file=sys.stderr)
            return 2
        print(driver(Path(a.out), [m for m in a.models.split(",") if m], a.steps, a.larger))
        return 0
    engine_env()
    if a.phase == "fresh":
        res = phase_fresh(a.dirs)
    elif a.phase == "timing":
        layers, hidden = (int(x) for x in a.larger.split("x"))
        res = phase_timing(layers, hidden, Path(a.work))
    else:
        work = Path(a.work)
        work.mkdir(parents=True, exist_ok=True)
        res = (phase_on if a.phase == "on" else phase_off)(a.model, a.steps, work)
    Path(a.json).write_text(json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
