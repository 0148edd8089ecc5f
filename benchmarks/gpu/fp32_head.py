"""fp32 lm_head on the GPU (vLLM 0.25.1 from the offline bundle): parity of stock vs all fixes on an
8B-shaped bf16 model, and decode throughput with the fp32 head vs vLLM's bf16 head, in one run.

    python benchmarks/gpu/fp32_head.py build  MODEL_DIR            # the 8B-shaped checkpoint (random, sharpened)
    python benchmarks/gpu/fp32_head.py tput   MODEL_DIR OUT.json   # fp32 vs bf16 head decode throughput
    python benchmarks/gpu/fp32_head.py _engine ...                 # (internal: one engine per patch setting)

The model: Llama-3-8B shapes (hidden 4096, 32 layers, 32/8 heads, intermediate 14336, vocab 128256), weights
N(0, 0.02) drawn on the GPU with seed 0, norms 1, and the lm_head multiplied by SHARPEN so the next-token
distributions are peaked like a trained model's (random weights give near-uniform ones, which hide logprob
errors); the mean next-token entropy is measured and written next to the checkpoint. The tokenizer is the
embedded llama-tiny's (prompt ids < 512). Parity itself is the README command
(`vllm-rlpatch parity --model MODEL_DIR --configs stock,all ...`).
"""

import json
import os
import subprocess
import sys
import time

SHARPEN = 4.0
SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, rope_theta=500000.0)


def build(d):
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_rlpatch.models import path as model_path

    os.makedirs(d, exist_ok=True)
    cfg = LlamaConfig(**SHAPE, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, torch_dtype="bfloat16")
    t0 = time.time()
    with torch.device("meta"):
        m = LlamaForCausalLM(cfg)
    g = torch.Generator(device="cuda").manual_seed(0)
    shard, shards, size, idx = {}, [], 0, {}
    names = [n for n, _ in m.named_parameters()]
    for n, p in m.named_parameters():
        if p.dim() == 1:
            t = torch.ones(p.shape, dtype=torch.bfloat16, device="cuda")
        else:
            t = (torch.randn(p.shape, generator=g, device="cuda", dtype=torch.float32) * 0.02)
            if n == "lm_head.weight":
                t *= SHARPEN
            t = t.to(torch.bfloat16)
        shard[n] = t.cpu()
        size += t.numel() * 2
        if size > 4 << 30 or n == names[-1]:
            fname = f"model-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(d, fname), metadata={"format": "pt"})
            idx.update({k: fname for k in shard})
            shards.append(fname)
            shard, size = {}, 0
    json.dump({"metadata": {}, "weight_map": idx}, open(os.path.join(d, "model.safetensors.index.json"), "w"))
    cfg.save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(model_path(), f), os.path.join(d, f))
    built = time.time() - t0
    # how peaked is it: mean next-token entropy on a few prompts (transformers, bf16, on the GPU)
    model = LlamaForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        lp = model(ids).logits.float().log_softmax(-1)
    ent = float(-(lp.exp() * lp).sum(-1).mean())
    info = {"shape": SHAPE, "sharpen_lm_head": SHARPEN, "init": "N(0, 0.02), norms 1, seed 0 (GPU generator)",
            "mean_next_token_entropy_nats": ent, "uniform_entropy_nats": float(torch.log(torch.tensor(128256.0))),
            "build_seconds": built}
    json.dump(info, open(os.path.join(d, "rlpatch_model_card.json"), "w"), indent=1)
    print(json.dumps(info))


def _engine(model, fp32, out):
    os.environ["VLLM_RLPATCH_FP32_LM_HEAD"] = fp32
    import vllm

    t0 = time.time()
    llm = vllm.LLM(model=model, dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.45, seed=0)
    start = time.time() - t0
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(64)]} for i in range(256)]
    sp = vllm.SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256, ignore_eos=True, logprobs=0, seed=0)
    llm.generate(prompts[:32], sp, use_tqdm=False)  # warm-up
    reps = []
    for _ in range(3):
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        reps.append({"seconds": dt, "tokens": n, "tokens_per_s": n / dt})
    from vllm_rlpatch import registry

    st = {s.name: s.state for s in registry.status()}
    json.dump({"fp32_lm_head": st.get("fp32_lm_head"), "startup_seconds": start, "reps": reps}, open(out, "w"))


def tput(model, out):
    res = {"vllm": None, "model": model, "workload": "256 prompts x (64 prompt + 256 generated) tokens, T=0.7, "
           "top-p 0.9, logprobs=0, CUDA graphs on; 3 timed repeats after a warm-up, per engine", "engines": {}}
    import vllm  # noqa: F401  (version only; the engines run in their own processes)

    res["vllm"] = vllm.__version__
    for order, fp32 in enumerate(("0", "1")):
        tmp = f"{out}.{order}.json"
        p = subprocess.run([sys.executable, __file__, "_engine", model, fp32, tmp], capture_output=True, text=True)
        if p.returncode != 0:
            res["engines"][f"{order}-fp32={fp32}"] = {"error": (p.stdout + p.stderr)[-3000:]}
            continue
        res["engines"][f"{order}-fp32={fp32}"] = json.load(open(tmp))
    by = {"0": [], "1": []}
    for k, v in res["engines"].items():
        if "reps" in v:
            by[k[-1]] += [r["tokens_per_s"] for r in v["reps"]]
    if by["0"] and by["1"]:
        res["bf16_head_tokens_per_s"] = {"min": min(by["0"]), "max": max(by["0"]), "mean": sum(by["0"]) / len(by["0"])}
        res["fp32_head_tokens_per_s"] = {"min": min(by["1"]), "max": max(by["1"]), "mean": sum(by["1"]) / len(by["1"])}
        res["ratio_fp32_over_bf16"] = res["fp32_head_tokens_per_s"]["mean"] / res["bf16_head_tokens_per_s"]["mean"]
    json.dump(res, open(out, "w"), indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "engines"}, indent=1))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "build":
        build(sys.argv[2])
    elif cmd == "tput":
        tput(sys.argv[2], sys.argv[3])
    elif cmd == "_engine":
        _engine(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        raise SystemExit(__doc__)
