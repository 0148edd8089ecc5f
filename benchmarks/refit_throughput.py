"""Refit throughput: push_weights vs the physical limit, in one run, on the installed vLLM.

    python benchmarks/refit_throughput.py --out FILE.json [--device cpu|cuda] [--shape small|1b|8b] [--rounds N]
        [--phases idle,loaded]

An engine with a Llama-shaped model (dummy weights: nothing is downloaded) takes complete updates of
random bf16 weights in the trainer's (Hugging Face) naming. Measured in the same process run, interleaved
per round:

* ``memcpy``: one copy of the same bytes (CPU: into a preallocated host buffer; GPU: device to device) -
  the physical anchor;
* ``push_weights`` for each configuration (transport x mode x verify), with the report's per-stage times;
* GPU only: vLLM's own CUDA-IPC weight transfer (``IPCWeightTransferEngine.trainer_send_weights``, packed
  and unpacked) where the installed vLLM has it.

Each round runs twice: on the host as it is (``idle``; the JSON's top level) and with one busy process that
the benchmark starts for that part (``loaded``: a Python loop spinning a CPU, as a colocated trainer's host
rarely is idle; under the JSON's ``loaded`` key, with the process's pid and CPU time). Both record the load
average and the threads a CPU check pass would take before each round, and default / ``direct`` without
checks per round (its run-to-run spread).

Timing is reported, never asserted. Prints a table and writes JSON (vLLM version, device, patch status).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
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


def loadavg() -> dict:
    """The kernel's load averages and its count of runnable tasks now (``/proc/loadavg``)."""
    try:
        with open("/proc/loadavg") as fh:
            f = fh.read().split()
        return {"avg1": float(f[0]), "avg5": float(f[1]), "avg15": float(f[2]), "runnable": int(f[3].split("/")[0])}
    except OSError:
        return {}


