"""Refit throughput: push_weights vs the physical limit, in one run, on the installed vLLM.

    python benchmarks/refit_throughput.py --out FILE.json [--device cpu|cuda] [--shape small|1b|8b] [--rounds N]

An engine with a Llama-shaped model (dummy weights: nothing is downloaded) takes complete updates of
random bf16 weights in the trainer's (Hugging Face) naming. Measured in the same process run, interleaved
per round:

* ``memcpy``: one copy of the same bytes (CPU: into a preallocated host buffer; GPU: device to device) -
  the physical anchor;
* ``push_weights`` for each configuration (transport x mode x verify), with the report's per-stage times;
* GPU only: vLLM's own CUDA-IPC weight transfer (``IPCWeightTransferEngine.trainer_send_weights``, packed
  and unpacked) where the installed vLLM has it.

Timing is reported, never asserted. Prints a table and writes JSON (vLLM version, device, patch status).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

SHAPES = {
    # name: (hidden, intermediate, layers, heads, kv_heads, vocab)
    "small": (1024, 2816, 8, 16, 4, 512),  # ~0.25 GB bf16: a quick CPU run
    "1b": (2048, 5632, 16, 16, 4, 512),  # ~0.9 GB bf16
    "8b": (4096, 14336, 32, 32, 8, 128256),  # Llama-3-8B: 16.06 GB bf16
}


def make_model(path: str, shape: str, tokenizer_from: str | None) -> None:
    from transformers import LlamaConfig

    h, i, n, heads, kv, vocab = SHAPES[shape]
    os.makedirs(path, exist_ok=True)
    if tokenizer_from is not None and vocab == 512:
        import shutil

        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(tokenizer_from, f), os.path.join(path, f))
    else:  # a small BPE tokenizer (the 8B shape has its own vocab size; the ids are all that matters)
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel()
        tok.decoder = decoders.ByteLevel()
        tr = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<unk>", "<s>", "</s>"],
                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator([f"the quick brown fox {k} jumps over the lazy dog {k * 7}" for k in range(3000)], tr)
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                unk_token="<unk>").save_pretrained(path)
    LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=i, num_hidden_layers=n, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=h // heads, max_position_embeddings=4096, rope_theta=500000.0,
                bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", tie_word_embeddings=False).save_pretrained(path)


def trainer_state(schema: dict, device: str):
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for name, (shape, dtype) in sorted(schema["tensors"].items()):
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        t.normal_(0, 0.02, generator=g)
        out.append((name, t))
    return out


def median(xs):
    return statistics.median(xs) if xs else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model-dir", default=None, help="where to write the model config (default: a temp dir)")
    ap.add_argument("--upstream", action="store_true", help="also time vLLM's own IPC weight transfer (GPU)")
    args = ap.parse_args()

    import tempfile

    import torch
    import vllm

    from vllm_rlpatch import status
    from vllm_rlpatch.refit import push_weights

    model_dir = args.model_dir or tempfile.mkdtemp(prefix="rlpatch-bench-")
    try:
        from vllm_rlpatch.models import path as model_path

        tok_from = model_path("llama-tiny")
    except Exception:
        tok_from = None
    make_model(model_dir, args.shape, tok_from)
    kw = dict(model=model_dir, load_format="dummy", dtype="bfloat16", max_model_len=1024, enforce_eager=True, seed=0)
    if args.device == "cpu":
        kw.update(kv_cache_memory_bytes=256 << 20, gpu_memory_utilization=0.5)
    else:
        kw.update(gpu_memory_utilization=0.4)  # room for the trainer's copy, a layout buffer and the anchor
        if args.upstream:
            kw.update(weight_transfer_config={"backend": "ipc"})
    t0 = time.perf_counter()
    llm = vllm.LLM(**kw)
    res: dict = {"vllm": vllm.__version__, "torch": torch.__version__, "device": args.device, "shape": args.shape,
                 "host": platform.node(), "cpu_count": os.cpu_count(), "engine_start_s": time.perf_counter() - t0,
                 "patches": {s["name"]: s["state"] for s in status()}}
    if args.device == "cuda":
        res["gpu"] = torch.cuda.get_device_name(0)
    schema = llm.collective_rpc("rlpatch_refit_describe")[0]["schema"]
    weights = trainer_state(schema, args.device)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    res.update(bytes=nbytes, tensors=len(weights))
    print(f"[bench] vLLM {vllm.__version__} {args.device} {args.shape}: {len(weights)} tensors, {nbytes / 1e9:.3f} GB",
          flush=True)

    # (key, push_weights kwargs); "default" is what `push_weights(llm, tensors)` does
    if args.device == "cpu":
        configs = [("default", {}), ("shm/direct/noverify", {"mode": "direct", "verify": False}),
                   ("shm/direct/verify", {"mode": "direct"}),
                   ("shm/validate-then-write", {"guarantee": "validate-then-write"}),
                   ("dist/default", {"transport": "dist"}),
                   ("dist/direct/noverify", {"transport": "dist", "mode": "direct", "verify": False})]
    else:
        configs = [("default", {}), ("cuda_ipc/direct/noverify", {"mode": "direct", "verify": False}),
                   ("cuda_ipc/direct/verify", {"mode": "direct"})]

    def memcpy_once() -> float:
        if args.device == "cpu":
            dst = memcpy_once.buf
            off = 0
            t = time.perf_counter()
            for _, w in weights:
                n = w.numel() * w.element_size()
                dst[off: off + n].copy_(w.reshape(-1).view(torch.uint8))
                off += n
            return time.perf_counter() - t
        src, dst = memcpy_once.src, memcpy_once.dst
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    # warm-up: the first complete update also records (and on a GPU verifies) the copy plan
    rep = push_weights(llm, weights)
    res["first_update"] = rep.as_dict()
    print(f"[bench] first update: {rep.seconds:.3f} s, path={rep.workers[0].get('path')}, "
          f"plan: {rep.workers[0].get('plan')}", flush=True)
    layout = None
    if args.device == "cpu":
        memcpy_once.buf = torch.empty(nbytes, dtype=torch.uint8)
    else:
        from vllm_rlpatch.refit import EngineLayout, RefitError

        try:
            layout = EngineLayout(llm)
            layout.copy_from(weights)
            torch.cuda.synchronize()
            res["layout"] = {"ok": True, "bytes": layout.buffer.numel() * layout.buffer.element_size()}
        except RefitError as e:
            res["layout"] = {"ok": False, "message": str(e)}
        # the anchor: one device-to-device copy of the same bytes (from the layout buffer when there is one)
        memcpy_once.src = (layout.buffer.view(torch.uint8)[:nbytes] if layout is not None
                           else torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
        memcpy_once.dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    memcpy_once()

    samples: dict[str, list] = {"memcpy": []}
    reports: dict[str, list] = {}
    for r in range(args.rounds):
        samples["memcpy"].append(memcpy_once())
        order = configs[r % len(configs):] + configs[:r % len(configs)]  # interleaved, rotated each round
        for key, kw in order:
            if args.device == "cuda":
                torch.cuda.synchronize()
            rep = push_weights(llm, weights, **kw)
            samples.setdefault(key, []).append(rep.seconds)
            reports.setdefault(key, []).append({"seconds": rep.seconds, "stages": rep.stages, "checks": rep.checks,
                                                "path": rep.path, "guarantee": rep.guarantee, "backup": rep.backup,
                                                "post_check": rep.post_check,
                                                "peak_extra_host_bytes": rep.peak_extra_host_bytes,
                                                "peak_extra_device_bytes": rep.peak_extra_device_bytes})
        if layout is not None:
            for verify in (False, True):
                key = f"cuda_ipc_layout/direct/{'verify' if verify else 'noverify'}"
                torch.cuda.synchronize()
                rep = push_weights(llm, layout, mode="direct", verify=verify)
                samples.setdefault(key, []).append(rep.seconds)
                reports.setdefault(key, []).append({"seconds": rep.seconds, "stages": rep.stages, "checks": rep.checks,
                                                    "path": rep.workers[0].get("path"),
                                                    "peak_extra_host_bytes": rep.peak_extra_host_bytes,
                                                    "peak_extra_device_bytes": rep.peak_extra_device_bytes})
        if args.upstream and args.device == "cuda":
            _upstream_round(llm, weights, samples)
        print(f"[bench] round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} {v[-1] * 1e3:.1f} ms" for k, v in samples.items()), flush=True)

    base = median(samples["memcpy"])
    table = {}
    for key, xs in samples.items():
        m = median(xs)
        row = {"median_s": m, "min_s": min(xs), "max_s": max(xs), "samples_s": xs, "gbps": nbytes / m / 1e9,
               "x_memcpy_speed": base / m}
        if key in reports:
            st = reports[key][-1]["stages"]
            transport_s = sum(st.get(k, 0.0) for k in ("pack", "group", "send")) + st.get("worker_open", 0.0) + \
                st.get("worker_receive", 0.0)
            row.update(stages_last=st, checks=reports[key][-1]["checks"], path=reports[key][-1]["path"],
                       guarantee=reports[key][-1]["guarantee"], backup=reports[key][-1]["backup"],
                       transport_only_s=transport_s,
                       transport_only_x_memcpy=(base / transport_s) if transport_s else None,
                       peak_extra_host_bytes=reports[key][-1]["peak_extra_host_bytes"],
                       peak_extra_device_bytes=reports[key][-1]["peak_extra_device_bytes"])
        table[key] = row
    res["results"] = table
    res["rounds"] = args.rounds
    ref = "shm/direct/noverify" if args.device == "cpu" else "cuda_ipc/direct/noverify"
    res["default_x_direct_noverify"] = table["default"]["median_s"] / table[ref]["median_s"]
    print(f"\n{'configuration':34s} {'median ms':>10s} {'GB/s':>8s} {'x memcpy':>9s}  guarantee")
    for key, row in table.items():
        print(f"{key:34s} {row['median_s'] * 1e3:10.1f} {row['gbps']:8.2f} {row['x_memcpy_speed']:9.3f}  "
              f"{row.get('guarantee') or ''}")
    print(f"default / {ref}: {res['default_x_direct_noverify']:.3f}")
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    print(f"[bench] wrote {args.out}")
    return 0


def _upstream_round(llm, weights, samples) -> None:
    """vLLM's own CUDA-IPC weight transfer of the same tensors (0.25 API), packed and unpacked."""
    from dataclasses import asdict

    import torch

    try:
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
    except ImportError:
        return
    send = lambda info: llm.update_weights({"update_info": asdict(info)})  # noqa: E731
    for packed in (False, True):
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.start_weight_update()
        IPCWeightTransferEngine.trainer_send_weights(iter(weights), {"send_mode": send, "packed": packed})
        llm.finish_weight_update()
        torch.cuda.synchronize()
        samples.setdefault(f"upstream_ipc/{'packed' if packed else 'unpacked'}", []).append(time.perf_counter() - t)


if __name__ == "__main__":
    sys.exit(main())
