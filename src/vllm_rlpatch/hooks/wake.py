"""The one hook around the workers' ``wake_up``: checks before it, bookkeeping after it.

Several patches care about a worker waking up (``refit_guard`` tracks whether the weights are awake;
``wake_order_guard`` refuses a level-2 wake of the KV cache before the weights). Patches never wrap
``wake_up`` themselves (two owners cannot wrap one target): they register ``before(worker, tags)`` and/or
``after(worker, tags)`` callbacks here. A ``before`` callback may raise to refuse the call; nothing has been
mapped or copied at that point.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from typing import Any, Callable

from vllm_rlpatch import _wrapping

OWNER = "wake_hook"
TARGETS = ("vllm.v1.worker.gpu_worker:Worker.wake_up", "vllm.v1.worker.cpu_worker:CPUWorker.wake_up")

Callback = Callable[[Any, Any], None]
_LOCK = threading.RLock()
_BEFORE: dict[str, Callback] = {}
_AFTER: dict[str, Callback] = {}


def tags_of(wrapped, args, kwargs):
    if "tags" in kwargs:
        return kwargs["tags"]
    if args:
        return args[0]
    try:
        return inspect.signature(wrapped).parameters["tags"].default
    except (KeyError, ValueError, TypeError):
        return None


def _wrapper(wrapped, instance, args, kwargs):
    tags = tags_of(wrapped, args, kwargs)
    with _LOCK:
        before, after = list(_BEFORE.values()), list(_AFTER.values())
    for fn in before:
        fn(instance, tags)
    result = wrapped(*args, **kwargs)
    for fn in after:
        fn(instance, tags)
    return result


_LAZY = [_wrapping.LazyWrap(t, _wrapper, OWNER) for t in TARGETS]


def add(name: str, *, before: Callback | None = None, after: Callback | None = None) -> None:
    with _LOCK:
        if before is not None:
            _BEFORE[name] = before
        if after is not None:
            _AFTER[name] = after
        for lz in _LAZY:
            lz.apply()


def remove(name: str) -> None:
    with _LOCK:
        _BEFORE.pop(name, None)
        _AFTER.pop(name, None)
        if not _BEFORE and not _AFTER:
            for lz in _LAZY:
                lz.revert()


# Workers whose weights a level-2 sleep discarded: after waking, their weight memory holds no valid weights
# until a complete update lands (nothing to roll back to). Set by whoever wraps ``sleep`` (refit_guard),
# read by the refit transaction, cleared by a complete update.
_DISCARDED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def set_discarded(worker: Any, discarded: bool) -> None:
    try:
        (_DISCARDED.add if discarded else _DISCARDED.discard)(worker)
    except TypeError:
        pass


def weights_discarded(worker: Any) -> bool:
    try:
        return worker in _DISCARDED
    except TypeError:
        return False


def registered() -> dict[str, list[str]]:
    with _LOCK:
        return {"before": list(_BEFORE), "after": list(_AFTER)}
