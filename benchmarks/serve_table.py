"""The table of docs/serving.md's "Updates under streaming load", generated from the committed JSON of
``benchmarks/serve_rl_loop.py``.

    python benchmarks/serve_table.py                          # print the table
    python benchmarks/serve_table.py --write docs/serving.md  # replace it between the page's markers
    python benchmarks/serve_table.py --json FILE              # another result file

One row per phase (no updates, then each in-flight mode): requests, lost or failed, aborted by the update, tokens
dropped or doubled, tokens checked against a reference of their version, wrong-version tokens, the p99 and
largest inter-token gap during a push (whole run for the phase without updates), the ``keep`` stall bound and
tokens/s. Exit status 2 on a missing file or a page without the markers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "benchmarks" / "results" / "serve_rl_loop-vllm0.32.0-cpu.json"
START, END = "<!-- serve-load-table:start -->", "<!-- serve-load-table:end -->"
HEAD = ("| phase | requests | lost or failed | aborted by the update | dropped or doubled tokens | tokens checked "
        "| wrong-version tokens | p99 / largest gap during a push | keep bound | tokens/s |\n"
        "|---|---|---|---|---|---|---|---|---|---|")


def _ms(s: float | None) -> str:
    if s is None:
        return "–"
    return f"{s * 1000:.1f} ms" if s < 0.01 else f"{s * 1000:.0f} ms"


def row(name: str, p: dict) -> str:
    aborted = str(p["aborted_by_update"])
    if p.get("aborted_reported_by_pushes") and p["aborted_reported_by_pushes"] != p["aborted_by_update"]:
        aborted += f" ({p['aborted_reported_by_pushes']} reported by the pushes)"
    push = p.get("gaps_during_push")
    if push:
        gaps = f"{_ms(push['p99_s'])} / {_ms(push['max_s'])}"
    else:
        gaps = f"(whole run: {_ms(p['gaps_all']['p99_s'])} / {_ms(p['gaps_all']['max_s'])})"
    bound = ""
    if p.get("inflight") == "keep" and p.get("stall_bound_s") is not None:
        bound = f"{_ms(p['stall_bound_s'])} ({'met' if p.get('p99_gap_within_bound') else 'missed'})"
    cells = [name, f"{p['requests']:,}", p["lost_or_failed"], aborted, p["dropped_or_doubled"],
             f"{p['tokens_checked']:,}", p["wrong_version_tokens"], gaps, bound, f"{p['tokens_per_s']:.1f}"]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def render(path: Path = DEFAULT) -> str:
    d = json.loads(Path(path).read_text())
    lines = [HEAD]
    if "baseline" in d:
        lines.append(row("no updates", d["baseline"]))
    lines += [row(f"`{m}`", d[m]) for m in d["config"]["modes"] if m in d]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="serve_table.py", description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=str(DEFAULT), help="a serve_rl_loop.py result (default: the committed one)")
    ap.add_argument("--write", metavar="PAGE", help="replace the table between the page's markers")
    a = ap.parse_args(argv)
    if not Path(a.json).is_file():
        print(f"serve_table.py: no result file {a.json}", file=sys.stderr)
        return 2
    table = render(Path(a.json))
    if not a.write:
        print(table)
        return 0
    page = Path(a.write)
    text = page.read_text() if page.is_file() else ""
    if START not in text or END not in text:
        print(f"serve_table.py: {page} has no markers ({START} ... {END})", file=sys.stderr)
        return 2
    pre, rest = text.split(START, 1)
    page.write_text(f"{pre}{START}\n{table}\n{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
