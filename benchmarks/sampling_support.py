"""What the engine's support information costs: decode tokens/s with requests asking for it vs not, in one
engine and one run, on a model with a 32k vocabulary (JSON out; a measurement, never a test).

    python benchmarks/sampling_support.py [--rounds 6] [--out benchmarks/results/sampling_support-<vllm>-cpu.json]

Two Llama-shaped models with a 32,768-token vocabulary, seeded random weights with the head scaled x20 so that
next-token distributions are peaked, built in memory and saved to a temporary directory (no tokenizer:
prompts are token ids, ``skip_tokenizer_init``): ``small`` (hidden 1024, 4 layers, 16 heads; ~100M
parameters, still far smaller than any real 32k-vocabulary LLM) and ``tiny`` (hidden 256, 2 layers: the
worst case, where the sampler is most of a decoding step). Per model, engine A has the plugin's defaults
(``sampling_support`` applied): interleaved rounds (order rotated) of the same batch (32 requests x 16 prompt
tokens x 64 generated tokens) with ``extra_args={"rlpatch_support": True}`` (on) and without (off), for three
sampling settings: T=1.0 with no truncation (the patch's zero-work path), T=0.7 / top-p 0.9 and T=0.7 /
top-k 50 (its full path; top-k alone is vLLM's cheapest truncation, so the largest relative cost). Engines
run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the time the patch's hooks spent (their own
counter) is read next to each round's wall time: a share that machine load (other processes on this host)
distorts less than the tokens/s ratio. Engine B has the patch off (``VLLM_RLPATCH_SAMPLING_SUPPORT=0``: no
sampler hook installed), the same rounds without asking: the cost of the installed-but-unused hook, across two
engines (noisier).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ENGINE = r"""
import json, sys, time
if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    import vllm
    t0 = time.perf_counter()
    llm = vllm.LLM(spec["model"], dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=256 << 20,
                   enforce_eager=True, gpu_memory_utilization=0.5, skip_tokenizer_init=True, max_num_seqs=64,
                   max_num_batched_tokens=1024, seed=0)
    start = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 32000 + 1 for j in range(16)]} for i in range(32)]

    def params(sampling, on):
        extra = {"extra_args": {"rlpatch_support": True}} if on else {}
        return [vllm.SamplingParams(**sampling, max_tokens=64, ignore_eos=True, detokenize=False, seed=s, **extra)
                for s in range(len(prompts))]

    from vllm_rlpatch.patches import sampling_support as S
    out = {"engine_start_s": start, "settings": {}}
    for name, sampling in spec["settings"].items():
        llm.generate(prompts, params(sampling, True), use_tqdm=False)  # warm-up
        rounds = []
        for r in range(spec["rounds"]):
            order = spec["arms"] if r % 2 == 0 else list(reversed(spec["arms"]))
            row = {}
            for arm in order:
                h0 = S.RUNTIME["seconds"]
                t = time.perf_counter()
                outs = llm.generate(prompts, params(sampling, arm == "on"), use_tqdm=False)
                dt = time.perf_counter() - t
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                sup = [getattr(o.outputs[0], "rlpatch_support", None) for o in outs]
                row[arm] = {"seconds": dt, "tokens": n, "tokens_per_s": n / dt,
                            "hook_seconds": S.RUNTIME["seconds"] - h0,
                            "support_tokens": sum(len(s.log_mass_kept) for s in sup if s is not None)}
            rounds.append(row)
            print(f"PROGRESS {name} round {r + 1}/{spec['rounds']}: " + ", ".join(
                f"{a} {row[a]['tokens_per_s']:.0f} tok/s" for a in spec["arms"]), flush=True)
        out["settings"][name] = rounds
    try:
        from vllm_rlpatch import registry
        out["patches"] = {s.name: s.state for s in registry.status()}
    except Exception as e:
        out["patches"] = repr(e)
    print("RESULT " + json.dumps(out), flush=True)
