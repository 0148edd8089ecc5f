"""Key figures of a documentation page, generated from the committed JSON under benchmarks/results/.

    python benchmarks/figures.py                   # print every page's table
    python benchmarks/figures.py --write           # replace each page's table between its markers
    python benchmarks/figures.py --check           # exit 1 if a page's table is stale

Each page listed in FIGURES gets a table between ``<!-- figures:start -->`` and ``<!-- figures:end -->``: one
row per figure, its value read from a results file, the file's hardware and vLLM version (as the results table
of docs/benchmarks.md reads them) and the file. Exit status 2 when a page lacks the markers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- figures:start -->", "<!-- figures:end -->"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_table import hardware, vllm_version  # noqa: E402 - the script's own directory, just added


def _yes(x: Any) -> str:
    return "yes" if x is True else "no" if x is False else str(x)


def _rows_differ(side: str, kind: str) -> Callable[[dict], str]:
    return lambda d: f"{d[side][kind]['rows_differ']} of {d[side][kind]['rows']}"


KV = "kv_pin-vllm0.25.1-h200.json"
UNPINNED, PINNED = "unpinned (gpu_memory_utilization=0.8)", "pinned (VLLM_RLPATCH_KV_CACHE_BYTES)"
MRV2 = "mrv2-vllm0.32.0-h100.json"
TWIN_INFO, TWIN_UNPATCHED = "mrv2_twin-engine_info-vllm0.32.0-h100.json", "mrv2_twin-unpatched-vllm0.32.0-h100.json"
KERNEL = "mrv2_topp-kernel-vllm0.32.0-h100.json"

AB = "rollout_ab-cpu.json"


def _ab(pair: str, stat: str = "token_mult_prob_error") -> Callable[[dict], str]:
    """A rollout A/B difference (B minus A) with its 95% bootstrap interval."""
    def value(d: dict) -> str:
        x = d["diffs"][pair][stat]
        return f"{x['diff']:+.4f} [{x['ci95'][0]:+.4f}, {x['ci95'][1]:+.4f}]"
    return value


# page -> [(figure, results file, value from the file's JSON)]
FIGURES: dict[str, list[tuple[str, str, Callable[[dict], str]]]] = {
    "parity.md": [
        (f"`token_mult_prob_error`, plugin minus stock, vLLM {v} (95% interval)", AB, _ab(f"{v} stock vs {v} rlpatch"))
        for v in ("0.20.2", "0.25.1", "0.32.0")
    ] + [
        ("the same, vLLM 0.32.0 minus 0.25.1, both with the plugin", AB, _ab("0.25.1 rlpatch vs 0.32.0 rlpatch")),
        ("mean rollout length, vLLM 0.32.0 minus 0.25.1, both stock", AB,
         _ab("0.25.1 stock vs 0.32.0 stock", "length_mean")),
        ("calibration: runs of one configuration split in two halves, any statistic flagged", AB,
         lambda d: f"{d['calibration']['null']['any_statistic_flagged_rate']:.1%} of "
                   f"{d['calibration']['null']['splits']} splits"),
    ],
    "kv-pin.md": [
        ("KV tokens, unpinned (`gpu_memory_utilization=0.8`)", KV,
         lambda d: f"{d['summary'][UNPINNED]['kv_tokens']:,}"),
        ("wake-up with a 60 GiB trainer reserve held, unpinned", KV,
         lambda d: d["summary"][UNPINNED]["wake_with_reserve"]),
        ("KV pin chosen by `vllm-rlpatch kv-pin`", KV, lambda d: f"{d['summary']['kv-pin']['pin_gib']} GiB "
         f"({d['summary']['kv-pin']['kv_tokens']:,} tokens)"),
        ("the same pin in two runs", KV, lambda d: _yes(d["summary"]["kv-pin"]["same_pin_in_two_runs"])),
        ("wake-up with the reserve held, pinned", KV,
         lambda d: f"{d['summary'][PINNED]['wake_with_reserve']} ({d['summary'][PINNED]['wake_s']} s)"),
        ("outputs identical after the wake-up, pinned", KV,
         lambda d: _yes(d["summary"][PINNED]["outputs_identical_after_wake"])),
        ("rollout tokens/s, pinned / unpinned", KV, lambda d: f"{d['summary']['throughput_ratio_pinned_vs_unpinned']}"),
    ],
    "mrv2.md": [
        ("Model Runner V2 ran", MRV2, lambda d: _yes(d["checks"]["mrv2_ran"]["ok"])),
        ("processed logprobs within the bound of a float32 reference", MRV2,
         lambda d: _yes(d["checks"]["processed_logprobs_vs_fp32_reference"]["ok"])),
        ("fp32 head exact", MRV2, lambda d: _yes(d["checks"]["fp32_head_exact"]["ok"])),
        ("no KV of the old weights after an update", MRV2,
         lambda d: _yes(d["checks"]["no_stale_kv_after_update"]["ok"])),
        ("a NaN update refused, weights unchanged", MRV2,
         lambda d: _yes(d["checks"]["refused_bad_update_unchanged"]["ok"])),
        ("the plugin in every process", MRV2, lambda d: _yes(d["checks"]["plugin_in_every_process"]["ok"])),
        ("all checks", MRV2, lambda d: _yes(d["ok"])),
        ("the twin with `engine_info`: tokens within 1e-5", TWIN_INFO,
         lambda d: f"{d['checks']['engine_info_matches']['tokens_within_tol']:,} of "
                   f"{d['checks']['engine_info_matches']['tokens']:,}"),
        ("top-p kernel, constructed rows keeping another set than the nominal top-p: unpatched", KERNEL,
         _rows_differ("unpatched", "constructed")),
        ("the same rows, patched (`mrv2_top_p`)", KERNEL, _rows_differ("patched", "constructed")),
        ("random bf16 rows of a 131,072-token vocabulary keeping another set: unpatched / patched", KERNEL,
         lambda d: f"{_rows_differ('unpatched', 'random')(d)} / {_rows_differ('patched', 'random')(d)}"),
        ("the twin without `engine_info`, unpatched: all tokens within 1e-5", TWIN_UNPATCHED,
         lambda d: _yes(d["checks"]["twin_matches"]["ok"])),
    ],
}


def render(page: str) -> str:
    lines = ["| figure | value | hardware | vLLM | results file |", "|---|---|---|---|---|"]
    cache: dict[str, dict] = {}
    for label, name, value in FIGURES[page]:
        d = cache.setdefault(name, json.loads((RESULTS / name).read_text()))
        lines.append(f"| {label} | {value(d)} | {hardware(name, d)} | {vllm_version(name, d)} | `{name}` |")
    return "\n".join(lines)


def replace(text: str, table: str) -> str | None:
    if START not in text or END not in text:
        return None
    return text[:text.index(START) + len(START)] + "\n" + table + "\n" + text[text.index(END):]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="figures.py", description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="replace each page's table between its markers")
    g.add_argument("--check", action="store_true", help="exit 1 if a page's table is stale")
    a = ap.parse_args(argv)
    stale = []
    for page in FIGURES:
        table = render(page)
        if not (a.write or a.check):
            print(f"docs/{page}\n{table}\n")
            continue
        path = ROOT / "docs" / page
        text = path.read_text(encoding="utf-8")
        new = replace(text, table)
        if new is None:
            print(f"figures.py: docs/{page} has no markers ({START} ... {END})", file=sys.stderr)
            return 2
        if a.check and new != text:
            stale.append(page)
        elif a.write:
            path.write_text(new, encoding="utf-8")
    if stale:
        print(f"figures.py: stale tables in {', '.join(stale)}; run: python benchmarks/figures.py --write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
