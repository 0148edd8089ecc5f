"""The table of benchmark results files in docs/benchmarks.md, generated from benchmarks/results/*.json.

One row per JSON file: the benchmark (the file name), the hardware (the file's own `gpu` / `device` /
`device_name` / `machine` / `cpu_count` fields, else its name), the vLLM version (`vllm`, `versions`, else the
name) and the date (`date`, else the day of the commit that added the file).

    python benchmarks/results_table.py                            # print the table
    python benchmarks/results_table.py --write docs/benchmarks.md # replace it between the page's markers
    python benchmarks/results_table.py --check docs/benchmarks.md # exit 1 if the page's table is stale

Exit status 2 on bad arguments (a page without the markers).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"


def _cores(d: dict) -> str:
    n = d.get("cpu_count") or d.get("cpus")
    return f", {n} cores" if n else ""


def hardware(name: str, d: dict) -> str:
    gpu = d.get("gpu") if isinstance(d.get("gpu"), str) else None
    device = d.get("device") if isinstance(d.get("device"), str) else ""
    if gpu:
        return gpu
    if device == "cuda" and d.get("device_name"):
        return d["device_name"]
    if device == "cpu":
        return f"CPU{_cores(d)}"
    if device:
        return device
    if isinstance(d.get("machine"), str):
        return f"CPU ({d['machine']})"
    for card in ("h200", "h100"):
        if f"-{card}" in name:
            return f"NVIDIA {card.upper()}"
    return f"CPU{_cores(d)}" if "-cpu" in name or _cores(d) else "not recorded"


def vllm_version(name: str, d: dict) -> str:
    if isinstance(d.get("vllm"), str):
        return d["vllm"]
    if isinstance(d.get("versions"), list):
        return ", ".join(map(str, d["versions"]))
    m = re.search(r"vllm(\d+\.\d+\.\d+)", name)
    return m.group(1) if m else "not recorded"


def date(path: Path, d: dict) -> str:
    if isinstance(d.get("date"), str):
        return d["date"][:10]
    try:
        out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%as", "-1", "--", str(path)], cwd=ROOT,
                             capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        out = ""
    return f"{out} (committed)" if out else "not committed yet"


def rows() -> list[tuple[str, str, str, str]]:
    out = []
    for path in sorted(RESULTS.glob("*.json")):
        d = json.loads(path.read_text())
        d = d if isinstance(d, dict) else {}
        out.append((path.name, hardware(path.name, d), vllm_version(path.name, d), date(path, d)))
    return out


def render() -> str:
    lines = ["| results file | hardware | vLLM | date |", "|---|---|---|---|"]
    lines += [f"| `{f}` | {hw} | {v} | {day} |" for f, hw, v, day in rows()]
    return "\n".join(lines)


def replace(text: str, table: str) -> str | None:
    if START not in text or END not in text:
        return None
    a, b = text.index(START) + len(START), text.index(END)
    return text[:a] + "\n" + table + "\n" + text[b:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="results_table.py", description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--write", metavar="PAGE")
    g.add_argument("--check", metavar="PAGE")
    args = ap.parse_args(argv)
    if not (args.write or args.check):
        print(render())
        return 0
    page = Path(args.write or args.check)
    text = page.read_text(encoding="utf-8") if page.is_file() else ""
    new = replace(text, render())
    if new is None:
        print(f"error: {page} has no results-table markers ({START} ... {END})", file=sys.stderr)
        return 2
    if args.check:
        if new != text:
            print(f"{page}: the results table is stale; run: python benchmarks/results_table.py --write {page}")
            return 1
        return 0
    page.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
