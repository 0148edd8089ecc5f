"""SkyRL and NeMo-RL weight syncs replayed against real vLLM on CPU, plugin off and on, and through push_weights.

    python benchmarks/integrations/replays.py --out DIR [--models qwen2-tiny,llama-tiny]

Writes ``DIR/skyrl-vllm<version>-cpu.json`` and ``DIR/nemo-rl-vllm<version>-cpu.json``. Every row is a *replay*:
neither framework runs here (skyrl-train 0.3.1 requires Python 3.12; NeMo-RL is not on the package registry), so
their call sequences are rewritten from their sources, call for call, with the file and line of each replayed
call; the engine-side halves are in ``replay_workers.py`` (a ``worker_extension_cls``, as both frameworks use).
What differs from the frameworks, because this runs on a CPU: CUDA IPC handles become the names of
shared-memory files (the buffers are allocated, reused and freed where the frameworks do it), NCCL becomes gloo,
``device="cuda"`` becomes the CPU, and Ray actors become direct calls on the ``vllm.LLM``.

Trainer side (this process, before each sync): the "trainer" holds a Hugging Face copy of the model; two weight
sets W1 and W2 are the start weights moved by seeded noise, rounded to bfloat16 (the engine's dtype), and saved.
Syncs alternate between W1 and W2 so each one changes every weight.

Per model, three kinds of process (the plugin is per process): ``run`` with the plugin on, ``run`` with
``VLLM_RLPATCH_ENABLED=0``, and ``fresh`` (a new engine loading W1 and W2 from disk, plugin on and off: the
reference for the run of the same setting). In a ``run``,
one engine (prefix caching on, as both frameworks default) takes in order:
  1. SkyRL broadcast (W0 -> W1), 2. SkyRL named tensors / CUDA IPC (W1 -> W2), 3. NeMo-RL IPC-ZMQ (W2 -> W1),
  4. NeMo-RL collective (W1 -> W2), 5. ``push_weights`` (W2 -> W1, plugin on only);
before each, two 300-token probe prompts are run on the old weights (their KV in the prefix cache); after each,
the probes' greedy tokens and logprobs are compared with a fresh load, and the cached-token counts recorded. Then
each path is timed (``--repeat`` syncs, median), and a sampled rollout after the framework's sync gives
``token_mult_prob_error`` (NeMo-RL's metric: mean over completion tokens of exp(|rollout logprob - trainer
logprob|), the trainer computing in float32 on the same bfloat16 weights). SkyRL has no such metric; the same
formula is applied to it.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

HERE = Path(__file__).resolve().parent
PROBE_LEN = 300
MAX_LEN = 512
COMPLETE = "complete"
_PORT = [29650 + os.getpid() % 200]


def port() -> int:
    _PORT[0] += 1
    return _PORT[0]


def engine(model: str, sleep: bool):
    from vllm import LLM

    return LLM(model=model, dtype="bfloat16", max_model_len=MAX_LEN, enforce_eager=True, seed=0,
               enable_prefix_caching=True, enable_sleep_mode=sleep, gpu_memory_utilization=0.1,
               worker_extension_cls="replay_workers.ReplayWorkerExtension")


def probes(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(PROBE_LEN)] for _ in range(2)]


def greedy(llm, prompts) -> dict:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                         for o in outs],
            "cached": [int(o.num_cached_tokens or 0) for o in outs]}


# ------------------------------------------------------------------------------------------ the trainer's weights
def make_weights(model: str, work: Path) -> dict[str, str]:
    """W1, W2: the start weights plus seeded noise, rounded to bfloat16, saved as checkpoints."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {}
    for k in (1, 2):
        m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        g = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.float().std().clamp_min(1e-3))
        d = work / f"w{k}"
        m.to(torch.bfloat16).save_pretrained(str(d))
        AutoTokenizer.from_pretrained(model).save_pretrained(str(d))
        out[f"w{k}"] = str(d)
    return out


