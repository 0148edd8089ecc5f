"""Reading what a run wrote: the plugin's per-process summary lines, a script's ``RESULT {...}`` line, and the
last lines of every vLLM process (what an ``EngineDeadError`` refers to)."""

from __future__ import annotations

import json
import re

SUMMARY_RE = re.compile(r"vllm-rlpatch: pid=(\d+) role=(\S+) vllm=(\S+) \(([^)]*)\) applied=\[([^\]]*)\] "
                        r"skipped=\[([^\]]*)\] failed=\[([^\]]*)\]")
_PROC_RE = re.compile(r"^\(([A-Za-z_][\w-]*)(?:[^)]*?)pid=(\d+)\)\s?")
_DEATH_WORDS = ("EngineDeadError", "EngineCore encountered", "died unexpectedly", "EngineGenerateError")


def summaries_in(log: str) -> list[dict]:
    """The plugin's per-process summary lines in a vLLM log, as dicts."""
    return [dict(zip(("pid", "role", "vllm", "dist", "applied", "skipped", "failed"), g))
            for g in SUMMARY_RE.findall(log)]


def result_json(line: str):
    """The JSON of a script's ``RESULT {...}`` line; text another thread wrote onto the same line after it
    (Ray forwards its actors' output to the driver's stdout) is ignored."""
    return json.JSONDecoder().raw_decode(line[len("RESULT "):].lstrip())[0]


def process_tails(log: str, n: int = 12) -> str:
    """The last ``n`` lines each vLLM process wrote (engine core and workers prefix theirs with
    ``(Name pid=N)``; the rest is the front end), plus every line that reports a process death: what an
    `EngineDeadError` ("see stack trace above") refers to, when no stack trace is above it."""
    by_proc: dict[str, list[str]] = {}
    deaths = []
    for line in log.splitlines():
        m = _PROC_RE.match(line)
        key = f"{m.group(1)} pid={m.group(2)}" if m else "front end"
        by_proc.setdefault(key, []).append(line)
        if any(w in line for w in ("died unexpectedly", "Illegal instruction", "Segmentation fault", "exit code: -")):
            deaths.append(line)
    parts = ["--- process deaths ---", *(deaths or ["(none reported)"])]
    for key, lines in by_proc.items():
        parts.append(f"--- last {min(n, len(lines))} lines of {key} ---")
        parts.extend(lines[-n:])
    return "\n".join(parts)


def explain_deaths(obj, log: str):
    """Append the processes' last log lines to every reported error that says the engine died."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "error" and isinstance(v, str) and any(w in v for w in _DEATH_WORDS):
                obj[k] = v + "\n" + process_tails(log)
            else:
                explain_deaths(v, log)
    elif isinstance(obj, list):
        for v in obj:
            explain_deaths(v, log)
    return obj
