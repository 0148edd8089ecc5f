"""The weight-update event and the per-engine weight-version counter.

Every update path the plugin can see bumps the version of *its* engine once and notifies listeners
(:func:`on_weight_update`); later patches react to it (prefix-cache policy, refit bookkeeping).

Where the paths are seen:

* Process 0 (the engine front end): ``LLMEngine.collective_rpc`` and ``AsyncLLM.collective_rpc``, which
  ``LLM.collective_rpc``, ``LLM.update_weights``/``finish_weight_update`` and the RL HTTP routes all go
  through. An update is ``reload_weights``; on vLLM 0.25+ ``finish_weight_update`` (the end of a
  start/update/finish session); on 0.20 each ``update_weights`` call (a whole layerwise reload per call).
* Each worker: ``Worker.reload_weights``, the native update methods, and ``load_weights`` on the worker's
  model (trainers call it directly through a worker extension). Nested paths (``reload_weights`` calls
  ``model.load_weights``) count once: only the outermost call fires.

The counter is per process and per engine object; the worker-side value can be read through the worker
extension (``collective_rpc("rlpatch_weight_version")``). An update that raises fires nothing: the event
means "new weights are in place".
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

from vllm_rlpatch import _wrapping, compat
from vllm_rlpatch.hooks import mixed, workerctx

logger = logging.getLogger("vllm.rlpatch")

OWNER = "weights_hook"


@dataclasses.dataclass(frozen=True)
class WeightUpdateEvent:
    engine_key: str
    version: int
    source: str
    side: str  # "frontend" | "worker"
    pid: int
    time: float


_LOCK = threading.RLock()
_VERSIONS: dict[str, int] = {}
_LISTENERS: list[Callable[[WeightUpdateEvent, Any], None]] = []
_KEYS: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_counter = 0


class _Depth(threading.local):
    n: int = 0


_DEPTH = _Depth()


@contextlib.contextmanager
def suppressed():
    """Weight updates inside this block fire no event of their own (the caller fires one when it is done)."""
    _DEPTH.n += 1
    try:
        yield
    finally:
        _DEPTH.n -= 1


# A worker-side router for direct ``model.load_weights`` calls (set by the ``refit_guard`` patch):
# ``router(wrapped, model, worker, args, kwargs) -> (result, fire_now: bool)``.
_LOAD_ROUTER: Callable[..., Any] | None = None


def set_load_router(router: Callable[..., Any] | None) -> None:
    global _LOAD_ROUTER
    _LOAD_ROUTER = router


# Context factories entered around the outermost worker update method (``reload_weights``, the native
# update API): ``factory(source, worker, args, kwargs) -> context manager`` (the refit guard's strictness).
_SCOPES: list[Callable[..., Any]] = []
# Called with a worker before its weight version is read (finish a pending direct-load session).
_SETTLERS: list[Callable[[Any, bool, bool], list[str] | None]] = []


def add_scope(factory: Callable[..., Any]) -> None:
    if factory not in _SCOPES:
        _SCOPES.append(factory)


def remove_scope(factory: Callable[..., Any]) -> None:
    if factory in _SCOPES:
        _SCOPES.remove(factory)


def add_settler(fn: Callable[[Any, bool, bool], list[str] | None]) -> None:
    if fn not in _SETTLERS:
        _SETTLERS.append(fn)


def remove_settler(fn: Callable[[Any, bool, bool], list[str] | None]) -> None:
    if fn in _SETTLERS:
        _SETTLERS.remove(fn)


# Listeners of a failed front-end collective_rpc: (engine, method, exception, the workers' mixed state or
# None). The state is asked for as data (the workers' STATE_RPC), never parsed out of the exception's text.
_RPC_ERROR_LISTENERS: list[Callable[[Any, str, BaseException, Any], None]] = []


def add_rpc_error_listener(fn: Callable[[Any, str, BaseException, Any], None]) -> None:
    if fn not in _RPC_ERROR_LISTENERS:
        _RPC_ERROR_LISTENERS.append(fn)


def remove_rpc_error_listener(fn: Callable[[Any, str, BaseException, Any], None]) -> None:
    if fn in _RPC_ERROR_LISTENERS:
        _RPC_ERROR_LISTENERS.remove(fn)


def _notify(engine: Any, method: str, exc: BaseException, state: Any) -> None:
    for fn in list(_RPC_ERROR_LISTENERS):
        try:
            fn(engine, method, exc, state)
        except Exception:
            logger.debug("vllm-rlpatch: rpc error listener failed", exc_info=True)


def _state_of(results: Any):
    return mixed.from_results(results)


def _rpc_failed(engine: Any, method: str, exc: BaseException) -> None:
    if not _RPC_ERROR_LISTENERS or method == mixed.STATE_RPC:
        return
    try:
        state = _state_of(engine.collective_rpc(mixed.STATE_RPC))
    except Exception:  # no rlpatch worker extension, or a dead engine: nothing more to learn
        state = None
    _notify(engine, method, exc, state)


async def _rpc_failed_async(engine: Any, method: str, exc: BaseException) -> None:
    if not _RPC_ERROR_LISTENERS or method == mixed.STATE_RPC:
        return
    try:
        state = _state_of(await engine.collective_rpc(mixed.STATE_RPC))
    except Exception:
        state = None
    _notify(engine, method, exc, state)


def settle(worker: Any, raise_mixed: bool = True, keep_partial: bool = False) -> list[str]:
    """Finish whatever the plugin left pending in ``worker`` (may raise: the weights are mixed). With
    ``keep_partial`` (the end of an RPC) a fused layer whose parts are still arriving stays open; returns the
    layers left half-loaded."""
    pending: list[str] = []
    for fn in list(_SETTLERS):
        pending += fn(worker, raise_mixed, keep_partial) or []
    return pending


def engine_key(engine: Any) -> str:
    """A stable key per engine object (LLMEngine, AsyncLLM, Worker); ``LLM`` maps to its ``llm_engine``."""
    engine = getattr(engine, "llm_engine", engine)
    global _counter
    with _LOCK:
        try:
            key = _KEYS.get(engine)
        except TypeError:
            key = None
        if key is None:
            _counter += 1
            key = f"{type(engine).__name__}#{_counter}@{os.getpid()}"
            try:
                _KEYS[engine] = key
            except TypeError:
                pass
        return key


def weight_version(engine: Any) -> int:
    """Number of completed weight updates this process has seen for ``engine`` (0 = as loaded)."""
    with _LOCK:
        return _VERSIONS.get(engine_key(engine), 0)


def on_weight_update(callback: Callable[[WeightUpdateEvent, Any], None]) -> Callable[[], None]:
    """Call ``callback(event, engine)`` after every weight update. Returns an unsubscribe function."""
    with _LOCK:
        _LISTENERS.append(callback)

    def unsubscribe() -> None:
        with _LOCK:
            if callback in _LISTENERS:
                _LISTENERS.remove(callback)

    return unsubscribe


def fire(engine: Any, source: str, side: str, version: int | None = None,
         log_level: int = logging.INFO) -> WeightUpdateEvent:
    """Bump ``engine``'s version (to ``version`` if given and higher) and notify listeners (also used by the
    refit API, which logs the update once in the caller and in the engine core: ``log_level`` DEBUG here)."""
    key = engine_key(engine)
    with _LOCK:
        nxt = _VERSIONS.get(key, 0) + 1
        _VERSIONS[key] = max(nxt, int(version)) if version is not None else nxt
        ev = WeightUpdateEvent(key, _VERSIONS[key], source, side, os.getpid(), time.time())
        listeners = list(_LISTENERS)
    logger.log(log_level, "vllm-rlpatch: weight update #%d on %s via %s", ev.version, key, source)
    for cb in listeners:
        try:
            cb(ev, engine)
        except Exception:
            logger.exception("vllm-rlpatch: weight-update listener %r raised", cb)
    return ev


# ---------------------------------------------------------------- process 0 (engine front end)
def _frontend_update_methods() -> frozenset[str]:
    from vllm.entrypoints.llm import LLM

    if hasattr(LLM, "start_weight_update"):  # 0.25+: an update is a start/update/finish session
        return frozenset({"reload_weights", "finish_weight_update"})
    return frozenset({"reload_weights", "update_weights"})  # 0.20: each update_weights is complete


_UPDATE_METHODS: frozenset[str] | None = None  # decided on first RPC (importing LLM early costs time)


def _is_update(args, kwargs) -> str | None:
    global _UPDATE_METHODS
    method = args[0] if args else kwargs.get("method")
    if not isinstance(method, str):
        return None
    if _UPDATE_METHODS is None:
        _UPDATE_METHODS = _frontend_update_methods()
    return method if method in _UPDATE_METHODS else None


def _rpc_method(args, kwargs) -> str:
    method = args[0] if args else kwargs.get("method")
    return method if isinstance(method, str) else "?"


def _sync_rpc_wrapper(wrapped, instance, args, kwargs):
    method = _is_update(args, kwargs)
    try:
        result = wrapped(*args, **kwargs)
    except Exception as e:
        _rpc_failed(instance, _rpc_method(args, kwargs), e)
        raise
    if method is not None:
        fire(instance, f"collective_rpc:{method}", "frontend")
    return result


def _async_rpc_wrapper(wrapped, instance, args, kwargs):
    method = _is_update(args, kwargs)
    coro = wrapped(*args, **kwargs)
    if not inspect.isawaitable(coro):
        return coro
    if method is None:
        if not _RPC_ERROR_LISTENERS:
            return coro

        async def _watch():
            try:
                return await coro
            except Exception as e:
                await _rpc_failed_async(instance, _rpc_method(args, kwargs), e)
                raise

        return _watch()

    async def _run():
        try:
            result = await coro
        except Exception as e:
            await _rpc_failed_async(instance, method, e)
            raise
        fire(instance, f"collective_rpc:{method}", "frontend")
        return result

    return _run()


# ---------------------------------------------------------------- workers
def _worker_update_wrapper(source: str):
    def wrapper(wrapped, instance, args, kwargs):
        outermost = _DEPTH.n == 0
        _DEPTH.n += 1
        try:
            with contextlib.ExitStack() as stack:
                if outermost:
                    for factory in list(_SCOPES):
                        stack.enter_context(factory(source, instance, args, kwargs))
                result = wrapped(*args, **kwargs)
        finally:
            _DEPTH.n -= 1
        if _DEPTH.n == 0:
            fire(instance, source, "worker")
        return result

    return wrapper


def _model_load_weights_wrapper(worker_ref):
    def wrapper(wrapped, instance, args, kwargs):
        worker = worker_ref()
        router = _LOAD_ROUTER
        fire_now = True
        _DEPTH.n += 1
        try:
            if router is not None and worker is not None and _DEPTH.n == 1:
                result, fire_now = router(wrapped, instance, worker, args, kwargs)
            else:
                result = wrapped(*args, **kwargs)
        finally:
            _DEPTH.n -= 1
        if _DEPTH.n == 0 and worker is not None and fire_now:
            fire(worker, "model.load_weights", "worker")
        return result

    return wrapper


def _wrap_model_of(worker: Any) -> None:
    try:
        model = workerctx.model_of(worker)
    except Exception:
        model = getattr(getattr(worker, "model_runner", None), "model", None)
    if model is None or not hasattr(model, "load_weights"):
        return
    if _wrapping.wrap_instance(model, "load_weights", _model_load_weights_wrapper(weakref.ref(worker)), OWNER):
        _WRAPPED_MODELS.add(model)


_WRAPPED_MODELS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _load_model_wrapper(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    try:
        _wrap_model_of(instance)
    except Exception:
        logger.debug("vllm-rlpatch: could not hook model.load_weights", exc_info=True)
    return result


WORKER = "vllm.v1.worker.gpu_worker:Worker"
FRONTEND_TARGETS = ("vllm.v1.engine.llm_engine:LLMEngine.collective_rpc",
                    "vllm.v1.engine.async_llm:AsyncLLM.collective_rpc")
WORKER_TARGETS = (f"{WORKER}.reload_weights", f"{WORKER}.load_model")


def _worker_targets() -> dict[str, Callable]:
    """Chosen when the worker module is imported: the native update method differs by version."""
    out = {f"{WORKER}.reload_weights": _worker_update_wrapper("reload_weights")}
    for m in compat.worker_update_methods():
        out[f"{WORKER}.{m}"] = _worker_update_wrapper(m)
    out[f"{WORKER}.load_model"] = _load_model_wrapper
    return out


def _missing_worker(targets: list[str]) -> None:
    logger.warning("vllm-rlpatch: weight_events: worker target(s) missing (%s); worker-side weight events "
                   "are off in this process", ", ".join(targets))


def _missing_frontend(targets: list[str]) -> None:
    logger.warning("vllm-rlpatch: weight_events: %s missing; its weight events are off", ", ".join(targets))


_LATE = [
    _wrapping.LateWraps(FRONTEND_TARGETS[0].partition(":")[0], {FRONTEND_TARGETS[0]: _sync_rpc_wrapper}, OWNER,
                        on_missing=_missing_frontend),
    _wrapping.LateWraps(FRONTEND_TARGETS[1].partition(":")[0], {FRONTEND_TARGETS[1]: _async_rpc_wrapper}, OWNER,
                        on_missing=_missing_frontend),
    # the worker module alone costs ~1.7 s to import, in processes that never run a worker
    _wrapping.LateWraps(WORKER.partition(":")[0], _worker_targets, OWNER, on_missing=_missing_worker,
                        all_or_none=True),
]


def install() -> None:
    """Wrap each side when vLLM imports it (at once if it already has): the plugin imports none of these
    modules itself."""
    for late in _LATE:
        late.apply()


def uninstall() -> None:
    for late in _LATE:
        late.revert()
    for model in list(_WRAPPED_MODELS):
        _wrapping.unwrap_instance(model, "load_weights", OWNER)
    _WRAPPED_MODELS.clear()
