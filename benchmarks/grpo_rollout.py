"""GRPO-shaped rollout throughput with a weight update between steps: vLLM defaults vs the RL-correct
configurations (prefix cache `off` / `reset` / `salt`, async scheduling on/off). Not a test: it writes JSON.

    python benchmarks/grpo_rollout.py --out benchmarks/results/grpo_rollout-cpu.json            # CPU, llama-tiny
    python benchmarks/grpo_rollout.py --gpu --out OUT.json                                      # GPU, 1B-shaped dummy model

One engine per configuration, each in its own process (its env decides the plugin's policy), all alive at
once so the runs can be interleaved (round r runs every configuration once, in a rotated order). One run =
K steps; a step = generate P prompts x n samples (each prompt = a shared system prefix + its own part, as
RL prompt templates are), then a weight update before the next step: ``collective_rpc("reload_weights")``
on CPU (real weights), on GPU (dummy weights cannot be reloaded) a trainer-style ``model.load_weights``
of one tensor through ``collective_rpc`` with a callable. Reported per configuration and run: generated tokens/s over the K generate calls (the update is
timed separately), the prefix-cache hit rate (cached prompt tokens / prompt tokens, from each
RequestOutput's ``num_cached_tokens``), and mean/spread over runs; ratios against ``vllm_defaults``.

Configurations (the plugin is installed in all; ``vllm_defaults`` turns every patch off but the CPU AMX fix,
so that one is stock vLLM):
  vllm_defaults     raw logprobs, prefix caching on (stale KV after updates), async on
  off               VLLM_RLPATCH_PREFIX_CACHE=off: processed logprobs, no prefix caching, async left on
  reset             VLLM_RLPATCH_PREFIX_CACHE=reset
  salt              the plugin's defaults (salt by weight version, async left to vLLM)
  salt_async_off    salt + async_scheduling=False (explicit)
  off_async_off     the PipelineRL/AReaL choice: prefix caching off + async scheduling off
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

def stock_env() -> dict[str, str]:
    """Every patch off except ``cpu_amx_permission`` (without it vLLM 0.32 CPU cannot run at all on AMX hosts;
    it changes nothing else): vLLM's own behaviour, the plugin merely loaded."""
    from vllm_rlpatch.patches import ALL_PATCHES

    env = {}
    for s in ALL_PATCHES:
        if s.name != "cpu_amx_permission":
            env[s.env.name] = "stock" if s.toggle is not None else "0"
    return env


CONFIGS = {
    "vllm_defaults": (stock_env(), {}),
    "off": ({"VLLM_RLPATCH_PREFIX_CACHE": "off"}, {}),
    "reset": ({"VLLM_RLPATCH_PREFIX_CACHE": "reset"}, {}),
    "salt": ({}, {}),
    "salt_async_off": ({}, {"async_scheduling": False}),
    "off_async_off": ({"VLLM_RLPATCH_PREFIX_CACHE": "off"}, {"async_scheduling": False}),
}


# ----------------------------------------------------------------------------------------------- worker
def make_prompts(step: int, n_prompts: int, prefix_len: int, own_len: int, vocab: int) -> list[list[int]]:
    system = [(7 * j + 11) % (vocab - 10) + 5 for j in range(prefix_len)]
    return [system + [((step + 1) * 7919 + i * 104729 + j * 31) % (vocab - 10) + 5 for j in range(own_len)]
            for i in range(n_prompts)]


def _load_one_weight(self):
    """Runs in the worker (collective_rpc with a callable): what a trainer's extension does, for one tensor."""
    import torch

    model = self.model_runner.model
    p = dict(model.named_parameters())["model.norm.weight"]
    model.load_weights([("model.norm.weight", torch.ones_like(p))])
    return True


