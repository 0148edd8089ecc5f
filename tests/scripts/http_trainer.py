"""A trainer process pushing weights into `vllm serve` over HTTP; optionally killed in the middle.

    python http_trainer.py SPEC.json      -> prints `RESULT {...}` (unless it was told to die)

SPEC: {"url": URL, "weights": DIR, "kw": {...push_weights kwargs...}, "die_after_buckets": N | null,
       "token": TOKEN | null, "fleet": bool}. With die_after_buckets the process SIGKILLs itself right before
broadcasting bucket N (dist transport): the engine sees its sender vanish mid-transfer. fleet:
push_weights([target]) (a fleet of this one server: each phase of the update is one call to its
/rlpatch/v1/refit/<phase> route).
"""

import json
import os
import signal
import sys


def main():
    spec = json.loads(open(sys.argv[1]).read())
    from safetensors.torch import load_file

    from vllm_rlpatch.refit import RefitError, push_weights, weight_version
    from vllm_rlpatch.refit import dist as T
    from vllm_rlpatch.refit.http import HttpTarget

    sd = load_file(os.path.join(spec["weights"], "model.safetensors"))
    target = HttpTarget(spec["url"], token=spec.get("token"))
    n = spec.get("die_after_buckets")
    if n is not None:
        orig = T.DistSender._run

        def _run(self):
            def on_bucket(seg):
                if seg >= n:
                    os.kill(os.getpid(), signal.SIGKILL)
            self.on_bucket = on_bucket
            orig(self)

        T.DistSender._run = _run
    try:
        rep = push_weights([target] if spec.get("fleet") else target, sorted(sd.items()), **spec.get("kw", {}))
        out = {"ok": True, "report": rep.as_dict(), "version": weight_version(target)}
    except RefitError as e:
        out = {"ok": False, "kind": e.kind, "state": e.state, "message": str(e)}
    print("RESULT " + json.dumps(out, default=str), flush=True)


if __name__ == "__main__":
    main()
