"""What the fleet scripts (fleet_engines.py: engines in this process; fleet_ray.py: engines in Ray actors) share:
recording a fleet update's report or error and the fleet's weight versions under a step name, and how the
script ends. Imported from the scripts' folder (on sys.path: the scripts run as `python tests/scripts/X.py`)."""

import os
import sys
import time


class FleetRecorder:
    """Records steps into ``self.steps`` (the script's ``RESULT``). Set ``targets`` (the fleet: LLMs or actor
    handles) and ``weights`` (name -> state dict) before :meth:`push` and :meth:`versions`. Creating one imports
    vllm_rlpatch.refit (where the scripts imported it before); ``tag`` prefixes the progress lines on stderr."""

    def __init__(self, tag: str):
        from vllm_rlpatch.refit import RefitError, push_weights, weight_version

        self._refit = (RefitError, push_weights, weight_version)
        self.tag = tag
        self.steps: dict = {}
        self.targets: list = []
        self.weights: dict = {}
        self.t0 = time.perf_counter()

    def start(self) -> float:
        """Start the clock of the progress lines; returns it."""
        self.t0 = time.perf_counter()
        return self.t0

    def versions(self, name, among=None):
        RefitError, _, weight_version = self._refit
        try:
            self.steps[name] = {"versions": weight_version(among or self.targets)}
        except RefitError as e:
            self.steps[name] = {"error": str(e), "versions": getattr(e, "versions", None)}
        except Exception as e:  # noqa: BLE001 - a mixed engine refuses to say (its weights are no version)
            self.steps[name] = {"error": f"{type(e).__name__}: {e}"}

    def push(self, name, weights, **kw):
        RefitError, push_weights, _ = self._refit
        steps = self.steps
        t1 = time.perf_counter()
        try:
            rep = push_weights(self.targets, list(self.weights[weights].items()), **kw)
            steps[name] = {"ok": True, "report": rep.as_dict()}
        except RefitError as e:
            steps[name] = {"ok": False, "kind": e.kind, "state": e.state, "message": str(e),
                           "report": e.report.as_dict() if e.report is not None else None}
        except Exception as e:  # noqa: BLE001 - a non-RefitError is itself a finding
            steps[name] = {"ok": False, "kind": "unexpected", "state": "?", "message": f"{type(e).__name__}: {e}"}
        steps[name]["seconds"] = time.perf_counter() - t1
        print(f"[{self.tag}] {name}: {steps[name].get('ok')} {time.perf_counter() - self.t0:.1f}s", file=sys.stderr,
              flush=True)


def run(main, shutdown=None):
    """Run ``main`` and end the process (os._exit: 1 if it raised): ``shutdown`` first, then this process's own
    child processes (an engine killed by a step leaves the others waiting for it at shutdown, and they hold
    the test's output pipes open), then the shared-memory pools (os._exit skips the atexit that unlinks them)."""
    rc = 0
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        rc = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if shutdown is not None:
            shutdown()
        import psutil

        for c in psutil.Process().children(recursive=True):
            try:
                c.kill()
            except psutil.Error:
                pass
        from vllm_rlpatch.refit.caches import CACHE

        CACHE.close_pools()
        os._exit(rc)
