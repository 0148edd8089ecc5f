"""Port-race failure rates, unpatched vs patched, over the same trial count, on the installed vLLM.

    python benchmarks/port_races.py --out benchmarks/results/port_races-vllm0.25.1-cpu.json [--quick]

Runs the workloads of tests/test_port_races.py (real vLLM code, processes started at one instant by a
barrier, the probe->bind window widened to DELAY s as on a loaded node):
  mq_single_host   P processes x N MessageQueues with a remote reader each, VLLM_PORT set
  mq_two_hosts     W writer processes on namespace A, their readers on namespace B (veth), VLLM_PORT set
  tcpstore_*       32 concurrent non-DP engine inits (8 processes x 4 threads): RayExecutorV2's real port
                   selection, HOLD s, a real torch.distributed.TCPStore bind; with and without VLLM_PORT
  tcpstore_and_mq  the same with the engine's MessageQueue created between selection and bind
"unpatched" turns only the patch under test off (VLLM_RLPATCH_<NAME>=0). Writes one JSON document;
timing is reported, never judged.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="fewer trials (a smoke run)")
    ap.add_argument("--delay", type=float, default=0.3, help="probe->bind window injected (s)")
    ap.add_argument("--hold", type=float, default=1.0, help="TCPStore selection->bind window (s)")
    args = ap.parse_args(argv)
    import vllm

    from support import portrace

    per_proc = 2 if args.quick else 8
    doc = {"benchmark": "port_races", "vllm": vllm.__version__, "device": "cpu", "host": platform.node(),
           "cpus": os.cpu_count(), "as_root": os.geteuid() == 0, "delay_s": args.delay, "hold_s": args.hold,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "trials": {}}

    def record(name, **runs):
        doc["trials"][name] = runs
        print(f"[port_races] {name}: " + ", ".join(
            f"{k} {v.get('failed', v.get('store_bind_failures'))}/{v.get('attempts', v.get('inits'))} failed"
            for k, v in runs.items()), flush=True)

    steps = ["mq_single_host", "mq_two_hosts", "tcpstore_vllm_port", "tcpstore_no_vllm_port", "tcpstore_and_mq"]
    for i, step in enumerate(steps, 1):
        print(f"[port_races] ({i}/{len(steps)}) {step} ...", flush=True)
        if step == "mq_single_host":
            runs = {m: portrace.mq_trial(procs=16, count=per_proc, delay=args.delay, patched=m == "patched")
                    for m in ("unpatched", "patched")}
        elif step == "mq_two_hosts":
            why = portrace.TwoHosts.unavailable()
            if why:
                doc["trials"][step] = {"skipped": why}
                continue
            with portrace.TwoHosts() as h:
                runs = {m: portrace.two_host_trial(h, writers=4, count=2 * per_proc, delay=args.delay,
                                                   patched=m == "patched") for m in ("unpatched", "patched")}
        elif step.startswith("tcpstore") and step != "tcpstore_and_mq":
            runs = {}
            for m in ("unpatched", "patched"):
                port = portrace.free_band(64) if step == "tcpstore_vllm_port" else None
                runs[m] = portrace.tcpstore_trial(procs=8, threads=4, hold=args.hold, patched=m == "patched",
                                                  vllm_port=port)
        else:
            runs = {m: portrace.tcpstore_trial(procs=2, threads=2, hold=args.hold, patched=m == "patched",
                                               vllm_port=portrace.free_band(64), mq_ip="127.0.0.1")
                    for m in ("unpatched", "patched")}
        record(step, **runs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"[port_races] wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
