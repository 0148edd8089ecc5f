"""Run the suite's test files in concurrent pytest processes, one file per process (ci/test.sh).

Most of the suite's time is vLLM engines starting (imports, model load, KV allocation), which is largely
single-threaded: two engines side by side on the 2-core CI box take ~1.6x less time than one after the other.
So the files go to `--lanes` workers, heaviest first (a static cost estimate per file, longest-processing-
time-first); files named with `--alone` (tests/test_port_races.py: it already loads every core with 16
processes and measures races) run first, by themselves. Every file is a whole pytest run, so module-scoped
fixtures are shared exactly as in a plain `pytest tests`.

Prints one line per file as it finishes (lane, file, pytest's summary, seconds), the full output of any file
that failed, then the slowest tests across all files. Exit status: 0 if every file passed (or had nothing to
collect), else 1.

    python ci/shards.py --lanes 2 --alone tests/test_port_races.py -- tests -q --timeout=1200
"""

from __future__ import annotations

import argparse
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

# Seconds per file measured on the 2-core CI box (vLLM 0.25.1, two lanes). Only the order matters; a file
# not listed counts as 60 s.
COST = {
    "tests/test_refit.py": 440,
    "tests/test_user_model.py": 200,  # newest CI version only (0 s elsewhere: every test skips)
    "tests/test_engine.py": 410,
    "tests/test_parity.py": 310,
    "tests/test_inflight.py": 230,
    "tests/test_serve.py": 200,
    "tests/test_serve_load.py": 150,  # one server, 4 streaming clients, 6 pushes; newest CI version only
    "tests/test_serve_scale.py": 100,  # --api-server-count 2 --data-parallel-size 2; newest CI version only
    "tests/test_serve_fuzz.py": 80,  # one server, ~7000 fuzzed requests; newest CI version only
    "tests/test_upstream_behaviour.py": 170,
    "tests/test_rl_correctness.py": 130,
    "tests/test_sampling_support.py": 55,
    "tests/test_fleet.py": 60,  # two engines in one process, one script run
    "tests/test_fleet_protocol.py": 10,  # scripted engines, no vLLM engine
    "tests/test_fleet_ray.py": 95,  # two Ray actors with an engine each; newest CI version only (0 s elsewhere)
    "tests/test_fleet_http.py": 10,  # the phase routes + HTTP client in front of scripted engines, no vLLM
    "tests/test_sender_cache.py": 5,  # the trainer-side cuda_ipc cache, no vLLM engine
    "tests/test_refit_timing.py": 5,  # the commit RPC split, the timeline, packed answers; no vLLM engine
    "tests/test_doctor.py": 110,
    "tests/test_kv_pin.py": 150,
    "tests/test_rollout.py": 120,
    "tests/test_config_paths.py": 80,
    "tests/test_contract.py": 50,
    "tests/test_async_preempt.py": 35,
    "tests/test_cpu_amx.py": 20,
    "tests/test_trainer.py": 50,  # the MRv2 interpreter check: ~20 s on 0.32.0
    "tests/test_mrv2_top_p.py": 20,  # Triton interpreter, 0.32.0 only: 16 s on a loaded 2-core box
    "tests/test_install.py": 40,
    "tests/test_integrations_trl.py": 200,  # TRL GRPOTrainer + a fresh engine, 0.25.1 only; +~65 s cold env build
    "tests/test_integrations_openrlhf.py": 5,  # version refusal; engine run (44 s) only with VLLM_RLPATCH_INTEGRATIONS=1
    "tests/test_doc_examples.py": 95,  # README + docs examples, 4 engines in one process; newest CI version only
    "tests/test_docs.py": 2,
    "tests/test_wording.py": 2,
}


def _summary_line(log: str) -> str:
    for line in reversed(log.strip().splitlines()):
        if " in " in line and any(w in line for w in ("passed", "failed", "error", "skipped", "deselected", "no tests")):
            return line.strip("= ").strip()
    return "(no pytest summary)"


def _xml(xml_path: Path) -> ET.Element | None:
    """The junit report's root, or None where pytest wrote none or a truncated one (a crashed run)."""
    try:
        return ET.parse(xml_path).getroot() if xml_path.is_file() else None
    except ET.ParseError:
        return None