def named_tensors(wdir: str) -> list:
    """The trainer's state dict in the engine dtype (SkyRL: ``.to(generator_dtype)``, fsdp_worker.py:67), with the
    tied alias ``lm_head.weight`` as a state dict holds it."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(wdir, dtype=torch.bfloat16)
    return [(n, t.detach().contiguous()) for n, t in m.state_dict().items()]


# ------------------------------------------------------------------------------------------ the replayed senders
class Rpc:
    """``llm.collective_rpc`` in a thread, as SkyRL's ``asyncio.create_task`` / NeMo-RL's Ray futures run it
    while the trainer sends."""

    def __init__(self, llm, method: str, args: tuple):
        self.result, self.error = None, None
        self.t = threading.Thread(target=self._run, args=(llm, method, args))
        self.t.start()

    def _run(self, llm, method, args):
        try:
            self.result = llm.collective_rpc(method, args=args)
        except Exception as e:  # noqa: BLE001 - re-raised in join()
            self.error = e

    def join(self):
        self.t.join()
        if self.error is not None:
            raise self.error
        return self.result


def skyrl_broadcast_init(llm, state: dict) -> None:
    """BroadcastTransferStrategy.create_init_info/create_sender (broadcast_strategy.py 205-268) with the engines'
    init_weight_update_communicator (vllm_engine.py:301-311) run concurrently (worker.py:258-290)."""
    from replay_workers import gloo_group

    p = port()
    info = {"strategy": "broadcast", "host": "127.0.0.1", "port": p, "rank_offset": 1, "world_size": 2,
            "dtype": "bfloat16"}
    rpc = Rpc(llm, "init_weight_update_communicator", (pickle.dumps(info),))
    state["sky_group"] = gloo_group("127.0.0.1", p, 0, 2)
    rpc.join()


def skyrl_broadcast_sync(llm, tensors: list, state: dict) -> None:
    """FSDP worker broadcast_to_inference_engines (fsdp_worker.py:204-230): cache reset created, then
    BroadcastWeightTransferSender.send_chunks (broadcast_strategy.py:96-141): per parameter one
    update_named_weights request (vllm_engine.py:320-331 -> VLLMWeightLoader.load_weights 630-656 ->
    collective_rpc "load_weights") while rank 0 broadcasts the tensor; then the reset is awaited."""
    group = state["sky_group"]
    for name, t in tensors:
        req = {"strategy": "broadcast", "names": [name], "dtypes": ["bfloat16"], "shapes": [list(t.shape)]}
        rpc = Rpc(llm, "load_weights", (pickle.dumps(req),))
        group.broadcast(t, 0).wait()
        rpc.join()
    llm.llm_engine.reset_prefix_cache()


def skyrl_ipc_sync(llm, tensors: list, state: dict) -> None:
    """The CUDA IPC strategy (cuda_ipc_strategy.py:111-181): per chunk (one parameter per chunk:
    fsdp_worker.py:64-73) a new packed buffer, its handle in an update_named_weights request; the buffer is freed
    after the request returns. Then the cache reset (fsdp_worker.py:228-229)."""
    import torch

    if not state.get("sky_ipc_init"):
        info = {"strategy": "ipc", "dtype": "bfloat16"}
        llm.collective_rpc("init_weight_update_communicator", args=(pickle.dumps(info),))
        state["sky_ipc_init"] = True
    for i, (name, t) in enumerate(tensors):
        path = f"/dev/shm/rlpatch-skyrl-{os.getpid()}-{i}"
        buf = torch.from_file(path, shared=True, size=t.numel(), dtype=t.dtype)
        buf.copy_(t.reshape(-1))
        req = {"strategy": "ipc", "names": [name], "shapes": [list(t.shape)], "sizes": [t.numel()], "path": path,
               "nbytes": t.numel() * t.element_size()}
        try:
            llm.collective_rpc("load_weights", args=(pickle.dumps(req),))
        finally:
            os.unlink(path)
    llm.llm_engine.reset_prefix_cache()


def nemo_ipc_sync(llm, tensors: list, state: dict) -> bool:
    """refit_policy_generation, colocated (grpo.py:2341-2391, NeMo-RL 7ea279abf): the trainer's
    stream_weights_via_ipc_zmq_impl (nemo_rl/models/policy/utils.py:361-523: two ping-pong buffers of half the
    refit buffer each, 512-byte aligned packing, wait for the previous ACK before each send, then COMPLETE) with the
    engines' update_weights_via_ipc_zmq (vllm_worker.py:1160-1190) concurrently; False from any worker fails."""
    import torch

    from replay_workers import aligned

    half = state["nemo_buffer_bytes"] // 2
    paths = [f"/dev/shm/rlpatch-nemo-{os.getpid()}-{k}" for k in (0, 1)]
    bufs = [torch.from_file(p, shared=True, size=aligned(half), dtype=torch.uint8) for p in paths]
    address = f"ipc:///tmp/rlpatch-nemo-{os.getpid()}.sock"
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 120000)  # NeMo-RL: 120 s on both sides
    sock.bind(address)
    rpc = Rpc(llm, "update_weights_via_ipc_zmq", (address,))
    try:
        cur, used, names, await_recv = 0, 0, [], False
        for name, t in tensors:
            size = t.numel() * t.element_size()
            if used + aligned(size) > half and names:
                if await_recv:
                    sock.recv()
                sock.send_pyobj(((paths[cur], aligned(half)), names, used))
                await_recv, cur, used, names = True, 1 - cur, 0, []
            bufs[cur][used:used + size].copy_(t.reshape(-1).view(torch.uint8))
            names.append(name)
            used += aligned(size)
        if names:
            if await_recv:
                sock.recv()
            sock.send_pyobj(((paths[cur], aligned(half)), names, used))
            await_recv = True
        if await_recv:
            sock.recv()
        sock.send_pyobj(COMPLETE)
        sock.recv()
        results = rpc.join()
    finally:
        sock.close()
        for p in paths:
            os.unlink(p)
    return bool(results) and all(results)