class BusyProcess:
    """One other process spinning a CPU (pure Python) for the loaded part of a round: what a colocated trainer's
    host looks like when one of its cores is taken. Records its pid and the CPU time it took."""

    CODE = "import sys; print(flush=True); exec('while True: pass')"

    def __init__(self):
        self.proc = None
        self.record = {"command": [sys.executable, "-c", self.CODE], "pids": [], "cpu_s": []}

    def __enter__(self):
        self.proc = subprocess.Popen(self.record["command"], stdout=subprocess.PIPE)
        self.proc.stdout.readline()  # running Python
        time.sleep(0.2)
        self.record["pids"].append(self.proc.pid)
        return self

    def __exit__(self, *exc):
        try:
            with open(f"/proc/{self.proc.pid}/stat") as fh:
                fields = fh.read().rpartition(")")[2].split()
            self.record["cpu_s"].append((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        except OSError:
            pass
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


def configs_for(device: str) -> list[tuple[str, dict]]:
    """(key, push_weights kwargs); "default" is what ``push_weights(llm, tensors)`` does."""
    if device == "cpu":
        return [("default", {}), ("shm/direct/noverify", {"mode": "direct", "verify": False}),
                ("shm/direct/verify", {"mode": "direct"}),
                ("shm/validate-then-write", {"guarantee": "validate-then-write"}),
                ("dist/default", {"transport": "dist"}),
                ("dist/direct/noverify", {"transport": "dist", "mode": "direct", "verify": False})]
    return [("default", {}), ("cuda_ipc/direct/noverify", {"mode": "direct", "verify": False}),
            ("cuda_ipc/direct/verify", {"mode": "direct"})]


class Anchor:
    """The physical anchor, one copy of the same bytes (CPU: into a preallocated host buffer; GPU: device to
    device, from vLLM's layout buffer where there is one), and that layout for the layout configurations."""

    def __init__(self, llm, weights, nbytes: int, device: str, res: dict):
        import torch

        self.device, self.weights, self.layout = device, weights, None
        if device == "cpu":
            self.buf = torch.empty(nbytes, dtype=torch.uint8)
            return
        from vllm_rlpatch.refit import EngineLayout, RefitError

        try:
            self.layout = EngineLayout(llm)
            self.layout.copy_from(weights)
            torch.cuda.synchronize()
            res["layout"] = {"ok": True, "bytes": self.layout.buffer.numel() * self.layout.buffer.element_size()}
        except RefitError as e:
            res["layout"] = {"ok": False, "message": str(e)}
        self.src = (self.layout.buffer.view(torch.uint8)[:nbytes] if self.layout is not None
                    else torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def memcpy(self) -> float:
        import torch

        if self.device == "cpu":
            off = 0
            t = time.perf_counter()
            for _, w in self.weights:
                n = w.numel() * w.element_size()
                self.buf[off: off + n].copy_(w.reshape(-1).view(torch.uint8))
                off += n
            return time.perf_counter() - t
        torch.cuda.synchronize()
        t = time.perf_counter()
        self.dst.copy_(self.src)
        torch.cuda.synchronize()
        return time.perf_counter() - t


def _record(rep, key: str) -> dict:
    out = {"seconds": rep.seconds, "stages": rep.stages, "checks": rep.checks, "path": rep.path,
           "peak_extra_host_bytes": rep.peak_extra_host_bytes, "peak_extra_device_bytes": rep.peak_extra_device_bytes}
    if key.startswith("cuda_ipc_layout"):
        out["path"] = rep.workers[0].get("path")
    else:
        out.update(guarantee=rep.guarantee, backup=rep.backup, post_check=rep.post_check)
    return out


def one_round(llm, weights, anchor: Anchor, configs, r: int, phase: dict, upstream: bool) -> None:
    """One interleaved round into ``phase`` (its samples and reports): the anchor, every configuration in an
    order rotated by the round, the layout configurations and vLLM's own transfer where asked."""
    import torch

    from vllm_rlpatch.refit import checks, push_weights

    samples, reports = phase["samples"], phase["reports"]
    phase["loadavg"].append(loadavg())
    phase["pass_threads"].append(checks.pass_threads())
    samples.setdefault("memcpy", []).append(anchor.memcpy())
    runs = [(key, weights, kw) for key, kw in configs[r % len(configs):] + configs[:r % len(configs)]]
    if anchor.layout is not None:
        runs += [(f"cuda_ipc_layout/direct/{'verify' if v else 'noverify'}", anchor.layout,
                  {"mode": "direct", "verify": v}) for v in (False, True)]
    for key, what, kw in runs:
        if anchor.device == "cuda":
            torch.cuda.synchronize()
        rep = push_weights(llm, what, **kw)
        samples.setdefault(key, []).append(rep.seconds)
        reports.setdefault(key, []).append(_record(rep, key))
    if upstream and anchor.device == "cuda":
        _upstream_round(llm, weights, samples)


def summarize(phase: dict, nbytes: int, device: str) -> dict:
    """Medians and spreads per configuration, the last report's stages and each stage's median, and default /
    direct-without-checks: of the medians and of each round (the run-to-run spread)."""
    samples, reports = phase["samples"], phase["reports"]
    base = median(samples["memcpy"])
    table = {}
    for key, xs in samples.items():
        m = median(xs)
        row = {"median_s": m, "min_s": min(xs), "max_s": max(xs), "samples_s": xs, "gbps": nbytes / m / 1e9,
               "x_memcpy_speed": base / m}
        if key in reports:
            last = reports[key][-1]
            st = last["stages"]
            transport_s = sum(st.get(k, 0.0) for k in ("pack", "group", "send", "worker_open", "worker_receive"))
            stages = {k for rep in reports[key] for k in rep["stages"]}
            row.update(stages_last=st, stages_median={k: median([rep["stages"].get(k, 0.0) for rep in reports[key]])
                                                      for k in sorted(stages)}, checks=last["checks"], path=last["path"], guarantee=last.get("guarantee"),
                       backup=last.get("backup"), transport_only_s=transport_s,
                       transport_only_x_memcpy=(base / transport_s) if transport_s else None,
                       peak_extra_host_bytes=last["peak_extra_host_bytes"],
                       peak_extra_device_bytes=last["peak_extra_device_bytes"])
        table[key] = row
    ref = "shm/direct/noverify" if device == "cpu" else "cuda_ipc/direct/noverify"
    per_round = [a / b for a, b in zip(samples["default"], samples[ref])]
    return {"results": table, "reference": ref,
            "default_x_direct_noverify": table["default"]["median_s"] / table[ref]["median_s"],
            "default_x_direct_noverify_rounds": per_round,
            "default_x_direct_noverify_spread": [min(per_round), max(per_round)],
            "loadavg": phase["loadavg"], "pass_threads": phase["pass_threads"]}


def print_table(name: str, summary: dict) -> None:
    print(f"\n[{name}] {'configuration':34s} {'median ms':>10s} {'GB/s':>8s} {'x memcpy':>9s}  guarantee")
    for key, row in summary["results"].items():
        print(f"[{name}] {key:34s} {row['median_s'] * 1e3:10.1f} {row['gbps']:8.2f} {row['x_memcpy_speed']:9.3f}  "
              f"{row.get('guarantee') or ''}")
    lo, hi = summary["default_x_direct_noverify_spread"]
    print(f"[{name}] default / {summary['reference']}: {summary['default_x_direct_noverify']:.3f} "
          f"(rounds {lo:.3f}-{hi:.3f}; load average before the rounds "
          f"{', '.join(str(x.get('avg1')) for x in summary['loadavg'])})")


def start_engine(args) -> tuple:
    """The engine on a Llama-shaped model written for the shape, and the result's header."""
    import tempfile

    import torch
    import vllm

    from vllm_rlpatch import status

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
                 "torch_threads": torch.get_num_threads(), "patches": {s["name"]: s["state"] for s in status()}}
    if args.device == "cuda":
        res["gpu"] = torch.cuda.get_device_name(0)
    return llm, res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--phases", default="idle,loaded",
                    help="comma-separated: idle (as the host is), loaded (with one busy process started here)")
    ap.add_argument("--model-dir", default=None, help="where to write the model config (default: a temp dir)")
    ap.add_argument("--upstream", action="store_true", help="also time vLLM's own IPC weight transfer (GPU)")
    args = ap.parse_args()
    phases = [p for p in args.phases.split(",") if p]
    if not phases or set(phases) - {"idle", "loaded"}:
        ap.error("--phases takes idle and/or loaded")

    from vllm_rlpatch.refit import push_weights

    llm, res = start_engine(args)
    weights = trainer_state(llm.collective_rpc("rlpatch_refit_describe")[0]["schema"], args.device)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    res.update(bytes=nbytes, tensors=len(weights), rounds=args.rounds, phases=phases)
    print(f"[bench] vLLM {res['vllm']} {args.device} {args.shape}: {len(weights)} tensors, {nbytes / 1e9:.3f} GB",
          flush=True)
    # warm-up: the first complete update also records (and on a GPU verifies) the copy plan
    rep = push_weights(llm, weights)
    res["first_update"] = rep.as_dict()
    print(f"[bench] first update: {rep.seconds:.3f} s, path={rep.workers[0].get('path')}, "
          f"plan: {rep.workers[0].get('plan')}", flush=True)
    anchor = Anchor(llm, weights, nbytes, args.device, res)
    anchor.memcpy()
    configs = configs_for(args.device)
    busy = BusyProcess()
    data = {p: {"samples": {}, "reports": {}, "loadavg": [], "pass_threads": []} for p in phases}
    for r in range(args.rounds):  # the phases interleaved per round: both see the same background
        for p in phases:
            with busy if p == "loaded" else contextlib.nullcontext():
                one_round(llm, weights, anchor, configs, r, data[p], args.upstream)
            print(f"[bench] round {r + 1}/{args.rounds} {p}: " + ", ".join(
                f"{k} {v[-1] * 1e3:.1f} ms" for k, v in data[p]["samples"].items()), flush=True)
    for p in phases:
        summary = summarize(data[p], nbytes, args.device)
        print_table(p, summary)
        if p == "idle":  # the top level keeps the idle run (what earlier results hold)
            res.update(summary)
        else:
            res[p] = {**summary, "busy_process": busy.record}
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
