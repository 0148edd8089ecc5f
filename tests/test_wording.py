"""User-facing text describes the software and its measurements, not how the work on it was organised.

README.md, CHANGELOG.md, every page under docs/ and every command's --help text are checked against one list of patterns:
work sessions and helpers, lent machines, moving files or chunks to a machine, /tmp/ paths, internal run
letters, this project's own issue numbers, who measured what or when. API terms (``refit_session``) and
upstream references (vllm#42043, trl#6789, "PR #3355" of another project) are not matched. Engine-free.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from vllm_rlpatch.tools import cli

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]

_I = re.I
PATTERNS: dict[str, re.Pattern] = {
    "a work session": re.compile(r"(?<!`)\bsessions?\b", _I),  # `refit_session`, the module `session`: not matched
    "a helper": re.compile(r"\bhelpers?\b", _I),
    "a lent machine": re.compile(r"\blent\b", _I),
    "files moved to a machine": re.compile(
        r"\b(?:carr(?:y|ied|ies)|mov(?:e|ed|es|ing)|cop(?:y|ied|ies)|ship(?:ped)?)\b[^.\n]{0,30}?"
        r"\b(?:to|onto) (?:a|the|another|each) (?:\w+ )?(?:machine|box)\b", _I),
    "chunks for a machine": re.compile(r"\bCHUNKS\b|\bin \d+ parts\b|\bthe (?:offline )?bundle'?s? parts\b"),
    "a /tmp/ path": re.compile(r"/tmp/(?!vllm-rlpatch-ports)"),
    "an internal run letter": re.compile(r"(?<![-\w])runs? [A-Z](?:[–-][A-Z])?\b(?![\w'’]|\.\w)"),
    "this project's issue number": re.compile(r"\bissues? #?\d+|(?<![\w/])(?<!PR )#\d+\b", _I),
    "this project's issue": re.compile(
        r"\b(?:this|the|that|a separate|our|integration|serving|GPU-default|trainers'?) issue(?:'s)?\b", _I),
    "who measured or when": re.compile(
        r"\b(?:the lead|that day|this morning|yesterday|earlier today|measured by (?:me|us|\w+ session))\b", _I),
}


def offences(text: str) -> list[tuple[int, str, str]]:
    """(line number, pattern name, the matched text) for every hit."""
    hits = []
    for no, line in enumerate(text.splitlines(), 1):
        for name, pat in PATTERNS.items():
            for m in pat.finditer(line):
                hits.append((no, name, m.group(0)))
    return hits


def _documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _help_texts() -> dict[str, str]:
    out = {}
    for argv in [["--help"], *[[name, "--help"] for name in cli.COMMANDS]]:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            with contextlib.suppress(SystemExit):
                cli.main(argv)
        out[" ".join(argv)] = buf.getvalue()
    return out


@pytest.mark.parametrize("path", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_documentation_wording(path):
    hits = offences(path.read_text(encoding="utf-8"))
    assert not hits, "\n".join(f"{path.relative_to(ROOT)}:{no}: {name}: {text!r}" for no, name, text in hits)


def test_cli_help_wording():
    texts = _help_texts()
    assert len(texts) == len(cli.COMMANDS) + 1 and all(texts.values()), "every --help printed something"
    hits = [f"vllm-rlpatch {k}: line {no}: {name}: {t!r}" for k, v in texts.items() for no, name, t in offences(v)]
    assert not hits, "\n".join(hits)


PLANTED = {
    "a work session": "This was measured in a session on Tuesday.",
    "a helper": "A helper moved the table here.",
    "a lent machine": "Run on a lent machine.",
    "files moved to a machine": "The wheels were copied over to the GPU machine first.",
    "chunks for a machine": "with them in CHUNKS, run the script",
    "a /tmp/ path": "the bundle in /tmp/chunks",
    "an internal run letter": "in run L the ratio was 1.03×; runs H–J rested them",
    "this project's issue number": "see issue 37 and #31",
    "this project's issue": "The issue's bounds are met.",
    "who measured or when": "The lead measured it; no H200 came that day.",
}

@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_planted_word_fails(name):
    assert name in {n for _, n, _ in offences(PLANTED[name])}


def test_api_terms_and_upstream_references_pass():
    text = ("with refit_session(llm) as s: one update; vllm#42043, trl#6789 and NeMo-RL PR #3355 are upstream; "
            "leases live in /tmp/vllm-rlpatch-ports-<uid>; vLLM issues seen while building this; run CI on it; "
            "the head runs F.linear(h); `--runs N` runs; `fleet_throughput-vllm0.32.0-cpu-runD.json`")
    assert offences(text) == []
