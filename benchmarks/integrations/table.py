"""The trainer pages' table from the ``row`` of each benchmarks/results/integrations/*.json.

    python benchmarks/integrations/table.py [--results benchmarks/results/integrations] [--doc docs/trainers/index.md]
        [--framework verl]

Rewrites the part of ``--doc`` between ``<!-- integrations-table -->`` and ``<!-- /integrations-table -->``
(prints the table when the markers are missing). One row per framework result: release, vLLM minor, real code or
replay, sync correct off / on / adapter, sync time off / on / adapter, mismatch off / on, what the plugin fixed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

START, END = "<!-- integrations-table -->", "<!-- /integrations-table -->"
HEAD = ("| framework | release | vLLM | code | sync correct off / on / adapter | sync time off / on / adapter "
        "| mismatch off / on | what the plugin fixed |\n|---|---|---|---|---|---|---|---|")


def _yes(x) -> str:
    return {True: "yes", False: "no", None: "–"}[x]


def _ms(x) -> str:
    if isinstance(x, dict):
        return "; ".join(f"{k} {_ms(v)}" for k, v in x.items())
    return "–" if x is None else f"{x * 1000:.1f} ms"


def _mm(x) -> str:
    if isinstance(x, dict):
        return "; ".join(f"{k} {_mm(v)}" for k, v in x.items())
    return "–" if x is None else f"{x:.4f}"


def row(r: dict) -> str:
    fixed = "; ".join(r.get("plugin_fixed") or []) or "–"
    correct = " / ".join(_yes(r.get(f"sync_correct_{k}")) for k in ("off", "on", "adapter"))
    times = " / ".join(_ms(r.get(f"sync_seconds_{k}")) for k in ("off", "on", "adapter"))
    mism = " / ".join(_mm(r.get(f"mismatch_{k}")) for k in ("off", "on"))
    cells = [r["framework"], r.get("release"), f"{r.get('vllm')} (CPU)", r.get("code"), correct, times, mism, fixed]
    return "| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="benchmarks/results/integrations")
    ap.add_argument("--doc", default="docs/trainers/index.md")
    ap.add_argument("--framework", help="only this framework's rows (e.g. verl)")
    a = ap.parse_args()
    results = [json.loads(f.read_text()) for f in sorted(Path(a.results).glob("*.json"))]
    results = [r["row"] for r in results if "row" in r
               and (not a.framework or r["row"]["framework"].lower() == a.framework.lower())]
    if not results:
        print(f"table.py: no results with a row under {a.results}", file=sys.stderr)
        return 2
    table = "\n".join([HEAD] + [row(r) for r in results])
    doc = Path(a.doc)
    text = doc.read_text() if doc.is_file() else ""
    if START in text and END in text:
        pre, rest = text.split(START, 1)
        doc.write_text(f"{pre}{START}\n{table}\n{END}{rest.split(END, 1)[1]}")
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
