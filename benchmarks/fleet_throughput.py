"""Fleet update throughput: ``push_weights([llm_0, ..., llm_{N-1}], tensors)`` on CPU for N = 1 .. 4 engines in one
process, over ``shm`` and ``dist``, on the installed vLLM.

    python benchmarks/fleet_throughput.py [--out FILE.json] [--max-engines 4] [--rounds 7] [--transports shm,dist]
                                          [--settle 1.5] [--device cpu|cuda] [--shape fleet|8b|...] [--gpu-mem 0.35]

A Llama-shaped model (~137 MB of bf16 weights: hidden 1024, 6 layers; dummy weights, nothing is downloaded) in
``--max-engines`` engines started once (dtype bfloat16, max_model_len 256, kv_cache_memory_bytes 256 MiB,
enforce_eager; ``VLLM_ENABLE_V1_MULTIPROCESSING`` as in the environment, default on: each engine's worker in its
own engine-core process, as in tests/test_fleet.py). For each N the first N engines take complete updates of
seeded random weights. Every round takes every N (in a rotating order, so that the fleet sizes compared see the
same drift of the host), each transport, and each update once after ``--settle`` seconds of quiet (the trainer's
step between two updates in an RL loop) and once straight after the previous update (back to back), all
interleaved. Per N, transport and mode, medians over the rounds of:

* the trainer-side stages of the fleet report (``pack`` for shm: packed once for every engine; ``fingerprint``
  and ``send`` for dist: one broadcast group spanning every engine's worker, ``send`` from the group formed to
  the last bucket sent) and their sum, ``trainer_s``; for dist also ``group_s``, the wait for every worker to
  join the group (the prepare RPCs reaching the engines: engine-side latency, reported apart);
* each engine's write time (its workers' ``write``) and its prepare + commit seconds;
* the whole update (``total_s``);
* the same bytes pushed to the same engines one after another (``push_weights(llm, ...)`` per engine, settled
  first): ``sequential_s``, and ``fleet_over_sequential`` = total_s / sequential_s;
* one copy of the same bytes on the device (``copy_s``: memcpy on CPU, a device-to-device copy on a GPU);
* the trainer process's garbage-collection pauses during each update (``samples_gc_s``).

``--device cuda`` (the GPU run of issue 21: two engines on one GPU, ``--max-engines 2 --shape 8b --gpu-mem 0.35
--transports cuda_ipc``): the trainer's weights on the GPU, every engine on the same GPU with
``gpu_memory_utilization`` ``--gpu-mem``; ``cuda_ipc`` sends one set of handles that every engine opens.

``trainer_ratio``: trainer_s at the largest N over N = 1, per transport, settled (the target: <= 1.1: the bytes
are packed once, and with dist sent once by the trainer, whatever N); ``trainer_ratio_back_to_back`` the same
with no pause between updates (on a small host the previous update's engine-side work still runs on the cores the
trainer packs on). Timing is reported, never asserted. Prints progress and writes JSON. Run it on an otherwise idle machine (the engines
share the CPU cores with the trainer).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPE = (1024, 2816, 6, 16, 4, 512)  # hidden, intermediate, layers, heads, kv_heads, vocab: ~137 MB bf16
TRAINER_STAGES = ("pack", "fingerprint", "send")


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(reps: list[dict], n: int) -> dict:
    stages = {k: median([r["stages"].get(k) for r in reps]) for k in TRAINER_STAGES}
    group = [r["stages"]["group"] for r in reps if r["stages"].get("group") is not None]
    stages = {k: v for k, v in stages.items() if v is not None}
    trainer = [sum(r["stages"].get(k, 0.0) for k in TRAINER_STAGES) for r in reps]
    return {
        "engines": n,
        "trainer_s": median(trainer),
        "trainer_stages_s": stages,
        "group_s": median(group),
        "samples_group_s": group,
        "prepare_s": median([r["stages"].get("prepare") for r in reps]),
        "commit_s": median([r["stages"].get("commit") for r in reps]),
        "engine_write_s": [median([r["engines"][i]["stages"].get("worker_write") for r in reps]) for i in range(n)],
        "engine_receive_s": [median([r["engines"][i]["stages"].get("worker_receive") for r in reps])
                             for i in range(n)],
        "engine_seconds": [median([r["engines"][i]["seconds"] for r in reps]) for i in range(n)],
        "total_s": median([r["seconds"] for r in reps]),
        "samples_total_s": [r["seconds"] for r in reps],
        "samples_trainer_s": trainer,
        "samples_gc_s": [r.get("gc_s") for r in reps],
        "guarantee": reps[-1]["engines"][0]["guarantee"] if reps else None,
        "path": reps[-1]["engines"][0]["path"] if reps else None,
        "buckets": reps[-1]["buckets"] if reps else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="default: benchmarks/results/fleet_throughput-vllm<ver>-cpu.json")
    ap.add_argument("--max-engines", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--transports", default=None, help="default: shm,dist on cpu, cuda_ipc on cuda")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--shape", default="fleet", help="fleet (~137 MB, default) or a shape of refit_throughput.py")
    ap.add_argument("--gpu-mem", type=float, default=0.35, help="cuda: gpu_memory_utilization of each engine")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--settle", type=float, default=1.5,
                    help="seconds of quiet before a settled update (default 1.5; the back-to-back ones get none)")
    ap.add_argument("--model-dir", default=None, help="where to write the model config (default: a temp dir)")
    args = ap.parse_args()
    transports = [t for t in (args.transports or ("shm,dist" if args.device == "cpu" else "cuda_ipc")).split(",") if t]
    if args.settle < 0 or args.rounds < 1 or args.max_engines < 1:
        print("fleet_throughput: --settle must be >= 0, --rounds and --max-engines >= 1", file=sys.stderr)
        return 2
    bad = [t for t in transports if t not in ("shm", "dist", "cuda_ipc")]
    if bad or (args.device == "cpu" and "cuda_ipc" in transports):
        print(f"fleet_throughput: transports are shm, dist (and cuda_ipc with --device cuda); got {args.transports}",
              file=sys.stderr)
        return 2
    if not 0 < args.gpu_mem < 1:
        print("fleet_throughput: --gpu-mem must be in (0, 1)", file=sys.stderr)
        return 2
    modes = {"settled": args.settle, "back_to_back": 0.0}
    ratio_key = {"settled": "trainer_ratio", "back_to_back": "trainer_ratio_back_to_back"}

    import refit_throughput as RT
    import torch
    import vllm

    from vllm_rlpatch import status
    from vllm_rlpatch.refit import push_weights

    RT.SHAPES["fleet"] = SHAPE
    if args.shape not in RT.SHAPES:
        print(f"fleet_throughput: --shape {args.shape!r}: one of {', '.join(sorted(RT.SHAPES))}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("fleet_throughput: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"fleet_throughput-vllm{vllm.__version__.split('+')[0]}-{args.device}.json")
    model_dir = args.model_dir or tempfile.mkdtemp(prefix="rlpatch-fleet-bench-")
    try:
        from vllm_rlpatch.models import path as model_path

        tok_from = model_path("llama-tiny")
    except Exception:  # noqa: BLE001 - a BPE tokenizer of its own
        tok_from = None
    RT.make_model(model_dir, args.shape, tok_from)
    kw = dict(model=model_dir, load_format="dummy", dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=256 << 20, gpu_memory_utilization=0.5 if args.device == "cpu" else args.gpu_mem)
    t0 = time.perf_counter()
    llms = []
    for i in range(args.max_engines):
        llms.append(vllm.LLM(**kw))
        print(f"[fleet-bench] engine {i} up ({time.perf_counter() - t0:.1f} s)", flush=True)
    res: dict = {"vllm": vllm.__version__, "torch": torch.__version__, "device": args.device,
                 "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
                 "host": platform.node(),
                 "cpu_count": os.cpu_count(), "engine_start_s": time.perf_counter() - t0,
                 "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
                 "shape_name": args.shape, "gpu_mem": args.gpu_mem if args.device == "cuda" else None,
                 "shape": dict(zip(("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab"),
                                   RT.SHAPES[args.shape])),
                 "max_engines": args.max_engines, "rounds": args.rounds, "transports": transports,
                 "settle_s": args.settle,
                 "patches": {s["name"]: s["state"] for s in status()}}
    schema = llms[0].collective_rpc("rlpatch_refit_describe")[0]["schema"]
    weights = RT.trainer_state(schema, args.device)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    res.update(bytes=nbytes, tensors=len(weights), copy_s=copy_time(nbytes, args.device))
    print(f"[fleet-bench] vLLM {vllm.__version__}: {len(weights)} tensors, {nbytes / 1e6:.1f} MB, "
          f"{args.max_engines} engines, transports {transports}, {args.rounds} rounds", flush=True)

    gc_watch = GcWatch()
    results: dict = {m: {t: {} for t in transports} for m in modes}
    sizes = list(range(1, args.max_engines + 1))
    # warm-up: the first update of each fleet (its shared-memory segments, each new engine's first update)
    for n in sizes:
        for tr in transports:
            rep = push_weights(llms[:n], weights, transport=tr, timeout_s=args.timeout_s)
            print(f"[fleet-bench] N={n} {tr} warm-up {rep.seconds:.3f} s", flush=True)
    reps: dict = {n: {m: {t: [] for t in transports} for m in modes} for n in sizes}
    seq: dict = {n: {t: [] for t in transports} for n in sizes}
    # every round takes every fleet size, in a rotating order: the sizes compared see the same host drift
    for r in range(args.rounds):
        order_n = sizes[r % len(sizes):] + sizes[:r % len(sizes)]
        for n in order_n:
            fleet = llms[:n]
            order = transports[r % len(transports):] + transports[:r % len(transports)]
            morder = list(modes)[r % 2:] + list(modes)[:r % 2]
            for tr in order:
                for m in morder:
                    if modes[m]:
                        time.sleep(modes[m])
                    gc_watch.reset()
                    rep = push_weights(fleet, weights, transport=tr, timeout_s=args.timeout_s).as_dict()
                    rep["gc_s"], rep["gc_collections"] = gc_watch.seconds, gc_watch.collections
                    reps[n][m][tr].append(rep)
                    trainer = sum(rep["stages"].get(k, 0.0) for k in TRAINER_STAGES)
                    print(f"[fleet-bench] round {r + 1}/{args.rounds} N={n} {tr} {m}: total {rep['seconds']:.3f} s, "
                          f"trainer {trainer:.3f} s, slowest {rep['slowest']} {rep['slowest_seconds']:.3f} s",
                          flush=True)
                if n > 1:  # the same engines one after another, each its own update (settled first)
                    time.sleep(args.settle)
                    t1 = time.perf_counter()
                    for llm in fleet:
                        push_weights(llm, weights, transport=tr, timeout_s=args.timeout_s)
                    seq[n][tr].append(time.perf_counter() - t1)
                    print(f"[fleet-bench] round {r + 1}/{args.rounds} N={n} {tr} sequential: {seq[n][tr][-1]:.3f} s",
                          flush=True)
    for n in sizes:
        for m in modes:
            for tr in transports:
                results[m][tr][str(n)] = summarize(reps[n][m][tr], n)
        for tr in transports:  # the sequential pushes are settled: set beside the settled fleet updates
            row = results["settled"][tr][str(n)]
            row["sequential_s"] = median(seq[n][tr]) if n > 1 else row["total_s"]
            row["samples_sequential_s"] = seq[n][tr]
            row["fleet_over_sequential"] = row["total_s"] / row["sequential_s"] if row["sequential_s"] else None
    res["results"] = results["settled"]
    res["results_back_to_back"] = results["back_to_back"]
    top = str(args.max_engines)
    for m, key in ratio_key.items():
        res[key] = {tr: (results[m][tr][top]["trainer_s"] / results[m][tr]["1"]["trainer_s"]
                         if results[m][tr]["1"]["trainer_s"] else None) for tr in transports}
    res["trainer_ratio_engines"] = [1, args.max_engines]
    res["trainer_ratio_target"] = 1.1

    for m in modes:
        print(f"\n[{m}] {'transport':9s} {'N':>2s} {'trainer ms':>11s} {'total ms':>9s} {'sequential ms':>14s} "
              f"{'write ms (per engine)':>24s}")
        for tr in transports:
            for n, row in results[m][tr].items():
                writes = " ".join(f"{(w or 0) * 1e3:.0f}" for w in row["engine_write_s"])
                seq_ms = f"{row['sequential_s'] * 1e3:14.1f}" if row.get("sequential_s") else f"{'':14s}"
                print(f"[{m}] {tr:9s} {n:>2s} {(row['trainer_s'] or 0) * 1e3:11.1f} {row['total_s'] * 1e3:9.1f} "
                      f"{seq_ms} {writes:>24s}")
            ratio = res[ratio_key[m]][tr]
            print(f"[{m}] {tr}: trainer-side N={top} / N=1 = {ratio:.3f} (target <= 1.1)" if ratio is not None
                  else f"[{m}] {tr}: no trainer-side time at N=1")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    print(f"[fleet-bench] wrote {out}", flush=True)
    return 0


class GcWatch:
    """The trainer process's garbage-collection pauses during one update (``gc.callbacks``): seconds and count
    of collections by generation, to tell a collection from the engines' load in a slow round."""

    def __init__(self) -> None:
        import gc

        self.reset()
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def reset(self) -> None:
        self.seconds, self.collections = 0.0, [0, 0, 0]

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.collections[info.get("generation", 0)] += 1


def copy_time(nbytes: int, device: str, reps: int = 5) -> float:
    """Median seconds of one copy of ``nbytes`` on the device (memcpy on CPU, device-to-device on a GPU)."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(reps + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del a, b
    return median(times[1:])


def _end() -> None:
    """os._exit skips the engines' shutdown and the atexit that unlinks the fleet's shared-memory segments: end
    this process's own engine processes (they would outlive it) and unlink the segments."""
    try:
        import psutil

        for c in psutil.Process().children(recursive=True):
            try:
                c.kill()
            except psutil.Error:
                pass
    except ImportError:
        pass
    try:
        from vllm_rlpatch.refit.caches import CACHE

        CACHE.close_pools()
    except Exception:  # noqa: BLE001
        pass


if __name__ == "__main__":
    rc = 1
    try:
        rc = main()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        _end()
        os._exit(rc)  # the engines' shutdown can wait on their processes; the results are written
