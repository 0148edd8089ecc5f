"""wrapt-based wrapping that can be undone exactly.

Every patch wraps through :class:`Wrapper`. It remembers what it replaced and restores an attribute only
if the attribute still is *our* wrapt proxy (so reverting after someone else re-wrapped does not clobber
their wrapper; we log instead). Wrapping the same target twice from one owner is a no-op, which makes
apply idempotent; two *different* owners wrapping one target is refused, so no two patches wrap the same
function (shared hooks live in :mod:`vllm_rlpatch.hooks`).
"""

from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable

import wrapt

from vllm_rlpatch._postimport import when_imported

logger = logging.getLogger("vllm.rlpatch")

_MARK = "_self_rlpatch_owner"  # `_self_` attributes live on the wrapt proxy, not the wrapped function


class WrapCollision(RuntimeError):
    pass


@dataclass
class _Record:
    parent: Any
    attr: str
    original: Any  # the raw attribute from parent.__dict__ (keeps staticmethod/classmethod descriptors)
    proxy: Any


_ACTIVE: dict[tuple[int, str], _Record] = {}


def resolve(path: str) -> tuple[Any, str, Any]:
    """``"pkg.mod:Cls.attr"`` -> (parent object, attribute name, current value). Imports the module."""
    module_name, _, qual = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    parts = qual.split(".")
    for p in parts[:-1]:
        obj = getattr(obj, p)
    return obj, parts[-1], getattr(obj, parts[-1])


def target_exists(path: str) -> bool:
    try:
        resolve(path)
        return True
    except Exception:  # ImportError, AttributeError, or a module that fails to import (NameError, ...)
        return False


# wrapt 2's FunctionWrapper derives from its C ObjectProxy, which `wrapt.ObjectProxy` no longer is.
_PROXY_TYPES = tuple({wrapt.FunctionWrapper, wrapt.ObjectProxy, getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)})


def is_proxy(value: Any) -> bool:
    return isinstance(value, _PROXY_TYPES)


def owner_of(value: Any) -> str | None:
    return getattr(value, _MARK, None) if is_proxy(value) else None


def wrap(path: str, wrapper: Callable[..., Any], owner: str) -> bool:
    """Wrap ``path`` with ``wrapper(wrapped, instance, args, kwargs)``. Returns False if already ours."""
    parent, attr, _ = resolve(path)
    raw = parent.__dict__[attr] if isinstance(parent, type) and attr in parent.__dict__ else getattr(parent, attr)
    existing = owner_of(raw)
    if existing == owner:
        return False
    if existing is not None:
        raise WrapCollision(f"{path} is already wrapped by {existing!r}; {owner!r} must use the shared hook")
    wrapt.wrap_function_wrapper(parent, attr, wrapper)
    proxy = parent.__dict__[attr] if isinstance(parent, type) else getattr(parent, attr)
    setattr(proxy, _MARK, owner)
    _ACTIVE[(id(parent), attr)] = _Record(parent, attr, raw, proxy)
    logger.debug("vllm-rlpatch: wrapped %s (owner %s)", path, owner)
    return True


def unwrap(path: str, owner: str) -> bool:
    """Restore ``path`` if it is our proxy. Returns False if there was nothing of ours to undo."""
    try:
        parent, attr, _ = resolve(path)
    except (ImportError, AttributeError):
        return False
    rec = _ACTIVE.get((id(parent), attr))
    raw = parent.__dict__.get(attr) if isinstance(parent, type) else getattr(parent, attr, None)
    if rec is None or owner_of(raw) != owner:
        return False
    if raw is not rec.proxy:
        logger.warning("vllm-rlpatch: %s was re-wrapped by someone else; leaving it in place", path)
        return False
    setattr(parent, attr, rec.original)
    del _ACTIVE[(id(parent), attr)]
    logger.debug("vllm-rlpatch: unwrapped %s (owner %s)", path, owner)
    return True


def is_wrapped(path: str, owner: str | None = None) -> bool:
    try:
        parent, attr, _ = resolve(path)
    except (ImportError, AttributeError):
        return False
    raw = parent.__dict__.get(attr) if isinstance(parent, type) else getattr(parent, attr, None)
    o = owner_of(raw)
    return o is not None and (owner is None or o == owner)


def wrap_instance(obj: Any, attr: str, wrapper: Callable[..., Any], owner: str) -> bool:
    """Wrap one object's method (an instance attribute shadowing the class's). Returns False if it is
    already a proxy (ours or someone's)."""
    if is_proxy(obj.__dict__.get(attr)):
        return False
    wrapt.wrap_function_wrapper(obj, attr, wrapper)
    setattr(obj.__dict__[attr], _MARK, owner)
    return True


def unwrap_instance(obj: Any, attr: str, owner: str) -> bool:
    """Undo :func:`wrap_instance` (the class's method shows through again)."""
    if owner_of(obj.__dict__.get(attr)) != owner:
        return False
    del obj.__dict__[attr]
    return True


class LateWraps:
    """Targets of one module, wrapped when vLLM imports it (at once if it already has): the one way to wrap
    late, for patches and hooks whose target module the plugin must not import itself.

    ``targets`` is a ``{target: wrapper}`` dict or a function returning one, called when the module is there
    (so it can choose targets by what this vLLM has). A missing target is reported to ``on_missing``; with
    ``all_or_none`` nothing is wrapped then. ``apply``/``revert`` are idempotent; ``revert`` before the module
    is imported means it is never wrapped."""

    def __init__(self, module: str, targets: "dict[str, Callable[..., Any]] | Callable[[], dict[str, Callable[..., Any]]]",
                 owner: str, on_missing: Callable[[list[str]], None] | None = None, all_or_none: bool = False) -> None:
        self.module, self.targets, self.owner = module, targets, owner
        self.on_missing, self.all_or_none = on_missing, all_or_none
        self.active = False
        self._wrapped: list[str] = []

    def _install(self, module: Any = None) -> None:
        if not self.active:
            return
        chosen = self.targets() if callable(self.targets) else self.targets
        missing = [t for t in chosen if not target_exists(t)]
        if missing and self.on_missing is not None:
            self.on_missing(missing)
        if missing and self.all_or_none:
            return
        for t, wrapper in chosen.items():
            if t not in missing:
                wrap(t, wrapper, self.owner)
                if t not in self._wrapped:
                    self._wrapped.append(t)

    def apply(self) -> None:
        if not self.active:
            self.active = True
            when_imported(self.module, self._install)

    def revert(self) -> None:
        self.active = False
        # what this instance wrapped, and (a wrap made before a reset of `_wrapped`) fixed targets whose module
        # is imported; a module never imported holds nothing of ours and is not imported to find that out
        fixed = [] if callable(self.targets) else [t for t in self.targets if t.partition(":")[0] in sys.modules]
        for t in dict.fromkeys([*self._wrapped, *fixed]):
            unwrap(t, self.owner)
        self._wrapped.clear()


class LazyWrap(LateWraps):
    """One late target (see :class:`LateWraps`)."""

    def __init__(self, target: str, wrapper: Callable[..., Any], owner: str,
                 on_missing: Callable[[list[str]], None] | None = None) -> None:
        super().__init__(target.partition(":")[0], {target: wrapper}, owner, on_missing)
        self.target, self.wrapper = target, wrapper

    def apply(self) -> None:
        self.module, self.targets = self.target.partition(":")[0], {self.target: self.wrapper}
        super().apply()
