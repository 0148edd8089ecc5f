"""The trainer pages' table from benchmarks/results/integrations/<framework>.json.

    python benchmarks/integrations/table.py [--results benchmarks/results/integrations] [--doc docs/trainers/index.md]

Rewrites the part of ``--doc`` between ``<!-- integrations-table -->`` and ``<!-- /integrations-table -->``
(prints the table when the markers are missing). One row per framework, model and plugin mode."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

START, END = "<!-- integrations-table -->", "<!-- /integrations-table -->"
HEAD = ("| framework | release | vLLM | code | model | plugin | sync correct | sync s (as is) | sync s (adapter) "
        "| token_mult_prob_error | sync error |\n|---|---|---|---|---|---|---|---|---|---|---|")


def _f(x, fmt="{:.3f}"):
    return "–" if x is None else fmt.format(x)


def rows(res: dict) -> list[str]:
    out = []
    code = "real code" if res.get("real_code") else "replay"
    for key, s in sorted(res.get("summary", {}).items()):
        model, mode = key.split("/")
        correct = {True: "yes", False: "**no**", None: "–"}[s.get("sync_correct")]
        err = (s.get("sync_error") or "").replace("|", "/")[:120] or "–"
        out.append(f"| {res['framework']} | {res.get('release')} | {res.get('vllm')} | {code} | {model} | {mode} "
                   f"| {correct} | {_f(s.get('sync_s_median'))} | {_f(s.get('adapter_s_median'))} "
                   f"| {_f(s.get('token_mult_prob_error'), '{:.4f}')} | {err} |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="benchmarks/results/integrations")
    ap.add_argument("--doc", default="docs/trainers/index.md")
    a = ap.parse_args()
    files = sorted(Path(a.results).glob("*.json"))
    if not files:
        print(f"table.py: no results under {a.results}", file=sys.stderr)
        return 2
    table = "\n".join([HEAD] + [r for f in files for r in rows(json.loads(f.read_text()))])
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