def _skips(xml_path: Path) -> list[str]:
    """`file::test: reason` for every skipped test (pytest's -rs summary, kept per file)."""
    root = _xml(xml_path)
    out = []
    for tc in ([] if root is None else root.iter("testcase")):
        sk = tc.find("skipped")
        if sk is not None:
            reason = (sk.get("message") or sk.text or "").strip().splitlines()
            out.append(f"{tc.get('name')}: {reason[0] if reason else '?'}")
    return out


def _cases(xml_path: Path) -> list[tuple[float, str]]:
    root = _xml(xml_path)
    out = []
    for tc in ([] if root is None else root.iter("testcase")):
        name = f"{tc.get('classname', '').replace('.', '/')}.py::{tc.get('name')}"
        out.append((float(tc.get("time") or 0.0), name))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", type=int, default=2, help="concurrent pytest processes (default 2)")
    ap.add_argument("--alone", action="append", default=[], help="a test file to run by itself, first")
    ap.add_argument("--ignore", action="append", default=[], help="a test directory or file to leave out")
    ap.add_argument("--slowest", type=int, default=15, help="how many of the slowest tests to list")
    ap.add_argument("paths", nargs="+", help="test directories/files; pytest options follow a --")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    pytest_opts = argv[cut + 1:]
    paths = args.paths
    if args.lanes < 1:
        ap.error("--lanes must be >= 1")

    ignored = [Path(p).resolve() for p in args.ignore]
    files: list[str] = []
    for p in paths:
        pp = Path(p)
        found = sorted(pp.glob("test_*.py")) if pp.is_dir() else [pp]
        if not found:
            ap.error(f"no test files under {p}")
        for f in found:
            if not any(f.resolve() == i or i in f.resolve().parents for i in ignored):
                files.append(f.as_posix())
    alone = [f for f in files if f in args.alone]
    pooled = sorted((f for f in files if f not in args.alone), key=lambda f: -COST.get(f, 60))

    tmp = Path(tempfile.mkdtemp(prefix="rlpatch-shards-"))
    lock = threading.Lock()
    results: dict[str, tuple[int, float, str]] = {}
    t_start = time.time()

    def run(f: str, lane: str) -> None:
        xml = tmp / (f.replace("/", "_") + ".xml")
        with lock:
            print(f"[{lane} +{time.time() - t_start:5.0f}s] {f}: started", flush=True)
        t0 = time.time()
        p = subprocess.run([sys.executable, "-m", "pytest", f, *pytest_opts, f"--junitxml={xml}",
                            "-o", "junit_family=xunit1"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        dt = time.time() - t0
        ok = p.returncode in (0, 5)  # 5: nothing collected (every test deselected)
        with lock:
            results[f] = (p.returncode, dt, str(xml))
            print(f"[{lane} +{time.time() - t_start:5.0f}s] {f}: {_summary_line(p.stdout)} "
                  f"({dt:.0f}s{'' if ok else f', pytest exit {p.returncode}'})", flush=True)
            if not ok:
                print(f"----- {f}: full output -----\n{p.stdout}\n----- end of {f} -----", flush=True)
            for line in _skips(xml):
                print(f"    skipped {line}", flush=True)

    for f in alone:
        run(f, "alone")
    q: queue.Queue[str] = queue.Queue()
    for f in pooled:
        q.put(f)

    def worker(i: int) -> None:
        while True:
            try:
                f = q.get_nowait()
            except queue.Empty:
                return
            try:
                run(f, f"lane {i}")
            except Exception as e:  # a runner fault fails this file, never the lane: the other files still run
                with lock:
                    results.setdefault(f, (-1, 0.0, ""))  # pytest never returned: the file failed
                    print(f"[lane {i}] {f}: the runner failed: {type(e).__name__}: {e}", flush=True)

    threads = [threading.Thread(target=worker, args=(i + 1,)) for i in range(min(args.lanes, len(pooled)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    cases = sorted((c for f in files for c in _cases(Path(results[f][2]))), reverse=True)
    print(f"=== slowest {args.slowest} tests (setup + call + teardown, seconds)")
    for dt, name in cases[:args.slowest]:
        print(f"  {dt:7.1f}  {name}")
    failed = [f for f in files if results[f][0] not in (0, 5)]
    print(f"=== {len(files)} files in {time.time() - t_start:.0f}s, {len(failed)} failed"
          + (": " + ", ".join(failed) if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
