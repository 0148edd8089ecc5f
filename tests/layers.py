"""Static checks of the package's shape (no vLLM needed): the function-local imports that remain, private names
used across modules, import cycles (``--cycles``, needs grimp), and the measures of tests/shape.py (sizes,
transport-name comparisons, message-text classifications). Used by tests/source_level/test_layers.py and by
.ci/run (``python tests/layers.py --cycles``); ``--shape`` prints the measures only and always exits 0."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import shape

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = "vllm_rlpatch"
# Hard dependencies (pyproject.toml): importing them is never a reason to defer an import.
CHEAP_EXTERNAL = {"wrapt", "packaging", "zmq"}
# Imported by the .pth start-up hook in every interpreter: they defer even the hard dependencies (~4 ms budget).
STARTUP_PATH = {PKG, f"{PKG}._startup", f"{PKG}._postimport"}


def modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / PKG).rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _is_stdlib(name: str) -> bool:
    return name in sys.stdlib_module_names or name == "__future__"


def _targets(node: ast.AST, current: str, mods: dict[str, Path]) -> list[str]:
    """Modules an import statement imports (internal as dotted names; external as their top-level name)."""
    out = []
    if isinstance(node, ast.Import):
        for a in node.names:
            out.append(a.name if a.name.startswith(PKG) else a.name.split(".")[0])
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = current.split(".")
            if mods[current].name != "__init__.py":
                base = base[:-1]
            base = base[:len(base) - node.level + 1]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        if not mod.startswith(PKG):
            return [mod.split(".")[0]]
        for a in node.names:
            out.append(f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod)
    return out


def _scan(mods: dict[str, Path]):
    top: dict[str, set[str]] = {}
    local: dict[str, list[tuple[int, str]]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        top[name], local[name] = set(), []
        body_ids = set()
        for stmt in tree.body:  # module level, including module-level if/try blocks
            for n in ast.walk(stmt):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                    break
            stack = [stmt]
            while stack:
                n = stack.pop()
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                    continue
                if isinstance(n, (ast.Import, ast.ImportFrom)):
                    body_ids.add(id(n))
                    top[name].update(_targets(n, name, mods))
                stack.extend(ast.iter_child_nodes(n))
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in body_ids:
                for t in _targets(n, name, mods):
                    local[name].append((n.lineno, t))
    return top, local


def _closure(name: str, top: dict[str, set[str]], mods: dict[str, Path], cheap=CHEAP_EXTERNAL) -> set[str]:
    """External packages a module imports when it is imported (its own and its internal imports', and
    its parent packages')."""
    seen, ext, todo = set(), set(), [name]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # parent packages run first
        for t in top.get(m, ()):
            if t in mods:
                todo.append(t)
            elif not t.startswith(PKG):
                ext.add(t)
    return {e for e in ext if not _is_stdlib(e) and e not in cheap}


def needless_local_imports() -> list[str]:
    """Function-local imports of our own modules that defer nothing (no vLLM, torch or optional dependency
    the importing module does not already import)."""
    mods = modules()
    top, local = _scan(mods)
    out = []
    for name, items in sorted(local.items()):
        cheap = set() if name in STARTUP_PATH else CHEAP_EXTERNAL
        mine = _closure(name, top, mods, cheap)
        for line, t in items:
            if t not in mods:
                continue
            defers = _closure(t, top, mods, cheap) - mine
            if not defers:
                out.append(f"{mods[name].relative_to(SRC)}:{line}: imports {t} inside a function, deferring nothing")
    return out


def private_names_across_modules() -> list[str]:
    mods = modules()
    out = []
    for name, path in sorted(mods.items()):
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PKG):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in mods:
                        aliases[a.asname or a.name] = full
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        out.append(f"{path.relative_to(SRC)}:{node.lineno}: imports {node.module}.{a.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                out.append(f"{path.relative_to(SRC)}:{node.lineno}: uses {aliases[node.value.id]}.{node.attr}")
    return out


def import_cycles() -> list[str]:
    """Cycles between modules of the package, function-local imports included (needs grimp)."""
    import grimp

    sys.path.insert(0, str(SRC))
    graph = grimp.build_graph(PKG)
    adj = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[str] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append("import cycle: " + " -> ".join(sorted(comp)))

    sys.setrecursionlimit(10000)
    for m in sorted(adj):
        if m not in index:
            visit(m)
    return out


def main(argv: list[str]) -> int:
    measures = shape.Measures.read()
    print("=== package shape: sizes, transport-name comparisons, message-text classifications (tests/shape.py)")
    print(measures.table())
    if "--shape" in argv:
        return 0
    checks = {
        "function-local imports deferring nothing": needless_local_imports(),
        "private names used across modules": private_names_across_modules(),
        "shape: over a limit unlisted, stale lists, transport names, message text": measures.problems(),
    }
    if "--cycles" in argv:
        checks["import cycles"] = import_cycles()
    for name, found in checks.items():
        print(f"{name}: {len(found)}")
        for p in found:
            print(f"  {p}")
    problems = sum(len(found) for found in checks.values())
    print(f"{problems} problem(s)" if problems else "package shape: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