def nemo_collective_init(llm, state: dict) -> None:
    """init_collective (vllm_worker.py:830-845 -> vllm_backend.py:228-251): vLLM ranks after the trainer's."""
    from replay_workers import gloo_group

    p = port()
    rpc = Rpc(llm, "init_collective", ("127.0.0.1", p, 1, 2))
    state["nemo_group"] = gloo_group("127.0.0.1", p, 0, 2)
    rpc.join()


def nemo_collective_sync(llm, tensors: list, state: dict) -> bool:
    """refit_policy_generation, not colocated (grpo.py:2392-2403): broadcast_weights_for_collective, i.e.
    packed_broadcast_producer (packed_tensor.py:39-127: uint8 packs filled past the target size, broadcast from
    rank 0), with update_weights_from_collective (vllm_worker.py:1192-1222) concurrently."""
    import torch

    target = state["nemo_pack_bytes"]
    rpc = Rpc(llm, "update_weights_from_collective", (target,))
    group = state["nemo_group"]
    i = 0
    while i < len(tensors):
        chunk, total = [], 0
        while i < len(tensors):
            chunk.append(tensors[i][1].reshape(-1).view(torch.uint8))
            total += chunk[-1].numel()
            i += 1
            if total > target:
                break
        group.broadcast(torch.cat(chunk), 0).wait()
    results = rpc.join()
    return bool(results) and all(results)


# ------------------------------------------------------------------------------------------ the colocated cycle
def skyrl_cycle(llm, sync, tensors, state) -> None:
    """trainer.py:228 sleep (vllm_engine.py:286-299: level 2, or 1 with LoRA) ... trainer.py:301
    wake_up(tags=["weights"]) -> sync (302-303) -> trainer.py:307 wake_up(tags=["kv_cache"])."""
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    sync(llm, tensors, state)
    llm.wake_up(tags=["kv_cache"])


def nemo_cycle(llm, sync, tensors, state):
    """finish_generation -> VllmGenerationWorker.sleep (vllm_worker.py:1286-1312: reset_prefix_cache, sleep(level=1))
    ... refit_policy_generation: prepare_for_generation(tags=["weights"]) (grpo.py:2343) -> sync ->
    prepare_for_generation(tags=["kv_cache"]) (grpo.py:2416)."""
    llm.llm_engine.reset_prefix_cache()
    llm.sleep(level=1)
    llm.wake_up(tags=["weights"])
    ok = sync(llm, tensors, state)
    llm.wake_up(tags=["kv_cache"])
    return ok


