"""The trainer pages' table from the ``row`` of each benchmarks/results/integrations/*.json.

    python benchmarks/integrations/table.py [--results benchmarks/results/integrations] [--doc docs/trainers/index.md]
        [--framework verl]

Rewrites the part of ``--doc`` between ``<!-- integrations-table -->`` and ``<!-- /integrations-table -->``
(prints the table when the markers are missing). One row per framework result: release, vLLM minor, real code or
replay, sync correct off / on / adapter, sync time off / on / adapter, mismatch off / on, what the plugin fixed.
Per-path and per-model results (a replay's sync paths, each model) are listed within a cell; a replay without an
adapter shows ``push_weights`` called at the framework's hook point in the adapter column."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

START, END = "<!-- integrations-table -->", "<!-- /integrations-table -->"
HEAD = ("| framework | release | vLLM | code | sync correct off / on / adapter | sync time off / on / adapter "
        "| mismatch off / on | what the plugin fixed |\n|---|---|---|---|---|---|---|---|")
# adapter: the framework's one-line adapter; for a replay without one, push_weights called at its hook point


def _yes(x) -> str:
    if isinstance(x, dict):  # per sync path of a replay (SkyRL: broadcast and IPC)
        return ", ".join(f"{k} {_yes(v)}" for k, v in x.items())
    return {True: "yes", False: "no", None: "–"}[x]


def _ms(x) -> str:
    if isinstance(x, dict):
        return "; ".join(f"{k} {_ms(v)}" for k, v in x.items())
    return "–" if x is None else f"{x * 1000:.1f} ms"


def _mm(x) -> str:
    if isinstance(x, dict):
        return "; ".join(f"{k} {_mm(v)}" for k, v in x.items())
    return "–" if x is None else f"{x:.4f}"


def _first_text(x) -> str | None:
    """The first failure message of a result that may hold them per path and per model."""
    if isinstance(x, str):
        return x
    for v in (x.values() if isinstance(x, dict) else x if isinstance(x, list) else ()):
        t = _first_text(v)
        if t:
            return t
    return None


def _get(r: dict, what: str, side: str):
    """``what`` for ``side`` (off, on, adapter); a replay without an adapter has ``push_weights`` at the hook."""
    if side == "adapter" and f"{what}_adapter" not in r:
        return r.get(f"{what}_push_weights")
    return r.get(f"{what}_{side}")


def _from_checks(r: dict) -> str:
    """A result without ``plugin_fixed`` (the replays): per sync path, stock vLLM's outcome and the plugin's."""
    off, on, fail = _get(r, "sync_correct", "off"), _get(r, "sync_correct", "on"), r.get("sync_off_failure")
    paths = off if isinstance(off, dict) else {None: off}
    out = []
    for k, ok_off in paths.items():
        ok_on = on.get(k) if isinstance(on, dict) else on
        why = _first_text(fail.get(k) if isinstance(fail, dict) and k is not None else fail)
        stock = ("fails" + (f" ({why})" if why else "") if why
                 else "equals a fresh load" if ok_off else "differs from a fresh load" if ok_off is False else "–")
        plugin = {True: "equals a fresh load", False: "differs from a fresh load"}.get(ok_on, "–")
        out.append(f"{k + ': ' if k else ''}stock vLLM CPU {stock}, with the plugin it {plugin}")
    return "; ".join(out)


def row(r: dict) -> str:
    fixed = "; ".join(r.get("plugin_fixed") or []) or _from_checks(r)
    correct = " / ".join(_yes(_get(r, "sync_correct", k)) for k in ("off", "on", "adapter"))
    times = " / ".join(_ms(_get(r, "sync_seconds", k)) for k in ("off", "on", "adapter"))
    mism = " / ".join(_mm(_get(r, "mismatch", k)) for k in ("off", "on"))
    cells = [r["framework"], r.get("release"), f"{r.get('vllm')} (CPU)", r.get("code"), correct, times, mism,
             fixed or "–"]
    return "| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |"


def render(results_dir: str | Path = Path(__file__).resolve().parents[1] / "results" / "integrations",
           framework: str | None = None) -> str | None:
    """The table (header and one row per framework result), or None when no result has a row."""
    results = [json.loads(f.read_text()) for f in sorted(Path(results_dir).glob("*.json"))]
    rows = [r["row"] for r in results if "row" in r
            and (not framework or r["row"]["framework"].lower() == framework.lower())]
    return "\n".join([HEAD] + [row(r) for r in rows]) if rows else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="benchmarks/results/integrations")
    ap.add_argument("--doc", default="docs/trainers/index.md")
    ap.add_argument("--framework", help="only this framework's rows (e.g. verl)")
    a = ap.parse_args()
    table = render(a.results, a.framework)
    if table is None:
        print(f"table.py: no results with a row under {a.results}", file=sys.stderr)
        return 2
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
