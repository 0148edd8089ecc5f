"""Two vllm.LLM engines, each hosted in a Ray actor (local Ray cluster on loopback), updated as a fleet through
their handles (vllm_rlpatch.refit.push_weights with a list of handles: every phase one `__ray_call__`, run by
the actor's coordinator); prints `RESULT {...}`.

    python fleet_ray.py SPEC.json      SPEC: {"weights": {"B": DIR, "C": DIR}, "engine": {...LLM kwargs...}}

Steps (each recorded under its name): a good update, a refusal in one actor's prepare (injected fault), a
failure after the first write in one actor with backups (both roll back, versions agree), and last one actor
killed (ray.kill) as the commits go out. Run with VLLM_RLPATCH_FAULT_INJECTION=1 and the test's worker extension
(snapshots) on PYTHONPATH (passed to the actors).
"""

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from fleet_engines import GREEDY  # noqa: E402
from fleet_record import FleetRecorder, run  # noqa: E402
from refit_engine import state_dict  # noqa: E402


def main():
    spec = json.loads(open(sys.argv[1]).read())
    import ray

    rec = FleetRecorder("fleet_ray")
    from vllm_rlpatch.refit.ray import RayTarget

    env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "PYTHONPATH", "TORCHDYNAMO_"))}
    t0 = rec.start()
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": env}, log_to_driver=True)
    res = {"ray_init_seconds": time.perf_counter() - t0, "steps": rec.steps}
    steps = res["steps"]

    @ray.remote(num_cpus=0)
    class Host:
        def __init__(self, engine, scripts):
            sys.path.insert(0, scripts)
            import vllm

            kw = dict(dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=32 << 20, enforce_eager=True,
                      gpu_memory_utilization=0.3)
            kw.update(engine)
            self.llm = vllm.LLM(**kw)

        def generate(self, op):
            import vllm
            from refit_engine import generate

            return generate(self.llm, vllm, op)

        def rpc(self, method, args=()):
            return self.llm.collective_rpc(method, args=tuple(args))[0]

    hosts = rec.targets = [Host.remote(spec["engine"], HERE) for _ in range(2)]
    res["pids"] = ray.get([h.rpc.remote("rlpatch_ping") for h in hosts])
    res["start_seconds"] = time.perf_counter() - t0
    print(f"[fleet_ray] actors up {res['start_seconds']:.1f}s", file=sys.stderr, flush=True)
    rec.weights = {k: state_dict(v, False) for k, v in spec["weights"].items()}
    push, versions = rec.push, rec.versions

    def on_each(name, method, *args, among=None):
        out = []
        for h in among or hosts:
            try:
                out.append(ray.get(getattr(h, method).remote(*args)))
            except Exception as e:  # noqa: BLE001 - recorded; the test decides
                out.append({"error": f"{type(e).__name__}: {e}"})
        steps[name] = out

    on_each("g0", "generate", GREEDY)
    push("push_B", "B")
    versions("v_B")
    on_each("g_B", "generate", GREEDY)
    on_each("fp_B", "rpc", "rlpatch_fingerprint")
    on_each("snap_B", "rpc", "framework_snapshot")
    # a refusal in actor 1's prepare: nobody writes
    steps["arm_prepare"] = ray.get(hosts[1].rpc.remote("rlpatch_refit_inject_fault", ("prepare",)))
    push("refused", "C")
    on_each("eq_refused", "rpc", "framework_equal_to_snapshot")
    on_each("g_refused", "generate", GREEDY)
    versions("v_refused")
    # a failure after actor 1's first write, with backups: both roll back, and their versions agree
    steps["arm_rb"] = ray.get(hosts[1].rpc.remote("rlpatch_refit_inject_fault", ("after_first_write",)))
    push("fault_rb", "C", guarantee="rollback")
    on_each("eq_fault_rb", "rpc", "framework_equal_to_snapshot")
    on_each("g_fault_rb", "generate", GREEDY)
    versions("v_fault_rb")
    # actor 1 killed after every engine prepared, as the commits go out: actor 0 commits, then rolls back
    victim = RayTarget(hosts[1]).key()
    orig = RayTarget.phase

    def phase(self, name, args, timeout_s=None):
        if name == "commit" and self.key() == victim:
            ray.kill(self.handle, no_restart=True)
            time.sleep(1.0)
        return orig(self, name, args, timeout_s)

    RayTarget.phase = phase
    push("killed", "C", timeout_s=30.0)
    RayTarget.phase = orig
    on_each("survivor_eq", "rpc", "framework_equal_to_snapshot", among=hosts[:1])
    on_each("survivor_gen", "generate", GREEDY, among=hosts[:1])
    versions("v_survivor", among=hosts[:1])
    versions("v_with_dead")
    sys.stdout.write("RESULT " + json.dumps(res, default=str) + "\n")  # one write: no other thread splits it
    sys.stdout.flush()


def _ray_shutdown():
    try:
        import ray

        ray.shutdown()
    except Exception:  # noqa: BLE001
        pass


if __name__ == "__main__":
    run(main, shutdown=_ray_shutdown)  # then a killed actor's engine processes, Ray's own
