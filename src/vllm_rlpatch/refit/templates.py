"""Update templates: a repeated update of the same tensors, checked and opened once.

A trainer that updates its tensors in place sends the same tensor objects step after step (``cuda_ipc``). The
first update registers a template (``request.template``): its metadata, already checked, and its opened source,
kept open across updates (``Source.pinned``). A later update names it (transport ``{"kind": "template"}``) and
carries only its own digests. The template also keeps what later updates would otherwise recompute: the name
sets, the copy-plan entries of its names, the precondition proof of ``validate-then-write``, the fused
copy-and-check plan and a CUDA graph of its copies, each keyed on the copy plan it was made for.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.source import Source


@dataclasses.dataclass(eq=False)
class Template:
    metas: list[P.TensorMeta]  # its own records; each update's digests are written into them
    source: Source  # opened once, pinned
    all_names: frozenset[str] | None = None
    plan_names: frozenset[str] | None = None  # less the tied aliases
    static_ok: tuple | None = None  # (plan, allow_cast, windows) the static preconditions were proven for
    entries_key: tuple | None = None  # (plan, names) of ``entries``
    entries: list | None = None  # the plan entries of its names
    fused_key: tuple | None = None  # (plan, windows) of ``fused``
    fused: Any = None  # checks.copy_check_plan of its windows
    fused_names: list[str] | None = None  # the names whose digests its windows must have (whole sources only)
    graph_key: tuple | None = None  # (plan, windows) of ``graph``
    graph: Any = None  # a CUDA graph of its copies
    graph_failed: bool = False  # capturing the graph failed once: copy eagerly
    seen: bool = False  # used once (the graph is captured on the next use)


class Templates:
    """This worker's update templates: the latest only (a trainer that changed its tensors sends a new one)."""

    def __init__(self) -> None:
        self._by_key: dict[str, Template] = {}

    def get(self, key: str | None) -> Template | None:
        return self._by_key.get(key or "")

    def register(self, key: str, metas: list[P.TensorMeta], source: Source) -> Template:
        self._by_key.clear()
        source.pinned = True  # kept open across updates
        t = self._by_key[key] = Template(metas, source)
        return t
