"""Size and control-flow measures of the package, read from its syntax tree (no vLLM, no grep): module, class
and function sizes against their limits, comparisons of transport names as strings, and control flow on an
exception's message text. Printed as a table by ``python tests/layers.py`` (every run, so the CI log shows
them) and checked there: a regression fails.

Edit the constants below, not the code:
- ``ALLOWED_OVER``: a module, class or function over its limit, with the reason it may be; an entry that is
  no longer over its limit fails too (so the list only shrinks);
- ``TRANSPORT_REGISTRY_MODULES``: the modules that may compare transport names (the transport registries);
- ``TRANSPORT_COMPARISONS_KNOWN``: comparisons elsewhere that are still to go, counted per module: more fails,
  fewer fails until the count here is lowered;
- ``MESSAGE_TEXT_ALLOWED``: functions that still branch on an error's message text (the goal is none); an
  entry whose function no longer does fails.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG_DIR = SRC / "vllm_rlpatch"

LIMITS = {"module": 500, "class": 300, "function": 80}

# Name -> why it may be over its limit. Names: a module's path under src/vllm_rlpatch ("refit/api.py"), a class
# or function as "path::Qualified.name" ("trainer.py::_Twin.forward"). "to split" entries are debts, not reasons:
# remove each once its split lands (a stale entry fails).
ALLOWED_OVER: dict[str, str] = {
    "refit/fleet.py": "one job: the fleet transaction (phases, fencing, versions, the report) over the sender "
                      "interface",
    "refit/checks.py": "one job: verifying an update's bytes (digests, copy checks, pack-and-digest; kernel and torch)",
    "patches/sampling_support.py": "one job: the per-token support information on both runners (V1, Model "
                                   "Runner V2) and its engine-core channel",
}

# Transport names as the code spells them.
TRANSPORTS = frozenset({"shm", "dist", "cuda_ipc", "cuda_ipc_layout", "template"})
# Modules (paths under src/vllm_rlpatch) that may compare transport names: the registries that map a name to
# its class. Everything else asks the object the registry gave it.
TRANSPORT_REGISTRY_MODULES: frozenset[str] = frozenset({"refit/transports.py", "refit/sources.py"})
# Comparisons outside the registries still to be removed: path -> how many (0 is the goal: remove the entry).
TRANSPORT_COMPARISONS_KNOWN: dict[str, int] = {}

# Functions ("path::Qualified.name") that still branch on an error's message text, with the reason. None is the
# goal (errors by type or `kind`): remove each entry once its function stops.
MESSAGE_TEXT_ALLOWED: dict[str, str] = {
    "refit/coordinator.py::rpc_error_to_refit": "vLLM hands a worker's or the engine core's exception across "
                                                 "processes as text: the one place that turns it into a kind",
}

# What counts as "the text of an exception": str(e), repr(e), e.args (and e.args[i]), and these attributes.
MESSAGE_ATTRS = frozenset({"args", "message", "msg", "strerror"})
TEXT_METHODS = frozenset({"startswith", "endswith", "find", "index", "count", "__contains__"})
TEXT_VIEWS = frozenset({"lower", "upper", "casefold", "strip", "splitlines", "split"})
REGEX_FUNCS = frozenset({"match", "search", "fullmatch", "findall"})


@dataclass(frozen=True)
class Site:
    path: str  # under src/vllm_rlpatch
    line: int
    text: str
    scope: str = ""  # the enclosing function, "path::Qualified.name"

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


@dataclass(frozen=True)
class Size:
    kind: str  # module, class, function
    name: str  # ALLOWED_OVER's key
    line: int
    lines: int

    @property
    def over(self) -> bool:
        return self.lines > LIMITS[self.kind]


def _files() -> dict[str, tuple[str, ast.Module]]:
    out = {}
    for p in sorted(PKG_DIR.rglob("*.py")):
        text = p.read_text()
        out[p.relative_to(PKG_DIR).as_posix()] = (text, ast.parse(text, str(p)))
    return out


def _span(node: ast.AST) -> int:
    """Lines from the ``def``/``class`` line to the last line of the body, both included."""
    return node.end_lineno - node.lineno + 1


def sizes(files=None) -> list[Size]:
    """Every module, class and function of the package with its length in lines (nested ones too)."""
    files = files or _files()
    out = []
    for path, (text, tree) in files.items():
        out.append(Size("module", path, 1, len(text.splitlines())))

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    qual = f"{prefix}{child.name}"
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    out.append(Size(kind, f"{path}::{qual}", child.lineno, _span(child)))
                    visit(child, qual + ".")
                else:
                    visit(child, prefix)

        visit(tree, "")
    return out


def _is_transport(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in TRANSPORTS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_transport(e) for e in node.elts)
    return False


def transport_comparisons(files=None) -> list[Site]:
    """``==``/``!=``/``in``/``not in`` (any comparison) with a transport name, or a tuple/list/set of them, on
    either side; ``case "shm":``; ``x.startswith("cuda_ipc")``. In every module, the registries included."""
    files = files or _files()
    out = []
    for path, (text, tree) in files.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                hit = any(_is_transport(o) for o in [node.left, *node.comparators])
            elif isinstance(node, ast.MatchValue):
                hit = _is_transport(node.value)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                hit = node.func.attr in ("startswith", "endswith") and any(_is_transport(a) for a in node.args)
            else:
                continue
            if hit:
                out.append(Site(path, node.lineno, ast.get_source_segment(text, node) or ""))
    return sorted(out, key=lambda s: (s.path, s.line))


_EXC_ANNOTATION_SUFFIXES = ("Exception", "Error")


def _is_exc_annotation(node: ast.AST | None) -> bool:
    """``BaseException``, ``Exception``, ``RefitError``, ``P.RefitError``, ``X | None`` of those."""
    if isinstance(node, ast.BinOp):
        return _is_exc_annotation(node.left) or _is_exc_annotation(node.right)
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name == "BaseException" or name.endswith(_EXC_ANNOTATION_SUFFIXES)


class _MessageText(ast.NodeVisitor):
    """The places that branch on the text of an error. An error is a name bound by ``except ... as e`` or a
    parameter annotated as an exception; its text is ``str(e)``, ``repr(e)``, ``e.args``, ``e.message`` (and
    ``.lower()`` etc. of those, and a name assigned one of them in the same function). Found: a comparison
    with such a text; ``... in str(x)`` / ``... in repr(x)`` for any ``x`` (an answer's text, too); a
    ``startswith``/``find``/... on a text; ``re.search(..., text)``."""

    def __init__(self, path: str, text: str):
        self.path, self.text, self.sites = path, text, []
        self.scopes: list[tuple[set[str], set[str]]] = [(set(), set())]  # (errors, texts) per function
        self.qual: list[str] = []

    def _func(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        a = node.args
        params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(p for p in (a.vararg, a.kwarg) if p)]
        errors = {p.arg for p in params if _is_exc_annotation(p.annotation)}
        self.scopes.append((errors, set()))
        self.qual.append(getattr(node, "name", "<lambda>"))
        self.generic_visit(node)
        self.qual.pop()
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _func

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.qual.append(node.name)
        self.generic_visit(node)
        self.qual.pop()

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.scopes[-1][0].add(node.name)
        self.generic_visit(node)

    def _is_error(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id in self.scopes[-1][0]

    def _is_text(self, node: ast.AST, any_str: bool = False) -> bool:
        """Is NODE an error's text (with ``any_str``: or ``str(x)`` / ``repr(x)`` of anything)?"""
        if isinstance(node, ast.Name):
            return node.id in self.scopes[-1][1]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("str", "repr"):
            return len(node.args) == 1 and (any_str or self._is_error(node.args[0]))
        if isinstance(node, ast.Attribute):
            return node.attr in MESSAGE_ATTRS and self._is_error(node.value)
        if isinstance(node, ast.Subscript):
            return self._is_text(node.value, any_str)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in TEXT_VIEWS:
            return self._is_text(node.func.value, any_str)
        return False

    def visit_Assign(self, node: ast.Assign) -> None:
        if self._is_text(node.value):
            self.scopes[-1][1].update(t.id for t in node.targets if isinstance(t, ast.Name))
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        operands = [node.left, *node.comparators]
        contains = [r for op, r in zip(node.ops, node.comparators) if isinstance(op, (ast.In, ast.NotIn))]
        if any(self._is_text(o) for o in operands) or any(self._is_text(r, any_str=True) for r in contains):
            self._add(node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if isinstance(f, ast.Attribute):
            if f.attr in TEXT_METHODS and self._is_text(f.value, any_str=True):
                self._add(node)
            elif f.attr in REGEX_FUNCS and any(self._is_text(a) for a in node.args):
                self._add(node)
        self.generic_visit(node)

    def _add(self, node: ast.AST) -> None:
        self.sites.append(Site(self.path, node.lineno, ast.get_source_segment(self.text, node) or "",
                               f"{self.path}::{'.'.join(self.qual) or '<module>'}"))


def message_text_classifications(files=None) -> list[Site]:
    """Control flow on an error's message text (see :class:`_MessageText`)."""
    files = files or _files()
    out = []
    for path, (text, tree) in files.items():
        v = _MessageText(path, text)
        v.visit(tree)
        out.extend(v.sites)
    return sorted(out, key=lambda s: (s.path, s.line))


@dataclass
class Measures:
    sizes: list[Size]
    transport: list[Site]
    message_text: list[Site]

    @classmethod
    def read(cls) -> Measures:
        files = _files()
        return cls(sizes(files), transport_comparisons(files), message_text_classifications(files))

    def over(self) -> list[Size]:
        return sorted((s for s in self.sizes if s.over), key=lambda s: (-s.lines / LIMITS[s.kind], s.name))

    def largest(self, kind: str) -> Size:
        return max((s for s in self.sizes if s.kind == kind), key=lambda s: s.lines)

    def transport_outside(self) -> list[Site]:
        return [s for s in self.transport if s.path not in TRANSPORT_REGISTRY_MODULES]

    def problems(self) -> list[str]:
        out = []
        over = {s.name: s for s in self.over()}
        for name, s in over.items():
            if name not in ALLOWED_OVER:
                out.append(f"{s.kind} {name} (line {s.line}): {s.lines} lines, over the limit of {LIMITS[s.kind]}; "
                           f"shrink it, or list it in tests/shape.py ALLOWED_OVER with the reason")
        for name in sorted(set(ALLOWED_OVER) - set(over)):
            now = next((s for s in self.sizes if s.name == name), None)
            state = "gone" if now is None else f"{now.lines} lines, within the limit of {LIMITS[now.kind]}"
            out.append(f"stale ALLOWED_OVER entry {name} ({state}): remove it from tests/shape.py")
        per_module: dict[str, int] = {}
        for s in self.transport_outside():
            per_module[s.path] = per_module.get(s.path, 0) + 1
        for path in sorted(set(per_module) | set(TRANSPORT_COMPARISONS_KNOWN)):
            n, known = per_module.get(path, 0), TRANSPORT_COMPARISONS_KNOWN.get(path, 0)
            if n > known:
                out.append(f"{path}: {n} transport-name comparison(s), {known} known: ask the transport's object "
                           f"(or its registry) instead of comparing its name")
            elif n < known:
                out.append(f"{path}: {n} transport-name comparison(s), TRANSPORT_COMPARISONS_KNOWN says {known}: "
                           f"lower it in tests/shape.py")
        scopes = {s.scope for s in self.message_text}
        out.extend(f"{s} (in {s.scope}): control flow on an error's message text; raise a type or give it a `kind`"
                   for s in self.message_text if s.scope not in MESSAGE_TEXT_ALLOWED)
        out.extend(f"stale MESSAGE_TEXT_ALLOWED entry {name}: no message-text classification left; remove it from "
                   f"tests/shape.py" for name in sorted(set(MESSAGE_TEXT_ALLOWED) - scopes))
        return out

    def table(self) -> str:
        def where(s: Size) -> str:
            path, _, qual = s.name.partition("::")
            return f"{path}:{s.line} {qual}" if qual else path

        big_c, big_f = self.largest("class"), self.largest("function")
        over_mod = [s for s in self.over() if s.kind == "module"]
        rows = [
            ("modules over %d lines" % LIMITS["module"], len(over_mod), ", ".join(s.name for s in over_mod)),
            ("largest class", big_c.lines, where(big_c)),
            ("longest function", big_f.lines, where(big_f)),
            ("transport-name comparisons", len(self.transport_outside()),
             f"outside {sorted(TRANSPORT_REGISTRY_MODULES) or 'any registry'}; {len(self.transport)} in all"),
            ("message-text classifications", len(self.message_text),
             f"in {len({s.scope for s in self.message_text})} function(s)"),
        ]
        lines = [f"{'measure':<30} {'value':>6}  where"] + [f"{a:<30} {b:>6}  {c}" for a, b, c in rows]
        over = self.over()
        if over:
            lines.append(f"over the limits (module {LIMITS['module']}, class {LIMITS['class']}, "
                         f"function {LIMITS['function']} lines):")
            for s in over:
                why = ALLOWED_OVER.get(s.name)
                lines.append(f"  {s.kind:<8} {s.lines:>5}  {where(s):<60} "
                             f"{'allowed: ' + why if why else 'NOT ALLOWED'}")
        if self.transport:
            lines.append("transport-name comparisons:")
            lines.extend(f"  {s}" + ("  (registry)" if s.path in TRANSPORT_REGISTRY_MODULES else "")
                         for s in self.transport)
        if self.message_text:
            lines.append("message-text classifications:")
            lines.extend(f"  {s}" + ("" if s.scope in MESSAGE_TEXT_ALLOWED else "  NOT ALLOWED")
                         for s in self.message_text)
        return "\n".join(lines)
