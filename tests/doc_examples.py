"""The Python examples of README.md and docs/: collected from the Markdown, run as a user would run them.

Every ```python block is an example. The blocks of one page run in order in one namespace whose ``__name__``
is ``"__main__"`` (so an ``if __name__ == "__main__":`` block runs, as in a script), in one process per run of
this file. A marker, an HTML comment right before the fence (invisible on a rendered page), changes that:

    <!-- example: skip REASON -->          not run; the reason is required and listed by the test
    <!-- example: setup
    llm = docs_engine()
    -->                                    code run before the block (a name the page's text assumes)

``docs_engine()`` is the one engine a run shares: the embedded llama-tiny on the CPU, started on first use.

    python tests/doc_examples.py OUT.json README.md docs/weight-updates.md ...

writes ``[{"page", "line", "status": "passed"|"failed"|"skipped", "reason", "seconds", "error"}, ...]``.
"""

from __future__ import annotations

import json
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
ANY_PYTHON_FENCE = re.compile(r"^```(?:python|py)\b", re.M)
MARK = re.compile(r"<!--\s*example:\s*(skip|setup)\b((?:(?!-->).)*)-->\s*\Z", re.S)  # the comment right before


@dataclass
class Example:
    page: str
    line: int
    code: str
    skip: str | None = None  # the declared reason, or None
    setup: str = ""


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def collect(path: Path, root: Path = ROOT) -> list[Example]:
    text = path.read_text(encoding="utf-8")
    page = str(path.relative_to(root))
    out = []
    for m in FENCE.finditer(text):
        ex = Example(page, text.count("\n", 0, m.start()) + 1, m.group(1))
        mark = MARK.search(text[:m.start()])
        if mark and mark.group(1) == "skip":
            ex.skip = mark.group(2).strip()
        elif mark:
            ex.setup = mark.group(2).strip("\n") + "\n"
        out.append(ex)
    return out


_ENGINES: dict = {}


def docs_engine(name: str = "default"):
    """An engine the examples share by name (llama-tiny, bf16, CPU-sized), started on first use in a run."""
    if name not in _ENGINES:
        import vllm  # noqa: PLC0415 - the engine-free tests import this module without vLLM's cost

        from vllm_rlpatch.models import path  # noqa: PLC0415

        _ENGINES[name] = vllm.LLM(path("llama-tiny"), dtype="bfloat16", max_model_len=256, enforce_eager=True,
                                  kv_cache_memory_bytes=64 << 20)
    return _ENGINES[name]


def run_examples(examples: list[Example]) -> list[dict]:
    """Run one page's examples in order in one namespace; a failure is recorded and the next example runs."""
    results = []
    ns = {"__name__": "__main__", "docs_engine": docs_engine}
    for ex in examples:
        rec = {"page": ex.page, "line": ex.line, "status": "skipped", "reason": ex.skip, "seconds": 0.0,
               "error": None}
        if ex.skip is None:
            t0 = time.perf_counter()
            try:
                exec(compile(ex.setup + ex.code, f"{ex.page}:{ex.line}", "exec"), ns)  # noqa: S102
                rec["status"] = "passed"
            except BaseException:  # noqa: BLE001 - every failure is a result
                rec["status"], rec["error"] = "failed", traceback.format_exc(limit=-4)
            rec["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"[doc-examples] {ex.page}:{ex.line} {rec['status']} {rec['seconds']} s", flush=True)
        results.append(rec)
    return results


def run(paths: list[str]) -> list[dict]:
    return [rec for rel in paths for rec in run_examples(collect(ROOT / rel))]


if __name__ == "__main__":
    out = run(sys.argv[2:])
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
