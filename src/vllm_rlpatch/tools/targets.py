"""Every vLLM attribute the plugin wraps, and a source-level resolver for vLLM trees we cannot import.

The newest vLLM release is a CUDA-only wheel; CI checks at source level (AST) that each target still
exists in its Python tree, so API drift shows up before a user hits it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from vllm_rlpatch.hooks import config, explicit, weights
from vllm_rlpatch.patches import ALL_PATCHES


def all_targets(for_version: str | None = None) -> list[str]:
    """Patch spec targets plus the shared hooks' own targets (``module:Qual.name``), deduplicated.

    ``for_version``: only the targets a vLLM of that version would wrap (patches retired there by
    ``fixed_in`` are left out: upstream's fix may have removed what they wrap)."""
    from packaging.version import Version

    specs = [s for s in ALL_PATCHES
             if for_version is None or s.fixed_in is None or Version(for_version) < Version(s.fixed_in)]
    out: list[str] = []
    for t in [*(t for s in specs for t in (*s.targets, *s.lazy_targets)), config.TARGET, *weights.FRONTEND_TARGETS,
              *weights.WORKER_TARGETS, *explicit.TARGETS]:
        if t not in out:
            out.append(t)
    return out


def _module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for d in cls.decorator_list:
        node = d.func if isinstance(d, ast.Call) else d
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
        if name in ("dataclass", "config"):
            return True
    return False


def _class_defines(cls: ast.ClassDef, attr: str) -> bool:
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == attr:
            return True
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == attr:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == attr for t in node.targets):
            return True
    return attr == "__init__" and _is_dataclass(cls)


def resolve_in_source(root: Path, target: str) -> tuple[bool, str]:
    """Does ``module:Class.attr`` exist in the vLLM source tree at ``root`` (the dir holding ``vllm/``)?"""
    module, _, qual = target.partition(":")
    path = _module_file(root, module)
    if path is None:
        return False, f"module {module} not found"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    parts = qual.split(".")
    top = parts[0]
    if len(parts) == 1:
        names = set(classes) | {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        return (top in names), f"{top} {'found' if top in names else 'missing'} in {path.name}"
    cls = classes.get(top)
    if cls is None:
        return False, f"class {top} missing in {path.name}"
    attr = parts[1]
    seen = set()
    while cls is not None and cls.name not in seen:
        seen.add(cls.name)
        if _class_defines(cls, attr):
            return True, f"{cls.name}.{attr} found in {path.name}"
        # follow a base class defined in the same module (e.g. AsyncEngineArgs(EngineArgs))
        bases = [b.id for b in cls.bases if isinstance(b, ast.Name)]
        cls = next((classes[b] for b in bases if b in classes), None)
    return False, f"{top}.{attr} missing in {path.name}"
