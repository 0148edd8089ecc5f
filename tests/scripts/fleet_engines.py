"""Two real vllm.LLM engines in this one process, updated as a fleet (vllm_rlpatch.refit.push_weights with a
list); prints `RESULT {...}`.

    python fleet_engines.py SPEC.json      SPEC: {"weights": {"B": DIR, "C": DIR}, "engine": {...LLM kwargs...}}

Steps (each recorded under its name): a good update, a refusal in one engine's prepare, a failure after the
first write in one engine at `rollback` and at `validate-then-write`, a good update after that, the same
over `dist` (a good update, a refusal in one engine's prepare, a good update back), and last an engine
killed (SIGKILL of its engine-core process) before an update. The engines' CPU seconds right after a no-op
RPC and right after the first update (the update rests vLLM's spinning RPC readers). Run with VLLM_RLPATCH_FAULT_INJECTION=1 and the
test's worker extension (snapshots) on PYTHONPATH.
"""

import json
import os
import signal
import sys
import time

from fleet_record import FleetRecorder, run
from refit_engine import generate, state_dict

PROMPTS = ["the quick cat sees", "12 + 7 =", "count: 3 4 5", "the small model updates the"]
GREEDY = {"prompts": PROMPTS, "sampling": {"temperature": 0.0, "max_tokens": 12, "logprobs": 0}}


def main():
    spec = json.loads(open(sys.argv[1]).read())
    import vllm

    rec = FleetRecorder("fleet")
    kwargs = dict(dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=32 << 20, enforce_eager=True,
                  gpu_memory_utilization=0.3)
    kwargs.update(spec.get("engine", {}))
    t0 = rec.start()
    llms = rec.targets = [vllm.LLM(**kwargs), vllm.LLM(**kwargs)]
    print(f"[fleet] engines up {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    res = {"vllm": vllm.__version__, "start_seconds": time.perf_counter() - t0, "steps": rec.steps}
    steps = res["steps"]
    rec.weights = {k: state_dict(v, False) for k, v in spec["weights"].items()}
    push, versions = rec.push, rec.versions

    def on_each(name, fn):
        out = []
        for llm in llms:
            try:
                out.append(fn(llm))
            except Exception as e:  # noqa: BLE001 - recorded; the test decides
                out.append({"error": f"{type(e).__name__}: {e}"})
        steps[name] = out

    def gen(name):
        on_each(name, lambda llm: generate(llm, vllm, GREEDY))

    def snap(name):
        on_each(name, lambda llm: llm.collective_rpc("framework_snapshot")[0])

    def eq(name):
        on_each(name, lambda llm: llm.collective_rpc("framework_equal_to_snapshot")[0])

    def fp(name):
        on_each(name, lambda llm: llm.collective_rpc("rlpatch_fingerprint")[0]["fingerprint"])

    def arm(i, where):
        return llms[i].collective_rpc("rlpatch_refit_inject_fault", args=(where,))[0]

    def engine_cpu_after(fn, wait=0.6):
        """CPU seconds of this process's engine processes (engine cores, workers) in the ``wait`` seconds after
        ``fn`` returned: vLLM's shm-broadcast readers spin for 1 s after an RPC unless the update rested them."""
        import psutil

        kids = psutil.Process().children(recursive=True)

        def cpu():
            tot = 0.0
            for k in kids:
                try:
                    t = k.cpu_times()
                    tot += t.user + t.system
                except psutil.Error:
                    pass
            return tot

        fn()
        c0 = cpu()
        time.sleep(wait)
        return {"cpu_s": cpu() - c0, "wait_s": wait, "processes": len(kids)}

    gen("g0")
    # after a no-op RPC the engines' workers spin (vLLM's reader); after an update they wait idle
    steps["cpu_after_ping"] = engine_cpu_after(lambda: [llm.collective_rpc("rlpatch_ping") for llm in llms])
    steps["cpu_after_push"] = engine_cpu_after(lambda: push("push_B", "B"))
    versions("v_B")
    gen("g_B")
    fp("fp_B")
    snap("snap_B")
    # a refusal in engine1's prepare: nobody writes
    steps["arm_prepare"] = arm(1, "prepare")
    push("refused", "C")
    eq("eq_refused")
    gen("g_refused")
    versions("v_refused")
    # a failure after engine1's first write, with backups: both roll back
    steps["arm_rb"] = arm(1, "after_first_write")
    push("fault_rb", "C", guarantee="rollback")
    eq("eq_fault_rb")
    gen("g_fault_rb")
    versions("v_fault_rb")
    # the same without backups (validate-then-write): the fleet is mixed, every engine refuses requests
    steps["arm_vtw"] = arm(1, "after_first_write")
    push("fault_vtw", "C", guarantee="validate-then-write")
    gen("g_mixed")
    versions("v_mixed")
    # a good update repairs the fleet
    push("push_C", "C")
    versions("v_C")
    gen("g_C")
    fp("fp_C")
    snap("snap_C")
    # dist: one gloo broadcast group spanning the trainer and both engines' workers
    push("dist_B", "B", transport="dist", timeout_s=60.0)
    versions("v_dist_B")
    gen("g_dist_B")
    fp("fp_dist_B")
    snap("snap_dist_B")
    # a refusal in engine1's prepare with dist: engine1's worker drains the broadcast, nobody writes
    steps["arm_dist_prepare"] = arm(1, "prepare")
    push("dist_refused", "C", transport="dist", timeout_s=60.0)
    eq("eq_dist_refused")
    gen("g_dist_refused")
    versions("v_dist_refused")
    push("dist_C", "C", transport="dist", timeout_s=60.0)  # back on C for the last step
    versions("v_dist_C")
    fp("fp_dist_C")
    snap("snap_dist_C")
    # an engine killed mid-update: engine1's worker process gets SIGKILL after every engine prepared, as its
    # commit is sent (engine0 commits, then is rolled back)
    pid = llms[1].collective_rpc("rlpatch_ping")[0]["pid"]
    steps["killed_pid"] = pid
    if pid != os.getpid():
        from vllm_rlpatch.refit.target import LocalTarget

        orig = LocalTarget.rpc
        victim = llms[1].llm_engine

        def rpc(self, method, args, kwargs):
            if method == "rlpatch_refit_commit" and self.front is victim:
                os.kill(pid, signal.SIGKILL)
                time.sleep(0.5)
            return orig(self, method, args, kwargs)
        LocalTarget.rpc = rpc
        push("killed", "B", timeout_s=30.0)
        LocalTarget.rpc = orig
        steps["survivor_eq"] = llms[0].collective_rpc("framework_equal_to_snapshot")[0]
        steps["survivor_gen"] = generate(llms[0], vllm, GREEDY)
    print("RESULT " + json.dumps(res, default=str), flush=True)


if __name__ == "__main__":
    run(main)