def worker(spec: dict) -> None:
    import vllm

    t0 = time.perf_counter()
    llm = vllm.LLM(**spec["engine"])
    cfg = llm.llm_engine.vllm_config
    info = {"engine_start_s": time.perf_counter() - t0, "vllm": vllm.__version__,
            "logprobs_mode": str(cfg.model_config.logprobs_mode),
            "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
            "async_scheduling": cfg.scheduler_config.async_scheduling}
    b = spec["bench"]
    vocab = min(cfg.model_config.get_vocab_size(), b["prompt_vocab"])
    sp = vllm.SamplingParams(temperature=1.0, top_p=b["top_p"], max_tokens=b["new_tokens"], logprobs=0,
                             ignore_eos=True)  # no per-request seed: vLLM 0.32 CPU cannot offset a seeded generator when a prefill is chunked
    # warm-up (not timed): one small batch
    llm.generate([{"prompt_token_ids": p} for p in make_prompts(-1, 4, 32, 32, vocab)], sp, use_tqdm=False)
    print("READY " + json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        run = int(cmd[1])
        steps = []
        for k in range(b["steps"]):
            prompts = make_prompts(run * 1000 + k, b["prompts"], b["prefix_len"], b["own_len"], vocab)
            reqs = [{"prompt_token_ids": p} for p in prompts for _ in range(b["n"])]
            t0 = time.perf_counter()
            outs = llm.generate(reqs, sp, use_tqdm=False)
            gen_s = time.perf_counter() - t0
            ntok = sum(len(o.outputs[0].token_ids) for o in outs)
            ptok = sum(len(o.prompt_token_ids) for o in outs)
            cached = sum(o.num_cached_tokens or 0 for o in outs)
            t0 = time.perf_counter()
            if b["update"] == "reload":
                llm.collective_rpc("reload_weights")  # the weight update between steps
            else:  # dummy weights cannot be reloaded: a trainer-style model.load_weights of one tensor
                llm.collective_rpc(_load_one_weight)
            upd_s = time.perf_counter() - t0
            steps.append({"gen_s": gen_s, "gen_tokens": ntok, "prompt_tokens": ptok, "cached_tokens": cached,
                          "update_s": upd_s})
        print("RUN " + json.dumps({"run": run, "steps": steps}), flush=True)


# ----------------------------------------------------------------------------------------------- driver
def _start(name: str, env_extra: dict, engine: dict, bench: dict, cache_root: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_")}
    env.update(env_extra)
    env["PYTHONUNBUFFERED"] = "1"
    if cache_root:
        env["VLLM_CACHE_ROOT"] = os.path.join(cache_root, name)
    if bench["update"] == "load_weights":
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a callable (local benchmark only)
    spec = json.dumps({"engine": engine, "bench": bench})
    log = open(os.path.join(os.environ.get("BENCH_LOG_DIR", "/tmp"), f"grpo_{name}.log"), "w")
    p = subprocess.Popen([sys.executable, __file__, "--worker", spec], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    p.log = log
    return p


def _read(proc: subprocess.Popen, prefix: str, name: str) -> dict:
    for line in proc.stdout:  # vLLM logs to stdout: keep those lines in the engine's log
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
        proc.log.write(line)
        proc.log.flush()
    raise RuntimeError(f"engine {name} exited before {prefix.strip()} (exit {proc.wait()}); "
                       f"see {proc.log.name}")


def summarize(runs: list[dict]) -> dict:
    tps = [sum(s["gen_tokens"] for s in r["steps"]) / sum(s["gen_s"] for s in r["steps"]) for r in runs]
    hit = [sum(s["cached_tokens"] for s in r["steps"]) / max(1, sum(s["prompt_tokens"] for s in r["steps"]))
           for r in runs]
    upd = [s["update_s"] for r in runs for s in r["steps"]]
    return {"tok_per_s": tps, "tok_per_s_mean": statistics.mean(tps), "tok_per_s_median": statistics.median(tps),
            "tok_per_s_spread": (max(tps) - min(tps)) / statistics.median(tps) if tps else None,
            "prefix_hit_rate": statistics.mean(hit), "update_s_median": statistics.median(upd)}


def add_ratios(summary: dict) -> None:
    """Ratios to vllm_defaults: of the medians over runs, and the median of per-round paired ratios (each
    round runs every configuration back to back, so drift of the machine cancels)."""
    base = summary.get("vllm_defaults")
    for n, s in summary.items():
        if not base:
            s["ratio_vs_vllm_defaults"] = s["paired_ratio_vs_vllm_defaults"] = None
            continue
        s["ratio_vs_vllm_defaults"] = s["tok_per_s_median"] / base["tok_per_s_median"]
        pairs = [a / b for a, b in zip(s["tok_per_s"], base["tok_per_s"])]
        s["paired_ratio_vs_vllm_defaults"] = statistics.median(pairs) if pairs else None
        s["paired_ratio_range"] = [min(pairs), max(pairs)] if pairs else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--resummarize", metavar="JSON", help="recompute the summary of a results file and exit")
    ap.add_argument("--gpu", action="store_true", help="GPU sizing: 1B-shaped dummy model, 512-token prompts")
    ap.add_argument("--model", help="model directory (default: llama-tiny on CPU, a generated 1B-shaped "
                                    "config with dummy weights on GPU)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, help="prompts per step (GPU 32, CPU 4)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if args.resummarize:
        resummarize(args.resummarize)
        return 0
    if not args.out:
        ap.error("--out is required")
    names = [c for c in args.configs.split(",") if c]
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        ap.error(f"unknown configuration(s) {bad}; choose from {list(CONFIGS)}")
    if args.runs < 2 or args.steps < 2:
        ap.error("--runs and --steps must be >= 2 (a spread needs repeats; an update needs two steps)")
    if args.gpu:
        model = args.model or _gpu_model("/tmp/rlpatch-bench-1b")
        bench = {"steps": args.steps, "prompts": args.prompts or 32, "n": args.n, "prefix_len": 256,
                 "own_len": 256, "new_tokens": 256, "top_p": 1.0, "prompt_vocab": 1990, "update": "load_weights"}
        engine = dict(model=model, load_format="dummy", dtype="bfloat16", max_model_len=2048, seed=0,
                      gpu_memory_utilization=0.12, kv_cache_memory_bytes=12 << 30)
        cache_root = "/tmp/rlpatch-bench-cache"
    else:
        from vllm_rlpatch.models import path

        model = args.model or path("llama-tiny")
        bench = {"steps": args.steps, "prompts": args.prompts or 4, "n": args.n, "prefix_len": 96, "own_len": 64,
                 "new_tokens": 32, "top_p": 1.0, "prompt_vocab": 512, "update": "reload"}
        engine = dict(model=model, dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=128 << 20,
                      enforce_eager=True, gpu_memory_utilization=0.5, block_size=32)
        cache_root = None
    procs = {}
    t0 = time.perf_counter()
    for i, name in enumerate(names):
        env_extra, eng_extra = CONFIGS[name]
        procs[name] = _start(name, env_extra, {**engine, **eng_extra}, bench, cache_root)
        if not args.gpu:  # 2 CPU cores: start one engine at a time
            procs[name].info = _read(procs[name], "READY ", name)
        else:
            time.sleep(3)  # stagger the start-up memory checks
    for name, p in procs.items():
        if not hasattr(p, "info"):
            p.info = _read(p, "READY ", name)
        print(f"[start] {name}: {p.info}", flush=True)
    start_s = time.perf_counter() - t0
    runs: dict[str, list] = {n: [] for n in names}
    for r in range(args.runs):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate: no configuration always first
        for name in order:
            p = procs[name]
            p.stdin.write(f"run {r}\n")
            p.stdin.flush()
            res = _read(p, "RUN ", name)
            runs[name].append(res)
            s = summarize([res])
            print(f"[run {r + 1}/{args.runs}] {name:<15} {s['tok_per_s_mean']:>10.0f} tok/s  "
                  f"prefix hit {s['prefix_hit_rate']:.1%}", flush=True)
        _write(args, names, procs, runs, model, engine, bench, start_s, complete=r + 1 == args.runs)
    for p in procs.values():
        try:
            p.stdin.write("quit\n")
            p.stdin.flush()
            p.wait(timeout=120)
        except Exception:
            p.kill()
    summary = json.loads(Path(args.out).read_text())["summary"]
    print(table(summary))
    print(f"wrote {args.out}")
    return 0


def table(summary: dict) -> str:
    out = [f"{'config':<16} {'median tok/s':>12} {'spread':>8} {'x defaults':>11} {'paired x':>9} {'prefix hit':>11}"]
    for n, s in summary.items():
        r = f"{s['ratio_vs_vllm_defaults']:.3f}" if s.get("ratio_vs_vllm_defaults") else "-"
        pr = f"{s['paired_ratio_vs_vllm_defaults']:.3f}" if s.get("paired_ratio_vs_vllm_defaults") else "-"
        out.append(f"{n:<16} {s['tok_per_s_median']:>12.0f} {s['tok_per_s_spread']:>7.1%} {r:>11} {pr:>9} "
                   f"{s['prefix_hit_rate']:>10.1%}")
    return "\n".join(out)


def resummarize(path: str) -> None:
    """Recompute the summary of a results file from its raw runs (after a change to the statistics)."""
    doc = json.loads(Path(path).read_text())
    summary = {n: {**summarize(r), "engine": doc["summary"].get(n, {}).get("engine")} for n, r in doc["runs"].items() if r}
    add_ratios(summary)
    doc["summary"] = summary
    Path(path).write_text(json.dumps(doc, indent=1))
    print(table(summary))


def _write(args, names, procs, runs, model, engine, bench, start_s, complete: bool) -> None:
    """Write the JSON after every round, so a run cut short still leaves its measured rounds."""
    import torch

    import vllm_rlpatch

    done = [n for n in names if runs[n]]
    summary = {n: summarize(runs[n]) for n in done}
    add_ratios(summary)
    for n in done:
        summary[n]["engine"] = procs[n].info
    doc = {"benchmark": "grpo_rollout", "what": __doc__.split("\n\n")[1].strip(), "complete": complete,
           "device": (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                      else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"),
           "vllm": procs[names[0]].info.get("vllm"), "vllm_rlpatch": vllm_rlpatch.__version__,
           "model": model, "engine_args": engine, "bench": bench,
           "runs_per_config": {n: len(runs[n]) for n in names}, "engines_start_s": start_s,
           "configs": {n: {"env": CONFIGS[n][0], "engine_extra": CONFIGS[n][1]} for n in names},
           "summary": summary, "runs": runs, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))


def _gpu_model(path: str) -> str:
    """A Llama-3.2-1B-shaped config (weights are vLLM's dummy init) with a small tokenizer."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<unk>", "<s>", "</s>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f"the quick brown fox {i} jumps over the lazy dog {i * 7}" for i in range(3000)], tr)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                rope_theta=500000.0, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
                tie_word_embeddings=True).save_pretrained(path)
    return path


if __name__ == "__main__":
    sys.exit(main())