# ------------------------------------------------------------------------------------------ measurements
def rollout_mismatch(llm, wdir: str) -> dict:
    """A sampled rollout (temperature 1) and the trainer's logprobs of its tokens: token_mult_prob_error as
    NeMo-RL computes it (mean exp(|generation_logprobs - prev_logprobs|) over the completion tokens)."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    rng = random.Random(11)
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(4)]
    sp = SamplingParams(temperature=1.0, max_tokens=16, logprobs=0, n=2, seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    trainer = AutoModelForCausalLM.from_pretrained(wdir, dtype=torch.bfloat16).float().eval()
    diffs = []
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            ids = torch.tensor([p + list(c.token_ids)])
            with torch.no_grad():
                lp = torch.log_softmax(trainer(ids).logits[0, len(p) - 1:-1].float(), -1)
            mine = lp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            gen = torch.tensor([d[t].logprob for t, d in zip(c.token_ids, c.logprobs)])
            diffs.append((mine - gen).abs())
    d = torch.cat(diffs)
    return {"tokens": int(d.numel()), "token_mult_prob_error": float(torch.exp(d).mean()),
            "max_mult_prob_error": float(torch.exp(d).max())}


def failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]


def one_step(llm, label: str, fn, target: str, prompts, res: dict) -> None:
    """Warm the probes on the old weights, run one replayed sync, record its outcome and the probes after it."""
    greedy(llm, prompts)
    t0 = time.perf_counter()
    try:
        ok = fn()
        err = None
    except Exception as e:  # noqa: BLE001 - the framework's own failure is the measurement
        ok, err = None, failure(e)
    if ok is False:  # NeMo-RL's workers log the exception and return False
        detail = [x for x in llm.collective_rpc("last_error") if x]
        err = "the update returned False" + (f" (worker: {detail[0]})" if detail else "")
        llm.collective_rpc("clear_error")
    res[label] = {"target": target, "ok": err is None, "error": err, "seconds": time.perf_counter() - t0,
                  "probe": greedy(llm, prompts), "probe_again": greedy(llm, prompts)}


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def start_engine(model: str) -> tuple:
    """Both frameworks pass enable_sleep_mode=True (vllm_worker.py:593; SkyRL's inference_engine_enable_sleep,
    ray_wrapped_inference_engine.py:219); where the CPU platform refuses it, the error is recorded."""
    try:
        return engine(model, True), None
    except Exception as e:  # noqa: BLE001 - recorded
        return engine(model, False), failure(e)


def phase_run(model: str, weights: dict, repeat: int, plugin: bool) -> dict:
    llm, sleep_error = start_engine(model)
    prompts = probes(llm.llm_engine.model_config.hf_config.vocab_size)
    t = {k: named_tensors(v) for k, v in weights.items()}
    total = sum(x.numel() * x.element_size() for _, x in t["w1"])
    largest = max(x.numel() * x.element_size() for _, x in t["w1"])
    state = {"nemo_buffer_bytes": 2 * max(largest + 512, total // 4), "nemo_pack_bytes": max(1, total // 3)}
    llm.collective_rpc("prepare_refit_info", args=({n: (list(x.shape), "bfloat16") for n, x in t["w1"]},))
    res: dict = {"plugin": "on" if plugin else "off", "sleep_mode_error": sleep_error, "bytes": total,
                 "tensors": len(t["w1"]), "nemo_ipc_buffer_bytes": state["nemo_buffer_bytes"],
                 "nemo_pack_bytes": state["nemo_pack_bytes"], "steps": {}, "seconds": {}, "mismatch": {}}
    cyc = sleep_error is None
    steps = [
        ("skyrl_broadcast", "w1", lambda w: (skyrl_broadcast_init(llm, state), skyrl_broadcast_sync(llm, t[w], state))),
        ("skyrl_ipc", "w2", lambda w: skyrl_cycle(llm, skyrl_ipc_sync, t[w], state) if cyc
         else skyrl_ipc_sync(llm, t[w], state)),
        ("nemo_ipc", "w1", lambda w: nemo_cycle(llm, nemo_ipc_sync, t[w], state) if cyc
         else nemo_ipc_sync(llm, t[w], state)),
        ("nemo_collective", "w2", lambda w: (nemo_collective_init(llm, state), nemo_collective_sync(llm, t[w], state))[1]),
    ]
    if plugin:
        from vllm_rlpatch.refit import push_weights, weight_version

        steps.append(("push_weights", "w1", lambda w: push_weights(llm, t[w]) and None))
        res["weight_version_start"] = weight_version(llm)
    for label, w, fn in steps:
        one_step(llm, label, lambda: fn(w), w, prompts, res["steps"])
        if plugin:
            res["steps"][label]["weight_version"] = weight_version(llm)
        if label in ("skyrl_broadcast", "nemo_ipc", "push_weights"):
            res["mismatch"][label] = rollout_mismatch(llm, weights[w])
    res["timing"] = timing(llm, t, state, repeat, plugin)
    return res


def timing(llm, t: dict, state: dict, repeat: int, plugin: bool) -> dict:
    """Each path, ``repeat`` syncs of W1 after one untimed (the first ones above are not timed: they include
    group set-up). A path that failed above is not timed."""
    ways = {"skyrl_broadcast": lambda: skyrl_broadcast_sync(llm, t["w1"], state),
            "skyrl_ipc": lambda: skyrl_ipc_sync(llm, t["w1"], state),
            "nemo_ipc": lambda: nemo_ipc_sync(llm, t["w1"], state),
            "nemo_collective": lambda: nemo_collective_sync(llm, t["w1"], state)}
    if plugin:
        from vllm_rlpatch.refit import push_weights

        ways["push_weights"] = lambda: push_weights(llm, t["w1"])
    out = {}
    for name, fn in ways.items():
        try:
            if fn() is False:
                out[name] = None
                continue
            out[name] = timed(fn, repeat)
        except Exception as e:  # noqa: BLE001
            out[name] = failure(e)
    return out


def phase_fresh(dirs: list[str]) -> dict:
    import gc

    from vllm import LLM

    out = {}
    for d in dirs:
        llm = LLM(model=d, dtype="bfloat16", max_model_len=MAX_LEN, enforce_eager=True, seed=0,
                  gpu_memory_utilization=0.1)
        out[d] = greedy(llm, probes(llm.llm_engine.model_config.hf_config.vocab_size))
        del llm
        gc.collect()
    return out


# ------------------------------------------------------------------------------------------ the driver
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


def one_model(model: str, repeat: int, work: Path, log: Path) -> dict:
    from vllm_rlpatch.models import path

    mdir = path(model)
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_")}
    base["PYTHONPATH"] = os.pathsep.join([str(HERE), base.get("PYTHONPATH", "")])
    base.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    off_env = {**base, "VLLM_RLPATCH_ENABLED": "0"}
    weights = sub(["--phase", "weights", "--model", mdir, "--work", str(work / model)], off_env, log)
    wj = json.dumps(weights)
    on = sub(["--phase", "run", "--model", mdir, "--weights", wj, "--repeat", str(repeat)], base, log)
    off = sub(["--phase", "run", "--model", mdir, "--weights", wj, "--repeat", str(repeat)], off_env, log)
    fresh_on = sub(["--phase", "fresh", "--dirs", *weights.values()], base, log)
    fresh_off = sub(["--phase", "fresh", "--dirs", *weights.values()], off_env, log)
    compare(on, off, weights, fresh_on, fresh_off)
    return {"model": model, "weights": weights, "on": on, "off": off, "fresh_on": fresh_on, "fresh_off": fresh_off}


def compare(on: dict, off: dict, weights: dict, fresh_on: dict, fresh_off: dict) -> None:
    """Each sync against a fresh load of its target weights in a process like its own (the plugin on or off:
    the plugin's defaults change the engine's numerics, so a fresh load is compared like for like)."""
    for run, fresh in ((on, fresh_on), (off, fresh_off)):
        for step in run["steps"].values():
            step["vs_fresh"] = equal(step["probe"], fresh[weights[step["target"]]])


def med(x):
    return statistics.median(x) if isinstance(x, list) else None


PATHS = {"skyrl": ("skyrl_broadcast", "skyrl_ipc"), "nemo-rl": ("nemo_ipc", "nemo_collective")}
RELEASE = {"skyrl": "skyrl-train 0.3.1 (its vllm extra pins vllm==0.11.0; the repository pins 0.26.0)",
           "nemo-rl": "NeMo-RL main 7ea279abf (2026-08-22, pins vllm 0.25.1; newest release v0.7.0 pins 0.20.0)"}


def row(fw: str, per_model: list[dict], ver: str) -> dict:
    paths = PATHS[fw]

    def ok(run, p):
        return all(m[run]["steps"][p]["ok"] and m[run]["steps"][p]["vs_fresh"]["equal"] for m in per_model)

    mm = "skyrl_broadcast" if fw == "skyrl" else "nemo_ipc"
    return {
        "framework": "SkyRL" if fw == "skyrl" else "NeMo-RL", "release": RELEASE[fw], "vllm": ver, "code": "replay",
        "paths": list(paths),
        "sync_correct_off": {p: ok("off", p) for p in paths}, "sync_correct_on": {p: ok("on", p) for p in paths},
        "sync_correct_push_weights": ok("on", "push_weights"),
        "sync_off_failure": {p: [m["off"]["steps"][p]["error"] for m in per_model] for p in paths},
        "sync_on_failure": {p: [m["on"]["steps"][p]["error"] for m in per_model] for p in paths},
        "sync_seconds_off": {m["model"]: {p: med(m["off"]["timing"][p]) for p in paths} for m in per_model},
        "sync_seconds_on": {m["model"]: {p: med(m["on"]["timing"][p]) for p in paths} for m in per_model},
        "sync_seconds_push_weights": {m["model"]: med(m["on"]["timing"]["push_weights"]) for m in per_model},
        "mismatch_off": {m["model"]: m["off"]["mismatch"][mm]["token_mult_prob_error"] for m in per_model},
        "mismatch_on": {m["model"]: m["on"]["mismatch"][mm]["token_mult_prob_error"] for m in per_model},
        "mismatch_push_weights": {m["model"]: m["on"]["mismatch"]["push_weights"]["token_mult_prob_error"]
                                  for m in per_model},
        "cached_tokens_after_sync_on": {m["model"]: {p: m["on"]["steps"][p]["probe"]["cached"] for p in paths}
                                        for m in per_model},
        "cached_tokens_after_sync_off": {m["model"]: {p: m["off"]["steps"][p]["probe"]["cached"] for p in paths}
                                         for m in per_model},
        "sleep_mode_error": per_model[0]["on"]["sleep_mode_error"],
        "adapter": None,
    }


def driver(out: Path, models: list[str], repeat: int) -> list[Path]:
    import vllm

    ver = vllm.__version__.split("+")[0]
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rlpatch-replays-"))
    log = work / "replays.log"
    log.write_text("")
    t0 = time.time()
    per_model = [one_model(m, repeat, work, log) for m in models]
    amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    host = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "amx": amx,
            "note": "CPU timings; the host may have been shared with other work"}
    dests = []
    for fw in ("skyrl", "nemo-rl"):
        doc = {"benchmark": f"integrations/{fw}", "label": "replay", "row": row(fw, per_model, ver),
               "models": per_model, "host": host, "seconds": time.time() - t0, "repeat": repeat}
        dest = out / f"{fw}-vllm{ver}-cpu.json"
        dest.write_text(json.dumps(doc, indent=1) + "\n")
        dests.append(dest)
    return dests


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="directory for the JSON files")
    ap.add_argument("--models", default="qwen2-tiny,llama-tiny")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--phase", choices=("weights", "run", "fresh"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--weights", help=argparse.SUPPRESS)
    ap.add_argument("--dirs", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.phase is None:
        if not a.out:
            print("replays.py: --out DIR is required", file=sys.stderr)
            return 2
        if a.repeat < 1:
            print("replays.py: --repeat must be >= 1", file=sys.stderr)
            return 2
        for d in driver(Path(a.out), [m for m in a.models.split(",") if m], a.repeat):
            print(d)
        return 0
    if a.phase == "weights":
        res = make_weights(a.model, Path(a.work))
    elif a.phase == "fresh":
        res = phase_fresh(a.dirs)
    else:
        res = phase_run(a.model, json.loads(a.weights), a.repeat, os.environ.get("VLLM_RLPATCH_ENABLED") != "0")
    Path(a.json).write_text(json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
