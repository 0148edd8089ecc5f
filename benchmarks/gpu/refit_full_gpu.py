"""Weight updates on a full GPU, the default path, in one run (vLLM from the offline bundle, one GPU).

    python benchmarks/gpu/refit_full_gpu.py OUT.json [--shape 8b] [--rounds 5] [--leave-free-gib 10]

1. The fused check kernel (vllm_rlpatch.refit.checks): its digests equal the CPU definition's on odd sizes and
   dtypes, it counts planted NaN/inf, it is deterministic, and its time over one model-sized buffer against a
   device copy of the same bytes and torch's int32 block sums.
2. An engine with a Llama-shaped model (dummy weights) and sleep mode; the trainer's weights (random bf16, same
   names and shapes) on the same GPU. The first update records the copy plan.
3. **Full GPU**: the trainer holds the GPU so that less than one model size is free. Interleaved rounds of: a
   no-op worker RPC, the default ``push_weights(llm, tensors)`` (no room for a backup: ``validate-then-write``),
   ``mode="direct", verify=False``, and vLLM's own CUDA-IPC transfer (unpacked, packed). The floor is
   *copy + RPC*: a device copy of the same bytes (measured before the trainer fills the GPU) plus the RPC.
4. **Room for a backup**: the trainer's extra memory is released; the default call now keeps a device backup
   (``rollback``).
5. **The colocated cycle**, at sleep level 1 and 2: sleep, a trainer step (the weights change in place), wake
   the weights, push, wake the KV cache, generate; the engine must serve the new weights (greedy outputs equal
   to an ordinary push of the same weights).
Writes one JSON with every figure; asserts nothing (the figures are read and committed).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

PROMPTS = ["the quick brown fox 12 jumps over", "the lazy dog 7", "the quick brown fox 99"]


def med(xs):
    return statistics.median(xs) if xs else None


def timed(fn, sync=True):
    import torch

    if sync:
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter() - t, out


def equal_chunked(a, b, chunk_bytes=256 << 20) -> bool:
    """``torch.equal`` without its temporary: ``a == b`` over a model-sized buffer asks for one byte per element
    (7.5 GiB for an 8B model in bf16), more than a full 80 GB card has left. Compared a window at a time."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    fa, fb = a.reshape(-1), b.reshape(-1)
    step = max(1, chunk_bytes // max(1, a.element_size()))
    return all(bool(torch.equal(fa[i:i + step], fb[i:i + step])) for i in range(0, fa.numel(), step))


def scratch_bytes(nbytes, margin=2 << 30) -> int:
    """The kernel checks' buffer: one model size when a source and a destination of that size fit in what the
    device has free (less a margin for the kernels' own scratch), else the largest size that does (recorded)."""
    import torch

    free = torch.cuda.mem_get_info()[0]
    fit = max(0, (free - margin) // 2)
    return int(min(nbytes, fit)) // 4096 * 4096


def kernel_checks(res, nbytes):
    import torch

    from vllm_rlpatch.refit import checks

    r = res["kernel"] = {"available": checks.kernel_available("cuda")}
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = [((3,), torch.bfloat16), ((4097,), torch.bfloat16), ((1000, 4099), torch.bfloat16),
             ((123457,), torch.float32), ((77, 13), torch.float16), ((5000,), torch.int64)]
    agree = []
    for shape, dt in cases:
        t = (torch.randn(shape, device="cuda", generator=g) * 3).to(dt) if dt.is_floating_point else \
            torch.randint(-99, 99, shape, device="cuda", generator=g)
        a = checks.digests([t])[0]
        b = checks.digest_torch(t.cpu())
        agree.append({"shape": list(shape), "dtype": str(dt), "kernel": a.key, "cpu": b.key,
                      "equal": a.key == b.key and a.nonfinite == b.nonfinite})
    r["agrees_with_cpu_definition"] = agree
    t = torch.randn(10_000_019, device="cuda").to(torch.bfloat16)
    t[[5, 77_777, 9_999_999]] = torch.tensor([float("nan"), float("inf"), -float("inf")], device="cuda").to(t.dtype)
    r["planted_nonfinite_found"] = checks.digests([t])[0].nonfinite
    del t
    r["model_bytes"], nbytes = nbytes, scratch_bytes(nbytes)
    r["buffer_bytes"] = nbytes  # below the model size only where two model-sized buffers did not fit
    buf = torch.randn(nbytes // 2, device="cuda", generator=g, dtype=torch.bfloat16)  # no fp32 temporary (an 80 GB card)
    dst = torch.empty_like(buf)
    d1, d2 = checks.digests([buf])[0], checks.digests([buf])[0]
    r["deterministic"] = d1 == d2
    xs = {"copy": [], "fused_check": [], "torch_int32_block_sums": []}
    w = buf.view(torch.int32)
    m = w.numel() // 4096
    for _ in range(7):
        xs["copy"].append(timed(lambda: dst.copy_(buf))[0])
        xs["fused_check"].append(timed(lambda: checks.digests([buf]))[0])
        xs["torch_int32_block_sums"].append(timed(lambda: w[: m * 4096].view(m, 4096).sum(1, dtype=torch.int32).sum())[0])
    # the fused copy-and-check kernel (the write + post-write check of a validated update): one pass that copies
    # and reads every destination block back; its digests must be the source's (random bf16: wrap-around sums)
    if checks.kernel_available("cuda"):
        half = buf.numel() // 2
        srcs, dsts = [buf[:half], buf[half:]], [dst[:half], dst[half:]]
        want = [d.key for d in checks.digests(srcs)]
        dst.zero_()
        plan = checks.copy_check_plan(dsts, srcs)
        r["copy_check_available"] = plan is not None
        if plan is not None:
            r["copy_check_matches"] = plan.run_and_compare(want) == [] and equal_chunked(dst, buf)
            wrong = list(want)
            wrong[1] = want[0]
            r["copy_check_detects"] = plan.run_and_compare(wrong) == [1]
            xs["copy_check"] = [timed(plan.run)[0] for _ in range(7)]
            xs["copy_then_digest"] = [timed(lambda: (dst.copy_(buf), checks.digests(dsts)))[0] for _ in range(7)]
    r.update({k + "_ms": med(v) * 1e3 for k, v in xs.items()}, gb=nbytes / 1e9, kernel_error=checks._KERNEL_ERROR)
    del buf, dst, w
    gc.collect()
    torch.cuda.empty_cache()


def greedy(llm, vllm):
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=12)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def push(llm, weights, **kw):
    from vllm_rlpatch.refit import push_weights

    import torch

    torch.cuda.synchronize()
    rep = push_weights(llm, weights, **kw)
    return rep


def timeline_median(timelines):
    """Each point's median over several reports' timelines, in order."""
    by: dict = {}
    for tl in timelines:
        for k, v in tl:
            by.setdefault(k, []).append(v)
    return sorted(([k, round(med(v), 4)] for k, v in by.items()), key=lambda x: x[1])


def summary(rep):
    return {"seconds": rep.seconds, "guarantee": rep.guarantee, "path": rep.path, "backup": rep.backup,
            "post_check": rep.post_check, "checks": rep.checks, "stages": rep.stages, "state": rep.state,
            "version": rep.version, "peak_extra_device_bytes": rep.peak_extra_device_bytes,
            "timeline": rep.timeline}


def _worker_profile_on(worker):
    """(collective_rpc callable) Profile the worker's refit RPCs from now on."""
    import cProfile

    from vllm_rlpatch.refit import transaction as T

    prof = cProfile.Profile()
    orig = T.WorkerRefit.commit
    depth = [0]

    def profiled(fn, *a, **k):  # nested calls: one enable/disable around the outermost
        depth[0] += 1
        if depth[0] == 1:
            prof.enable()
        try:
            return fn(*a, **k)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                prof.disable()

    def commit(self, *a, **k):
        return profiled(orig, self, *a, **k)

    T.WorkerRefit.commit = commit
    T._bench_profile = (prof, orig, None)
    try:  # the engine core's handling of the RPC around the worker (tensor parallel 1: the same process)
        from vllm.v1.engine.core import EngineCoreProc

        orig_h = EngineCoreProc.__dict__["_handle_client_request"]

        def handle(self, *a, **k):
            return profiled(orig_h, self, *a, **k)

        EngineCoreProc._handle_client_request = handle
        T._bench_profile = (prof, orig, orig_h)
    except Exception:  # noqa: BLE001 - the worker's part only
        pass
    return True


def _worker_profile_off(worker):
    import io
    import pstats

    from vllm_rlpatch.refit import transaction as T

    prof, orig, orig_h = T._bench_profile
    T.WorkerRefit.commit = orig
    if orig_h is not None:
        from vllm.v1.engine.core import EngineCoreProc

        EngineCoreProc._handle_client_request = orig_h
    out = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(28)
        out[key] = buf.getvalue()[-6000:]
    return out


def _core_probe(worker, on=True):
    """(collective_rpc callable; tensor parallel 1: the engine core's process) Time points of vLLM's own steps
    around an RPC in the engine core: the input thread's enqueue (request received and decoded), the busy loop's
    handling, the result's enqueue for the output thread. ``on=False``: remove them and return the points."""
    import builtins
    import gc
    import time

    from vllm.v1.engine.core import EngineCoreProc

    if not on:
        if not hasattr(builtins, "_rlpatch_probe"):
            return []
        log, core, iq_put, oq_put, orig_h = builtins._rlpatch_probe
        del core.input_queue.put_nowait, core.output_queue.put_nowait
        EngineCoreProc._handle_client_request = orig_h
        del builtins._rlpatch_probe
        return list(log)
    core = next((o for o in gc.get_objects() if isinstance(o, EngineCoreProc)), None)
    if core is None:  # a worker process of its own (multiproc executor): no probes there
        return False
    log = []
    iq_put, oq_put = core.input_queue.put_nowait, core.output_queue.put_nowait
    orig_h = EngineCoreProc.__dict__["_handle_client_request"]

    def ip(item, *a, **k):
        log.append(("core.input_queued", time.perf_counter()))
        return iq_put(item, *a, **k)

    def op(item, *a, **k):
        log.append(("core.output_queued", time.perf_counter()))
        return oq_put(item, *a, **k)

    def handle(self, *a, **k):
        log.append(("core.handle", time.perf_counter()))
        return orig_h(self, *a, **k)

    core.input_queue.put_nowait, core.output_queue.put_nowait = ip, op
    EngineCoreProc._handle_client_request = handle
    builtins._rlpatch_probe = (log, core, iq_put, oq_put, orig_h)
    return True


def probe_round(llm, weights, n=7):
    """Where an RPC's round trip goes, point by point, on one clock: the report's timeline (caller, engine core,
    worker) merged with probes in vLLM's client (request sent, answer decoded by the output thread) and engine
    core (see :func:`_core_probe`), for ``n`` no-op RPCs and ``n`` direct pushes without checks. Medians of each
    point, in ms after the call began."""
    import vllm.v1.engine.core_client as cc

    front: list = []
    orig_send = cc.SyncMPClient.__dict__["_send_input"]
    orig_out = cc._process_utility_output

    def send(self, *a, **k):
        front.append(("client.send", time.perf_counter()))
        out = orig_send(self, *a, **k)
        front.append(("client.sent", time.perf_counter()))
        return out

    def util_out(*a, **k):
        front.append(("client.answer_decoded", time.perf_counter()))
        return orig_out(*a, **k)

    llm.collective_rpc(_core_probe)
    cc.SyncMPClient._send_input, cc._process_utility_output = send, util_out
    calls = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            llm.collective_rpc("rlpatch_ping")
            calls.append(("noop", t, time.perf_counter(), None))
            rep = push(llm, weights, mode="direct", verify=False)
            rel = dict(rep.timeline)
            enter = (rep.workers[0].get("engine_core") or {}).get("clock", {}).get("enter")
            t0 = enter - rel["core.enter"] / 1e3 if enter is not None and "core.enter" in rel else None
            calls.append(("direct_noverify", t0, t0 + rep.seconds if t0 is not None else None, rep.timeline))
    finally:
        cc.SyncMPClient._send_input, cc._process_utility_output = orig_send, orig_out
        core = llm.collective_rpc(_core_probe, kwargs={"on": False})[0]
    pts = front + [tuple(p) for p in core]
    out: dict = {}
    for key, t0, t1, tl in calls:
        if t0 is None:
            continue
        mine = [(k, (v - t0) * 1e3) for k, v in pts if t0 - 1e-4 <= v <= t1 + 1e-4] + [tuple(x) for x in (tl or [])]
        mine.append(("end", (t1 - t0) * 1e3))
        seen: dict = {}
        for k, v in sorted(mine, key=lambda x: x[1]):
            kk = k if k not in seen else f"{k}#{seen[k] + 1}"
            seen[k] = seen.get(k, 0) + 1
            out.setdefault(key, {}).setdefault(kk, []).append(v)
    return {key: sorted(([k, round(med(v), 4), len(v)] for k, v in pts_.items()), key=lambda x: x[1])
            for key, pts_ in out.items()}


def _meta_tensors(worker):
    """(collective_rpc callable) Names of the model's parameters and buffers that are on the meta device (a
    layer left mid-reload); empty when every weight is materialised."""
    model = worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.model
    out = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t is not None and t.is_meta]
    return out[:20]


def meta_check(llm, res, where):
    """Record where a weight first shows up on the meta device (the run goes on)."""
    try:
        bad = llm.collective_rpc(_meta_tensors)[0]
    except Exception as e:  # noqa: BLE001
        bad = [f"check failed: {type(e).__name__}: {e}"]
    res.setdefault("meta_trace", []).append({"where": where, "meta": bad})
    if bad:
        print(f"[full-gpu] META after {where}: {bad[:5]}", flush=True)
    return bad


def profiles(llm, weights, configs):
    """Where the time of one call goes, in the trainer and in the worker (cProfile: the figures are inflated by
    the profiler, the shares are what counts)."""
    import cProfile
    import io
    import pstats

    out = {}
    for key, kw in configs:
        try:
            llm.collective_rpc(_worker_profile_on)
        except Exception as e:  # noqa: BLE001 - recorded
            out[key] = {"error": f"{type(e).__name__}: {e}"}
            continue
        prof = cProfile.Profile()
        for _ in range(3):
            prof.enable()
            push(llm, weights, **kw)
            prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(28)
        out[key] = {"trainer_tottime": buf.getvalue()[-6000:], "worker": llm.collective_rpc(_worker_profile_off)[0]}
    return out


def upstream_round(llm, weights, samples):
    """vLLM's own CUDA-IPC weight transfer of the same tensors (0.25 API), unpacked and packed."""
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
        try:
            llm.start_weight_update()
            IPCWeightTransferEngine.trainer_send_weights(iter(weights), {"send_mode": send, "packed": packed})
            llm.finish_weight_update()
        except Exception as e:  # noqa: BLE001 - recorded
            samples.setdefault("upstream_errors", []).append(f"{type(e).__name__}: {str(e)[:200]}")
            try:  # close vLLM's own update (an OOM part-way leaves it open, and push_weights then refuses)
                llm.finish_weight_update()
            except Exception as e2:  # noqa: BLE001 - recorded
                samples["upstream_errors"].append(f"finish_weight_update: {type(e2).__name__}: {str(e2)[:200]}")
            continue
        torch.cuda.synchronize()
        samples.setdefault(f"upstream_ipc_{'packed' if packed else 'unpacked'}", []).append(time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--leave-free-gib", type=float, default=10.0)
    ap.add_argument("--gpu-util", type=float, default=0.35)
    args = ap.parse_args()

    import torch
    import vllm

    from refit_throughput import make_model, trainer_state

    from vllm_rlpatch import status

    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "vllm": vllm.__version__,
           "shape": args.shape, "rounds": args.rounds}

    def save():
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1, default=str)

    model_dir = tempfile.mkdtemp(prefix="rlpatch-full-")
    make_model(model_dir, args.shape, None)
    kw = dict(model=model_dir, load_format="dummy", dtype="bfloat16", max_model_len=1024, enforce_eager=True,
              seed=0, gpu_memory_utilization=args.gpu_util, enable_sleep_mode=True,
              weight_transfer_config={"backend": "ipc"})
    t0 = time.perf_counter()
    try:
        llm = vllm.LLM(**kw)
    except TypeError:  # a vLLM without the native weight-transfer config
        kw.pop("weight_transfer_config")
        llm = vllm.LLM(**kw)
    res["engine_start_s"] = time.perf_counter() - t0
    res["patches"] = {s["name"]: s["state"] for s in status()}
    schema = llm.collective_rpc("rlpatch_refit_describe")[0]["schema"]
    weights = trainer_state(schema, "cuda")
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    res.update(bytes=nbytes, tensors=len(weights))
    print(f"[full-gpu] {res['gpu']} vLLM {vllm.__version__} {args.shape}: {nbytes / 1e9:.2f} GB", flush=True)
    kernel_checks(res, nbytes)
    save()
    print(f"[full-gpu] kernel: {json.dumps({k: v for k, v in res['kernel'].items() if k != 'agrees_with_cpu_definition'})}",
          flush=True)

    # the floor's copy: the same bytes device to device (before the trainer fills the GPU)
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copies = [timed(lambda: flat.copy_(src))[0] for _ in range(7)]
    del flat, src
    gc.collect()
    torch.cuda.empty_cache()
    res["copy_ms"] = med(copies) * 1e3

    # first update: no plan yet (vLLM's layerwise reload; the backup goes to the pinned host arena)
    rep = push(llm, weights)
    res["first_update"] = summary(rep)
    print(f"[full-gpu] first update {rep.seconds:.2f} s {rep.guarantee}/{rep.path}", flush=True)
    res["greedy_after_first"] = greedy(llm, vllm)
    save()

    # the trainer fills the GPU: less than one model size stays free
    free, total = torch.cuda.mem_get_info()
    hog_bytes = max(0, int(free - args.leave_free_gib * 2**30))
    hog = torch.empty(hog_bytes, dtype=torch.uint8, device="cuda")
    res["full_gpu"] = {"free_gib_before": free / 2**30, "hog_gib": hog_bytes / 2**30,
                       "free_gib": torch.cuda.mem_get_info()[0] / 2**30, "model_gib": nbytes / 2**30}
    samples: dict[str, list] = {}
    reports: dict[str, dict] = {}
    stage_samples: dict[str, list] = {}
    timelines: dict[str, list] = {}
    configs = [("default", {}), ("direct_noverify", {"mode": "direct", "verify": False})]
    for r in range(args.rounds):
        samples.setdefault("rpc_noop", []).append(timed(lambda: llm.collective_rpc("rlpatch_ping"), sync=False)[0])
        # what an update's prefix-cache reset costs the engine core (a utility call: compare with rpc_noop)
        samples.setdefault("reset_prefix_cache_call", []).append(timed(llm.reset_prefix_cache, sync=False)[0])
        for key, kw2 in configs[r % 2:] + configs[:r % 2]:
            rep = push(llm, weights, **kw2)
            samples.setdefault(key, []).append(rep.seconds)
            stage_samples.setdefault(key, []).append(dict(rep.stages))
            timelines.setdefault(key, []).append(rep.timeline)
            reports[key] = summary(rep)
        meta_check(llm, res, f"round {r + 1} pushes")
        upstream_round(llm, weights, samples)
        meta_check(llm, res, f"round {r + 1} upstream")
        print(f"[full-gpu] round {r + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in samples.items()
                                                         if isinstance(v[-1], float)), flush=True)
    floor = res["copy_ms"] / 1e3 + med(samples["rpc_noop"])
    res["full_gpu"].update({k + "_ms": med(v) * 1e3 for k, v in samples.items() if v and isinstance(v[0], float)},
                           reports=reports, samples_s={k: v for k, v in samples.items()},
                           floor_ms=floor * 1e3, check_ms=res["kernel"]["fused_check_ms"] * res["kernel"]["model_bytes"]
                           / res["kernel"]["buffer_bytes"])  # per model size (linear in bytes)
    fg = res["full_gpu"]
    fg["stage_medians_ms"] = {key: {st: med([x[st] for x in xs if st in x]) * 1e3 for st in xs[-1]}
                              for key, xs in stage_samples.items()}
    fg["default_x_floor"] = med(samples["default"]) / floor
    fg["direct_noverify_x_floor"] = med(samples["direct_noverify"]) / floor
    fg["default_bound_ms"] = 2 * floor * 1e3 + fg["check_ms"]
    for up in ("upstream_ipc_unpacked", "upstream_ipc_packed"):
        if samples.get(up):
            fg[f"{up}_x_default"] = med(samples[up]) / med(samples["default"])
            fg[f"{up}_x_direct_noverify"] = med(samples[up]) / med(samples["direct_noverify"])
    save()
    print(f"[full-gpu] floor {floor * 1e3:.2f} ms; direct_noverify x{fg['direct_noverify_x_floor']:.2f}, default "
          f"x{fg['default_x_floor']:.2f}; stage medians (ms): {json.dumps(fg['stage_medians_ms'])}", flush=True)
    fg["timeline_ms"] = {key: timeline_median(xs) for key, xs in timelines.items()}
    try:  # vLLM's steps around the RPC too (probes in its client and engine core)
        fg["probe_timeline_ms"] = probe_round(llm, weights)
        print(f"[full-gpu] probed timeline (ms): {json.dumps(fg['probe_timeline_ms'])}", flush=True)
    except Exception as e:  # noqa: BLE001 - recorded
        fg["probe_timeline_ms"] = {"error": f"{type(e).__name__}: {e}"}
    meta_check(llm, res, "probes")
    save()
    if os.environ.get("RLPATCH_BENCH_PROFILE", "1") == "1":
        try:
            fg["profiles"] = profiles(llm, weights, configs)
        except Exception as e:  # noqa: BLE001 - recorded
            fg["profiles"] = {"error": f"{type(e).__name__}: {e}"}
        meta_check(llm, res, "profiles")
        save()
    # rollback asked for explicitly on the full GPU: the backup goes to the pinned host arena, overlapped
    pin = []
    for i in range(3):
        rep = push(llm, weights, guarantee="rollback")
        pin.append(rep.seconds)
        meta_check(llm, res, f"rollback push {i + 1} ({rep.path})")
    fg["rollback_pinned_ms"] = med(pin) * 1e3
    fg["rollback_pinned_samples_s"] = pin
    fg["rollback_pinned_report"] = summary(rep)
    meta_check(llm, res, "rollback pushes")
    res["greedy_full_gpu"] = greedy(llm, vllm)
    save()
    del hog
    gc.collect()
    torch.cuda.empty_cache()

    # room for a backup: the default keeps one on the device (rollback)
    rb = []
    for _ in range(args.rounds):
        rep = push(llm, weights)
        rb.append(rep.seconds)
    res["with_room"] = {"default_ms": med(rb) * 1e3, "samples_s": rb, "report": summary(rep),
                        "free_gib": torch.cuda.mem_get_info()[0] / 2**30}
    save()

    # the colocated cycle
    cyc = res["colocated"] = {}
    g = torch.Generator(device="cuda").manual_seed(1)
    for level in (1, 2):
        c = cyc[f"level{level}"] = {}
        try:
            c["sleep_s"] = timed(lambda: llm.sleep(level=level), sync=False)[0]
            c["free_gib_asleep"] = torch.cuda.mem_get_info()[0] / 2**30
            with torch.no_grad():  # the trainer's step: every matrix changes a little, in place
                for _, t in weights:
                    if t.dim() >= 2:
                        t.add_(torch.randn(t.shape, device="cuda", generator=g, dtype=t.dtype), alpha=0.01)
            c["wake_weights_s"] = timed(lambda: llm.wake_up(tags=["weights"]), sync=False)[0]
            rep = push(llm, weights)
            c["push"] = summary(rep)
            c["wake_kv_s"] = timed(lambda: llm.wake_up(tags=["kv_cache"]), sync=False)[0]
            after = greedy(llm, vllm)
            rep2 = push(llm, weights, mode="direct")  # the same weights again, awake: the reference
            c["reference_push"] = summary(rep2)
            ref = greedy(llm, vllm)
            c["serves_the_new_weights"] = after == ref
            c["outputs_changed_by_the_step"] = after != res["greedy_full_gpu"]
        except Exception as e:  # noqa: BLE001 - recorded
            c["error"] = f"{type(e).__name__}: {e}"
        print(f"[full-gpu] colocated level {level}: {json.dumps({k: v for k, v in c.items() if k not in ('push', 'reference_push')})}",
              flush=True)
        save()
    print(json.dumps({k: v for k, v in res["full_gpu"].items() if k not in ("reports", "samples_s")}, indent=1))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
