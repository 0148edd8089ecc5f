"""What the ``.pth`` start-up hook costs every interpreter of the environment: ``import vllm_rlpatch._startup``
(and with it ``vllm_rlpatch``), read from ``python -X importtime``.

- The modules the hook imports are a snapshot (tests/snapshots/startup/modules.txt): a new one fails, since
  every Python process of the environment would import it.
- Its time: the median of several fresh interpreters is recorded with the snapshots
  (tests/snapshots/startup/import_time.json); the test fails only when even the fastest run now takes more
  than ``FACTOR`` times the recorded median (far outside the spread of a loaded host), not on noise."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys

import pytest

from support import snapshots
from support.env import clean_env

pytestmark = pytest.mark.quick

RUNS = 15
FACTOR = 3.0
HOOK, PACKAGE = "vllm_rlpatch._startup", "vllm_rlpatch"
LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)$")


def importtime() -> list[tuple[int, int, str]]:
    """(cumulative microseconds, depth, module) of each import of one fresh interpreter, in the order
    ``-X importtime`` prints them (a module after the modules it imported)."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {HOOK}, {PACKAGE}"], capture_output=True,
                       text=True, timeout=120, env=clean_env())
    assert p.returncode == 0, p.stderr[-4000:]
    return [(int(m[2]), len(m[3]), m[4]) for m in map(LINE.match, p.stderr.splitlines()) if m]


def imported_by(rows: list[tuple[int, int, str]], module: str) -> list[str]:
    """The modules MODULE's import loaded (those not loaded before it)."""
    i = next(i for i, r in enumerate(rows) if r[2] == module)
    depth, out = rows[i][1], []
    for _, d, name in reversed(rows[:i]):
        if d <= depth:
            break
        out.append(name)
    return sorted(out)


@pytest.fixture(scope="module")
def runs() -> list[list[tuple[int, int, str]]]:
    return [importtime() for _ in range(RUNS)]


def test_the_startup_hook_imports_only_what_it_did(runs):
    mods = imported_by(runs[0], HOOK)
    snapshots.check_text("startup/modules.txt", "".join(f"{m}\n" for m in mods),
                         f"the modules `import {HOOK}` loads in every interpreter")


def test_startup_import_time_within_its_spread(runs):
    now = {}
    for module in (HOOK, PACKAGE):
        us = [next(c for c, _, name in rows if name == module) for rows in runs]
        now[module] = {"median_us": int(statistics.median(us)), "min_us": min(us), "max_us": max(us)}
    rel = "startup/import_time.json"
    if snapshots.updating():
        snapshots.write(rel, json.dumps({"runs": RUNS, "python": sys.version.split()[0], **now}, indent=1) + "\n")
        return
    stored = snapshots.read(rel)
    assert stored is not None, f"no recorded start-up import time; record it with:\n  {snapshots.UPDATE_COMMAND}"
    recorded = json.loads(stored)
    table = "\n".join(f"  {m}: now median {v['median_us']} us (min {v['min_us']}, max {v['max_us']}); recorded "
                      f"median {recorded[m]['median_us']} us" for m, v in now.items())
    print(table)
    slow = [m for m, v in now.items() if v["min_us"] > FACTOR * recorded[m]["median_us"]]
    assert not slow, (f"start-up import of {slow}: even the fastest of {RUNS} runs is over {FACTOR}x the recorded "
                      f"median:\n{table}\nIf that is intended, record it again with:\n  {snapshots.UPDATE_COMMAND}")
