"""Which ``EngineArgs`` fields did the user pass explicitly?

Three entry points build ``EngineArgs``, and each needs its own capture:

* ``vllm.LLM(...)`` and direct ``EngineArgs(...)``: the dataclass ``__init__`` receives exactly the user's
  keyword arguments (``LLM`` forwards ``**kwargs`` plus a few of its own parameters). We wrap
  ``EngineArgs.__init__`` and record the argument names *before* ``__post_init__`` loads the plugins.
* ``AsyncEngineArgs(...)`` / ``AsyncLLM.from_engine_args``: a dataclass subclass with its own generated
  ``__init__``; wrapped the same way.
* ``vllm serve`` (the CLI): ``from_cli_args`` passes *every* field, so ``__init__`` would call all of them
  explicit. ``add_cli_args`` is wrapped to give the fields in :data:`CLI_TRACKED` a :class:`CliDefault`
  marker as their argparse default; ``from_cli_args`` then knows which ones the command line set, swaps
  the markers for the stock values and records the result.

The wrappers are installed by the ``.pth`` start-up hook (:mod:`vllm_rlpatch._startup`) the moment
``vllm.engine.arg_utils`` is imported, and again (idempotently) by the plugin for environments where the
``.pth`` file is not active; in that case the first ``EngineArgs`` of the process has no record and
:func:`is_explicit` falls back to comparing with the stock default (reported by ``doctor``).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import threading
import weakref
from typing import Any

from vllm_rlpatch import _wrapping

OWNER = "explicit_args"
MODULE = "vllm.engine.arg_utils"

# Fields whose stock default is not None, so "unset" cannot be read off the parsed CLI namespace.
CLI_TRACKED = ("logprobs_mode", "generation_config", "worker_extension_cls", "kv_cache_memory_bytes")


@dataclasses.dataclass(frozen=True)
class Record:
    explicit: frozenset[str]
    source: str  # "init" (complete: every explicit name is known) or "cli" (complete for CLI_TRACKED only)
    tracked: frozenset[str] = frozenset()


_RECORDS: dict[int, Record] = {}
_LOCK = threading.Lock()


class CliDefault:
    """An argparse default that marks "the command line did not set this" (argparse leaves non-str
    defaults alone). Compares, hashes, prints and pickles like the stock value it stands for."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)

    def __str__(self) -> str:
        return str(self.value)

    def __eq__(self, other: Any) -> bool:
        return self.value == (other.value if isinstance(other, CliDefault) else other)

    def __hash__(self) -> int:
        return hash(self.value)

    def __bool__(self) -> bool:
        return bool(self.value)

    def __reduce__(self):
        return (CliDefault, (self.value,))


def _remember(instance: Any, rec: Record) -> None:
    key = id(instance)
    with _LOCK:
        _RECORDS[key] = rec
    try:
        weakref.finalize(instance, _RECORDS.pop, key, None)
    except TypeError:  # not weak-referenceable; the record lives as long as the process
        pass


def record_for(instance: Any) -> Record | None:
    with _LOCK:
        return _RECORDS.get(id(instance))


class _Guard(threading.local):
    depth = 0  # > 0 while from_cli_args runs: its __init__ call passes every field


_CLI = _Guard()


def _init_wrapper(wrapped, instance, args, kwargs):
    if instance is not None and _CLI.depth == 0 and record_for(instance) is None:
        names = set(kwargs)
        if args:
            params = [p for p in inspect.signature(wrapped).parameters if p != "self"]
            names.update(params[: len(args)])
        _remember(instance, Record(frozenset(names), "init"))
    return wrapped(*args, **kwargs)


def _add_cli_args_wrapper(wrapped, instance, args, kwargs):
    parser = wrapped(*args, **kwargs)
    target = parser if isinstance(parser, argparse.ArgumentParser) else (args[0] if args else None)
    if isinstance(target, argparse.ArgumentParser):
        dests = {a.dest: a for a in target._actions}
        marks = {}
        for name in CLI_TRACKED:
            action = dests.get(name)
            if action is not None and not isinstance(action.default, CliDefault):
                marks[name] = CliDefault(action.default)
        if marks:
            target.set_defaults(**marks)
    return parser


def _from_cli_args_wrapper(wrapped, instance, args, kwargs):
    ns = args[0] if args else kwargs.get("args")
    if not isinstance(ns, argparse.Namespace):
        return wrapped(*args, **kwargs)
    clean = argparse.Namespace(**vars(ns))
    unset: set[str] = set()
    for name, value in vars(ns).items():
        if isinstance(value, CliDefault):
            setattr(clean, name, value.value)
            unset.add(name)
    tracked = frozenset(n for n in CLI_TRACKED if hasattr(ns, n))
    new_args = (clean, *args[1:]) if args else ()
    new_kwargs = dict(kwargs)
    if not args:
        new_kwargs["args"] = clean
    # The record must exist before __post_init__ (which loads the plugin), so build it up front and
    # attach it from inside __init__ via a thread-local.
    rec = Record(frozenset(tracked - unset), "cli", tracked)
    _CLI.depth += 1
    _PENDING.rec = rec
    try:
        result = wrapped(*new_args, **new_kwargs)
    finally:
        _CLI.depth -= 1
        _PENDING.rec = None
    if record_for(result) is None:
        _remember(result, rec)
    return result


class _Pending(threading.local):
    rec: Record | None = None


_PENDING = _Pending()


def _cli_init_wrapper(wrapped, instance, args, kwargs):
    rec = _PENDING.rec
    if instance is not None and rec is not None and record_for(instance) is None:
        _remember(instance, rec)
    return _init_wrapper(wrapped, instance, args, kwargs)


_WRAPPERS = {
    f"{MODULE}:EngineArgs.__init__": lambda: _cli_init_wrapper,
    f"{MODULE}:AsyncEngineArgs.__init__": lambda: _cli_init_wrapper,
    f"{MODULE}:EngineArgs.add_cli_args": lambda: _add_cli_args_wrapper,
    f"{MODULE}:EngineArgs.from_cli_args": lambda: _from_cli_args_wrapper,
}
TARGETS = tuple(_WRAPPERS)


def install(module: Any = None) -> None:
    """Wrap the four capture points (idempotent)."""
    for target, wrapper in _WRAPPERS.items():
        _wrapping.wrap(target, wrapper(), OWNER)


def uninstall() -> None:
    for target in TARGETS:
        _wrapping.unwrap(target, OWNER)


def active() -> bool:
    return _wrapping.is_wrapped(f"{MODULE}:EngineArgs.__init__", OWNER)


def stock_default(engine_args_cls: type, name: str) -> Any:
    for f in dataclasses.fields(engine_args_cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                return f.default_factory()  # type: ignore[misc]
    return None


def is_explicit(engine_args: Any, name: str) -> tuple[bool, str]:
    """(explicit?, how we know). Falls back to "differs from the stock default" without a record."""
    rec = record_for(engine_args)
    if rec is not None and (rec.source == "init" or name in rec.tracked):
        return name in rec.explicit, f"captured at {rec.source}"
    value = getattr(engine_args, name, None)
    default = stock_default(type(engine_args), name)
    why = "CLI value" if rec is not None else "no capture record: explicit-argument capture inactive"
    if default is None:
        return value is not None, f"inferred (not None; {why})"
    return value != default, f"inferred (differs from the stock default; {why})"
