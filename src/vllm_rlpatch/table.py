"""The patch table, generated from the specs (README and ``vllm-rlpatch patches``)."""

from __future__ import annotations


def rows() -> list[dict[str, str]]:
    from vllm_rlpatch.patches import ALL_PATCHES

    return [{"name": s.name, "summary": s.summary, "vllm": s.vllm, "fixed_in": s.fixed_in or "—",
             "toggle": f"{s.env.name} (default {'on' if s.default else 'off'})", "upstream": s.upstream}
            for s in ALL_PATCHES]


def markdown() -> str:
    out = ["| patch | what it does | vLLM | fixed upstream in | toggle | upstream |",
           "|---|---|---|---|---|---|"]
    for r in rows():
        out.append(f"| `{r['name']}` | {r['summary']} | `{r['vllm']}` | {r['fixed_in']} | `{r['toggle']}` | "
                   f"{r['upstream']} |")
    return "\n".join(out)


def plain() -> str:
    return "\n".join(f"{r['name']:<18} {r['vllm']:<10} {r['toggle']:<48} {r['summary']}" for r in rows())
