"""The patch table, generated from the specs (docs/reference.md and ``vllm-rlpatch patches``)."""

from __future__ import annotations

import os

from vllm_rlpatch import envs
from vllm_rlpatch.patches import ALL_PATCHES
from vllm_rlpatch.tools import upstream


def rows() -> list[dict[str, str]]:
    return [{"name": s.name, "summary": s.summary, "vllm": s.vllm, "fixed_in": s.fixed_in or "—",
             "toggle": _toggle(s), "upstream": s.upstream}
            for s in ALL_PATCHES]


def _toggle(spec) -> str:
    choices = getattr(spec.env.parser, "choices", None)
    if spec.toggle is not None and choices:
        return f"{spec.env.name}={'|'.join(choices)} (default {spec.env.default})"
    return f"{spec.env.name} (default {'on' if spec.default else 'off'})"


def markdown() -> str:
    out = ["| patch | what it does | vLLM | fixed upstream in | toggle | upstream |",
           "|---|---|---|---|---|---|"]
    for r in rows():
        out.append(f"| `{r['name']}` | {r['summary']} | `{r['vllm']}` | {r['fixed_in']} | `{r['toggle']}` | "
                   f"{r['upstream']} |")
    return "\n".join(out)


def plain() -> str:
    """Columns as wide as their longest entry (name, vLLM range, toggle), then the summary."""
    rs = rows()
    head = {"name": "patch", "vllm": "vLLM", "toggle": "toggle", "summary": "what it does"}
    w = {k: max(len(r[k]) for r in [head, *rs]) for k in ("name", "vllm", "toggle")}
    line = lambda r: f"{r['name']:<{w['name']}}  {r['vllm']:<{w['vllm']}}  {r['toggle']:<{w['toggle']}}  {r['summary']}"
    return "\n".join([line(head), *(line(r) for r in rs)])


def env_markdown() -> str:
    out = ["| variable | default | meaning |", "|---|---|---|"]
    for v in envs.all_vars():
        default = {True: "1", False: "0", None: "unset"}.get(v.default, str(v.default))
        out.append(f"| `{v.name}` | {default} | {v.doc} |")
    return "\n".join(out)


def replace_between(text: str, name: str, body: str) -> str:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    a, b = text.index(start) + len(start), text.index(end)
    return text[:a] + "\n" + body + "\n" + text[b:]


def sections() -> dict[str, str]:
    """Every generated section by marker name: the patch table, the environment variables, the upstream diffs
    (as the docs/ pages hold them: the diffs' PR.md named by path)."""
    return {"patch-table": markdown(), "env-table": env_markdown(),
            "upstream-table": upstream.markdown(upstream.load_all(), links=False)}


def regenerate(path: str) -> list[str]:
    """Rewrite the generated sections of a Markdown file, or of every ``*.md`` under a directory, in place.
    Returns the files that changed; a path with no generated section at all is an error (ValueError)."""
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names if f.endswith(".md")) \
        if os.path.isdir(path) else [path]
    changed, seen = [], 0
    for name in files:
        with open(name, encoding="utf-8") as fh:
            old = fh.read()
        new = old
        for section, body in sections().items():
            if f"<!-- {section}:start -->" in new:
                new, seen = replace_between(new, section, body), seen + 1
        if new != old:
            with open(name, "w", encoding="utf-8") as fh:
                fh.write(new)
            changed.append(name)
    if not seen:
        raise ValueError(f"{path}: no generated section (<!-- patch-table:start --> ...)")
    return changed
