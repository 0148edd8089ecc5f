"""What a vLLM engine's processes spend on the CPU around an RPC: vLLM's shared-memory broadcast readers spin
(``sched_yield``) for ``busy_loop_s`` (1 s) after their last read (vllm/distributed/device_communicators/
shm_broadcast.py), which on a host with fewer cores than engine processes takes the cores a trainer packs on.

    VLLM_ALLOW_INSECURE_SERIALIZATION=1 python benchmarks/rpc_spin.py [--out FILE.json]

One engine (the embedded llama-tiny, CPU or GPU as vLLM picks). Two measurements, each process's CPU seconds
from /proc/PID/stat:
* ``after_rpc``: the 2 s after a no-op ``collective_rpc``, in 0.25 s steps (the worker spins, then stops);
* ``after_push``: the same after ``push_weights`` of random weights (the update's last RPC rests the reader);
* ``waiting``: an RPC whose worker sleeps 0.8 s, right after another RPC, right after a ``push_weights``, and after
  2.5 s of quiet (the engine core spins while it waits for its worker's reply in the first case only: the update
  rests its reader too).
Writes JSON (default benchmarks/results/rpc_spin-vllm<ver>.json) and prints it. Timing is reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def cpu_steps(procs: dict[int, str], n: int = 8, dt: float = 0.25) -> list[dict]:
    """Each process's CPU seconds since now, every ``dt`` seconds, ``n`` times."""
    base = {p: cpu_of(p) for p in procs}
    t0, steps = time.time(), []
    for _ in range(n):
        time.sleep(dt)
        steps.append({"t": round(time.time() - t0, 2),
                      "cpu_s": {procs[p]: round(cpu_of(p) - base[p], 3) for p in procs}})
    return steps


def cpu_of(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def nap(self) -> int:  # runs in the worker (collective_rpc with a callable)
    import time as _t

    _t.sleep(0.8)
    return 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
        print("rpc_spin: set VLLM_ALLOW_INSECURE_SERIALIZATION=1 (the sleeping RPC is a callable)", file=sys.stderr)
        return 2
    import psutil
    import vllm

    from vllm_rlpatch.models import path

    llm = vllm.LLM(model=path("llama-tiny"), dtype="bfloat16", max_model_len=128, enforce_eager=True,
                   kv_cache_memory_bytes=64 << 20, gpu_memory_utilization=0.5)
    procs = {p.pid: p.name() for p in psutil.Process().children(recursive=True)}
    procs[os.getpid()] = "frontend"
    res: dict = {"vllm": vllm.__version__, "cpu_count": os.cpu_count(), "processes": procs}
    time.sleep(3)
    llm.collective_rpc("rlpatch_refit_describe")
    steps = cpu_steps(procs)
    res["after_rpc"] = steps
    print(f"[rpc-spin] after a no-op RPC: {steps[-1]}", flush=True)
    # the same after an update: its last RPC rests the readers (vllm_rlpatch.hooks.workerctx.rest_rpc_reader)
    import refit_throughput as RT

    from vllm_rlpatch.refit import push_weights

    weights = RT.trainer_state(llm.collective_rpc("rlpatch_refit_describe")[0]["schema"], "cpu")
    push_weights(llm, weights)  # the first update (plans, segments)
    time.sleep(2.5)
    push_weights(llm, weights)
    steps = cpu_steps(procs)
    res["after_push"] = steps
    print(f"[rpc-spin] after push_weights: {steps[-1]}", flush=True)
    res["waiting"] = {}
    for label, pre in (("right_after_an_rpc", "rpc"), ("right_after_a_push", "push"), ("after_2.5_s_quiet", None)):
        time.sleep(2.5)
        if pre == "rpc":
            llm.collective_rpc("rlpatch_refit_describe")
        elif pre == "push":
            push_weights(llm, weights)
        base = {p: cpu_of(p) for p in procs}
        t1 = time.time()
        llm.collective_rpc(nap)
        res["waiting"][label] = {"rpc_s": round(time.time() - t1, 3),
                                 "cpu_s": {procs[p]: round(cpu_of(p) - base[p], 3) for p in procs}}
        print(f"[rpc-spin] a 0.8 s RPC {label}: {res['waiting'][label]}", flush=True)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"rpc_spin-vllm{vllm.__version__.split('+')[0]}.json")
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"[rpc-spin] wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    try:  # os._exit skips the engine's shutdown: end its processes (they would outlive this one)
        import psutil

        for c in psutil.Process().children(recursive=True):
            c.kill()
    except Exception:  # noqa: BLE001
        pass
    os._exit(rc)