"""

SETTINGS = {"T1_no_truncation": {"temperature": 1.0},
            "T0.7_top_p0.9": {"temperature": 0.7, "top_p": 0.9},
            "T0.7_top_k50": {"temperature": 0.7, "top_k": 50}}
SHAPES = {"small": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 16,
                    "num_key_value_heads": 4},
          "tiny": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2}}


def build_model(dst: Path, shape: str = "small", vocab: int = 32768) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, **SHAPES[shape])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(dst)
    c = json.loads((dst / "config.json").read_text())
    c["rope_theta"] = c.get("rope_parameters", {}).get("rope_theta", 10000.0)
    (dst / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    return str(dst)


def engine(model: str, arms: list[str], rounds: int, env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_")}
    env.update(env_extra)
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: the hooks' own time counter is readable
    spec = {"model": model, "arms": arms, "rounds": rounds, "settings": SETTINGS}
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([sys.executable, "-c", ENGINE, json.dumps(spec)], stdout=subprocess.PIPE, stderr=err,
                             text=True, env=env)
        lines = []
        for line in p.stdout:  # progress as it comes; the result line at the end
            if line.startswith("PROGRESS "):
                print("  " + line[9:].rstrip(), flush=True)
            lines.append(line)
        rc = p.wait(timeout=3600)
        err.seek(0)
        tail = "".join(lines)[-2000:] + err.read()[-4000:]
    res = [line for line in lines if line.startswith("RESULT ")]
    if rc != 0 or not res:
        raise SystemExit(f"engine failed ({rc}):\n{tail}")
    return json.loads(res[-1][7:])


def summarize(rounds: list[dict], a: str, b: str) -> dict:
    ta = [r[a]["tokens_per_s"] for r in rounds]
    tb = [r[b]["tokens_per_s"] for r in rounds]
    paired = [x / y for x, y in zip(ta, tb)]
    share = [r[a]["hook_seconds"] / r[a]["seconds"] for r in rounds]
    return {f"{a}_tokens_per_s_median": statistics.median(ta), f"{b}_tokens_per_s_median": statistics.median(tb),
            f"{a}_over_{b}_median_ratio": statistics.median(ta) / statistics.median(tb),
            f"{a}_over_{b}_paired_median": statistics.median(paired), "paired_ratios": paired,
            f"{a}_over_{b}_best_ratio": max(ta) / max(tb),  # best round of each: load only ever slows a round
            f"{a}_spread": [min(ta), max(ta)], f"{b}_spread": [min(tb), max(tb)],
            "hook_share_of_generate_median": statistics.median(share),
            "hook_share_off_median": statistics.median([r[b]["hook_seconds"] / r[b]["seconds"] for r in rounds])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--shapes", default="small,tiny", help="comma-separated subset of " + ",".join(SHAPES))
    ap.add_argument("--out")
    args = ap.parse_args()
    import torch
    import vllm

    t0 = time.time()
    per_model = {}
    with tempfile.TemporaryDirectory(prefix="rlpatch-support-bench-") as d:
        for shape in args.shapes.split(","):
            model = build_model(Path(d) / f"llama-32k-{shape}", shape)
            print(f"{shape}: engine A (sampling_support applied), requests asking (on) and not (off)", flush=True)
            a = engine(model, ["off", "on"], args.rounds, {})
            print(f"{shape}: engine B (VLLM_RLPATCH_SAMPLING_SUPPORT=0: no sampler hook)", flush=True)
            b = engine(model, ["off"], args.rounds, {"VLLM_RLPATCH_SAMPLING_SUPPORT": "0"})
            summary = {}
            for name in SETTINGS:
                s = summarize(a["settings"][name], "on", "off")
                s["support_tokens_per_on_round"] = a["settings"][name][0]["on"]["support_tokens"]
                s["support_tokens_per_off_round"] = a["settings"][name][0]["off"]["support_tokens"]
                b_off = [r["off"]["tokens_per_s"] for r in b["settings"][name]]
                s["patch_off_engine_tokens_per_s_median"] = statistics.median(b_off)
                s["hook_installed_unused_over_patch_off"] = s["off_tokens_per_s_median"] / statistics.median(b_off)
                summary[name] = s
            per_model[shape] = {"shape": SHAPES[shape], "summary": summary,
                                "engine_A": {"patches": a["patches"], "engine_start_s": a["engine_start_s"],
                                             "rounds": a["settings"]},
                                "engine_B_patch_off": {"patches": b["patches"], "engine_start_s": b["engine_start_s"],
                                                       "rounds": b["settings"]}}
    result = {"tool": "benchmarks/sampling_support.py", "vllm": vllm.__version__, "torch": torch.__version__,
              "device": f"CPU ({platform.machine()}, {os.cpu_count()} cores)", "date": time.strftime("%Y-%m-%d"),
              "load_average_at_end": os.getloadavg(), "vocab": 32768,
              "weights": "seeded random (bf16), lm_head x20; Llama shape, head_dim 64",
              "batch": "32 requests x 16 prompt tokens x 64 generated tokens (ignore_eos), seeds fixed",
              "rounds": args.rounds, "settings": SETTINGS, "seconds": time.time() - t0, "models": per_model}
    out = args.out or str(ROOT / "benchmarks" / "results" / f"sampling_support-vllm{vllm.__version__}-cpu.json")
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    for shape, m in result["models"].items():
        for name, s in m["summary"].items():
            print(f"{shape} {name}: on/off {s['on_over_off_median_ratio']:.4f} (paired "
                  f"{s['on_over_off_paired_median']:.4f}, best rounds {s['on_over_off_best_ratio']:.4f}); hooks {100 * s['hook_share_of_generate_median']:.2f}% of "
                  f"generate (off: {100 * s['hook_share_off_median']:.3f}%); off {s['off_tokens_per_s_median']:.0f} "
                  f"tok/s, on {s['on_tokens_per_s_median']:.0f}; hook installed but unused vs patch off "
                  f"{s['hook_installed_unused_over_patch_off']:.4f}")
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
