"""The patch table, generated from the specs (README and ``vllm-rlpatch patches``)."""

from __future__ import annotations

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


def regenerate_readme(path: str) -> bool:
    """Rewrite the generated sections of the README in place. Returns True if it changed."""
    with open(path, encoding="utf-8") as fh:
        old = fh.read()

    new = replace_between(replace_between(old, "patch-table", markdown()), "env-table", env_markdown())
    if "<!-- upstream-table:start -->" in new:
        new = replace_between(new, "upstream-table", upstream.markdown(upstream.load_all()))
    if new != old:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(new)
    return new != old
