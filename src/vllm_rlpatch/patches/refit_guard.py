"""Weight updates that never leave the engine with garbage, stale or mixed weights, whatever the path.

Why:   vLLM 0.20 - 0.32 reload weights layer by layer and stay silent when that goes wrong (measured here on
       real vLLM CPU): a fused qkv/gate_up layer whose parts arrive in separate reload calls is processed
       with the missing part taken from uninitialised memory; a layer that receives nothing keeps its old
       weights with one WARNING; a tied head (``lm_head`` = ``embed_tokens``) is not re-processed, so on
       vLLM 0.32 CPU it keeps computing with the old embedding; a trainer's direct ``model.load_weights``
       (NeMo-RL, verl, OpenRLHF style) crashes on CPU once weights were post-processed
       (``AttributeError: 'Parameter' object has no attribute 'weight_loader'`` on 0.25, a size-0 parameter
       on 0.32) after writing the tensors before the failing one; nothing refuses an update while the
       engine sleeps (writing into offloaded weights).
How:   - every layerwise reload is strict (:mod:`vllm_rlpatch.hooks.layerwise`): a half-loaded layer keeps
         its previous weights, whole, and the update raises; ``reload_weights`` raises when a layer with
         parameters received nothing; tied layers are re-processed from their updated storage;
       - a direct ``model.load_weights`` on a model whose weights were post-processed (CPU, quantized) is
         routed through a layerwise reload session: loads are buffered per layer and each layer is
         processed once complete, across calls and across RPCs (a trainer may send q, k, v separately, one
         per RPC); the session closes when no layer is half-loaded. While a layer waits for its other parts
         the engine core aborts what runs and refuses new requests; a forward pass (in-process loads) or an
         update through another path closes it first, and a layer still half-loaded then keeps its old
         weights (the engine refuses to generate where the rest of the model is new);
       - update RPCs are refused while the engine's weights sleep (engine core: the executor's sleeping
         tags; workers: ``Worker.sleep``/``wake_up`` tracked);
       - after a failed update that left a mix of old and new weights (``direct`` refits, a load that raised
         half-way) the engine refuses requests (front end: a clear error; engine core: aborted) until a
         complete update lands.
Targets: vllm.model_executor.model_loader.reload.layerwise.{finalize_layerwise_processing,_layerwise_process},
       vllm.v1.worker.gpu_worker.Worker.{sleep,execute_model}, vllm.v1.worker.cpu_worker.CPUWorker.sleep,
       both wake_up (through the shared hooks/wake.py), vllm.v1.engine.llm_engine.LLMEngine.add_request,
       vllm.v1.engine.async_llm.AsyncLLM.add_request; the weight hooks (worker update scope, model.load_weights
       router) and the engine-core hook (policy).
Upstream: not reported upstream (silent "Failed to load weights"/"Delayed processing" in layerwise.py; no
       sleep check on update paths: an upstream test expecting a refusal targets a later release).
Remove when: vLLM's layerwise reload raises on incomplete layers and update paths refuse sleeping engines.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from typing import Any

from vllm_rlpatch import _role, _wrapping
from vllm_rlpatch.hooks import engine_core, inflight, layerwise, mixed, wake, weights, workerctx
from vllm_rlpatch.registry import PatchSpec

logger = logging.getLogger("vllm.rlpatch")

NAME = "refit_guard"
WORKER = "vllm.v1.worker.gpu_worker:Worker"
CPU_WORKER = "vllm.v1.worker.cpu_worker:CPUWorker"
FRONTEND = ("vllm.v1.engine.llm_engine:LLMEngine.add_request", "vllm.v1.engine.async_llm:AsyncLLM.add_request")


# ------------------------------------------------------------------------------------------ sleep tracking
def _asleep(worker: Any) -> bool:
    return bool(getattr(worker, "_rlpatch_weights_asleep", False))


def refuse_if_asleep(worker: Any, what: str) -> None:
    if _asleep(worker):
        raise RuntimeError(f"vllm-rlpatch: {what} refused: the engine is asleep (its weights are offloaded or "
                           "discarded); call wake_up(tags=['weights']) first, then update, then wake the KV cache")


def _sleep_wrapper(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    object.__setattr__(instance, "_rlpatch_weights_asleep", True)
    level = kwargs.get("level", args[0] if args else 1)
    if isinstance(level, int) and level >= 2:  # the weights are discarded, not offloaded
        wake.set_discarded(instance, True)
    return result


def _after_wake(worker, tags) -> None:
    if tags is None or "weights" in tags:
        object.__setattr__(worker, "_rlpatch_weights_asleep", False)


# ------------------------------------------------------------------------------------------ vLLM's update paths
@contextlib.contextmanager
def _update_scope(source: str, worker: Any, args, kwargs):
    refuse_if_asleep(worker, f"weight update {source!r}")
    close_open_session(worker)
    # reload_weights replaces the model: a layer that received nothing is an error; the native session API
    # may legitimately send whole layers in several calls (half-loaded layers are still an error)
    with layerwise.strict(require_full=source == "reload_weights"):
        yield


# ------------------------------------------------------------------------------------------ direct load_weights
class _Session:
    def __init__(self) -> None:
        self.policy = layerwise.Policy(require_full=False)
        self.calls = 0
        self.started = time.monotonic()
        self.fired_at = 0  # layers processed when the session last counted an update (an RPC ending mid-layer)


_SESSIONS: "weakref.WeakKeyDictionary[Any, _Session]" = weakref.WeakKeyDictionary()
_NEEDS: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _needs_reload(model: Any, worker: Any) -> bool:
    """Do direct loads need the reload path? Yes where post-processing changed the parameters (CPU GEMM
    repacking, quantization); on a GPU bf16 model the parameters stay loadable in place."""
    v = _NEEDS.get(model)
    if v is None:
        try:
            from vllm.platforms import current_platform

            cpu = current_platform.is_cpu()
        except Exception:
            cpu = False
        quant = getattr(getattr(worker, "model_config", None), "quantization", None) is not None
        lost = any(not hasattr(p, "weight_loader") or p.numel() == 0 for p in model.parameters())
        v = _NEEDS[model] = bool(cpu or quant or lost)
    return v


def _finish(worker: Any, model: Any, sess: _Session) -> None:
    _SESSIONS.pop(model, None)
    with layerwise.using(sess.policy), workerctx.vllm_config_ctx(worker):
        layerwise.vllm_layerwise().finalize_layerwise_processing(model, worker.model_config)


def _in_rpc() -> bool:
    """Is this load part of an RPC whose end the engine core checks (then one event per RPC)?"""
    if _role.get().endswith("worker"):
        return True  # a worker process runs nothing but RPCs; the engine core's version check settles them
    return engine_core.in_rpc()


def _mark_dirty(worker: Any) -> None:
    object.__setattr__(worker, "_rlpatch_dirty", True)


def route(wrapped, model, worker, args, kwargs):
    """The ``model.load_weights`` router (see module doc). Returns ``(result, fire_event_now)``: inside an
    RPC the event fires once, when the RPC's loads are settled (a per-parameter loop is one update)."""
    defer = _in_rpc()
    if model not in _SESSIONS:
        if layerwise.reload_active(model):
            # part of a session vLLM finishes itself (the native start/update/finish API): its finish fires
            return wrapped(*args, **kwargs), False
        if not _needs_reload(model, worker):
            result = wrapped(*args, **kwargs)
            if defer:
                _mark_dirty(worker)
            return result, not defer
    refuse_if_asleep(worker, "model.load_weights")
    sess = _SESSIONS.get(model)
    if sess is None:
        with workerctx.vllm_config_ctx(worker):
            layerwise.vllm_layerwise().initialize_layerwise_reload(model)
        sess = _SESSIONS[model] = _Session()
    sess.calls += 1
    try:
        with layerwise.using(sess.policy), workerctx.vllm_config_ctx(worker):
            result = wrapped(*args, **kwargs)
    except BaseException as e:
        processed = sess.policy.findings.processed
        _SESSIONS.pop(model, None)
        layerwise.abort_open_reload(worker)
        if processed:
            _mark_dirty(worker)
            m = mixed.MixedWeights(f"vllm-rlpatch: model.load_weights raised after {processed} layer(s) already took "
                                   f"the new weights ({type(e).__name__}: {e})", (), "model.load_weights")
            mixed.set_worker(m)
            raise mixed.MixedWeightsError(m) from e
        raise
    if layerwise.half_loaded(model):
        _mark_dirty(worker)
        return result, False  # the rest of a fused layer comes in a later call
    _finish(worker, model, sess)
    if defer:
        _mark_dirty(worker)
    return result, not defer


def settle(worker: Any, raise_mixed: bool = True, keep_partial: bool = False) -> list[str]:
    """Close a direct-load session left open and fire the update's one event (end of the RPC, or before a
    forward pass). Raises (mixed mark) if a layer is still half-loaded: it keeps its previous weights.

    ``keep_partial`` (the end of an RPC): a layer still half-loaded stays open for the next RPC (a trainer that
    sends one parameter per RPC sends q, k and v of a fused layer in three); what is complete counts as an
    update now. Returns the half-loaded layers left open (the engine core refuses to generate meanwhile)."""
    model = workerctx.model_of(worker)
    sess = _SESSIONS.get(model) if model is not None else None
    if sess is not None and keep_partial:
        pending = layerwise.half_loaded(model)
        if pending:
            done = sess.policy.findings.processed
            if done > sess.fired_at:  # layers completed in this RPC hold the new weights: count them now
                sess.fired_at = done
                object.__setattr__(worker, "_rlpatch_dirty", False)
                weights.fire(worker, "model.load_weights", "worker")
            return pending
    if sess is not None:
        try:
            _finish(worker, model, sess)
        except Exception as e:
            object.__setattr__(worker, "_rlpatch_dirty", False)
            if raise_mixed:
                raise
            # the half-loaded layer keeps its previous weights (logged by the strict reload; a mix is marked)
            logger.warning("vllm-rlpatch: a direct-load session closed incomplete: %s: %s", type(e).__name__, e)
    if getattr(worker, "_rlpatch_dirty", False):
        object.__setattr__(worker, "_rlpatch_dirty", False)
        weights.fire(worker, "model.load_weights", "worker")
    why = mixed.worker_state()
    if why is not None and raise_mixed:
        # a reload failed half-way and the caller swallowed the error (a framework's own worker method)
        raise mixed.MixedWeightsError(why)
    return []


def close_open_session(worker: Any) -> None:
    """Before vLLM's own update paths write: a direct-load session a trainer left open closes first (a layer it
    left half-loaded keeps its previous weights; a mix is marked, not raised: the update repairs it)."""
    model = workerctx.model_of(worker)
    if model is not None and _SESSIONS.get(model) is not None:
        settle(worker, raise_mixed=False)


def _execute_wrapper(wrapped, instance, args, kwargs):
    if _SESSIONS or getattr(instance, "_rlpatch_dirty", False):
        out = args[0] if args else kwargs.get("scheduler_output")
        # a step without tokens runs no forward pass (the engine core frees finished requests): a fused layer
        # whose parts are still arriving stays open
        settle(instance, keep_partial=getattr(out, "total_num_scheduled_tokens", None) == 0)
    return wrapped(*args, **kwargs)


# ------------------------------------------------------------------------------------------ engine core
def _weights_asleep(g: engine_core.Guard) -> bool:
    ex = getattr(g.core, "model_executor", None)
    tags = getattr(ex, "sleeping_tags", None)
    if tags is not None:
        return "weights" in tags
    return bool(getattr(ex, "is_sleeping", False))


def _before_rpc(g: engine_core.Guard, method: str) -> None:
    if engine_core.starts_update(method) and _weights_asleep(g):
        raise RuntimeError(f"vllm-rlpatch: weight update {method!r} refused: the engine is asleep (its weights are "
                           "offloaded or discarded); call wake_up(tags=['weights']) first")


POLICY = engine_core.Policy(NAME, before_rpc=_before_rpc)


# ------------------------------------------------------------------------------------------ front end
class RequestRefused(RuntimeError, ValueError):
    """A request an engine with mixed weights refuses. A ValueError too: vLLM's OpenAI server (0.20 - 0.25)
    answers 400 with this message instead of an anonymous 500."""


_REFUSED_CLS: type | None = None


def _refused_class() -> type:
    """vLLM 0.32+ turns anything but its own error classes raised in ``generate`` into an empty 500; there the
    refusal is also a ``GracefulHTTPError`` (HTTP 503 with the message: retry after the next update)."""
    global _REFUSED_CLS
    if _REFUSED_CLS is None:
        try:
            from http import HTTPStatus

            from vllm.exceptions import GracefulHTTPError
        except ImportError:
            _REFUSED_CLS = RequestRefused
        else:
            def __init__(self, message):
                GracefulHTTPError.__init__(self, message, HTTPStatus.SERVICE_UNAVAILABLE)

            _REFUSED_CLS = type("RequestRefused", (GracefulHTTPError, RequestRefused), {"__init__": __init__})
    return _REFUSED_CLS


def _front_add_request(wrapped, instance, args, kwargs):
    m = mixed.poisoned(instance)
    if m is not None:
        raise _refused_class()(f"vllm-rlpatch: request refused, the engine's weights are not consistent: "
                               f"{m.message}. Push a complete update (push_weights) to resume")
    return wrapped(*args, **kwargs)


def _on_event(ev, engine) -> None:
    if ev.side == "frontend":
        mixed.clear(engine)


def _on_rpc_error(engine: Any, method: str, exc: BaseException, state: "mixed.MixedWeights | None") -> None:
    if state is not None:  # the workers said so (as data), after the RPC failed
        mixed.poison(engine, state)


_LAZY = [
    _wrapping.LazyWrap(f"{WORKER}.sleep", _sleep_wrapper, NAME),
    _wrapping.LazyWrap(f"{WORKER}.execute_model", _execute_wrapper, NAME),
    _wrapping.LazyWrap(f"{CPU_WORKER}.sleep", _sleep_wrapper, NAME),
    *(_wrapping.LazyWrap(t, _front_add_request, NAME) for t in FRONTEND),
]
_unsubscribe = None


def apply() -> None:
    global _unsubscribe
    layerwise.require(NAME)
    weights.add_scope(_update_scope)
    weights.add_settler(settle)
    weights.set_load_router(route)
    weights.add_rpc_error_listener(_on_rpc_error)
    if _unsubscribe is None:
        _unsubscribe = weights.on_weight_update(_on_event)
    engine_core.require(NAME)
    engine_core.add_policy(POLICY)
    inflight.require(NAME, honour_env=False)
    for lz in _LAZY:
        lz.apply()
    wake.add(NAME, after=_after_wake)


def revert() -> None:
    global _unsubscribe
    wake.remove(NAME)
    for lz in _LAZY:
        lz.revert()
    inflight.release(NAME)
    engine_core.remove_policy(NAME)
    engine_core.release(NAME)
    if _unsubscribe is not None:
        _unsubscribe()
        _unsubscribe = None
    weights.remove_rpc_error_listener(_on_rpc_error)
    weights.set_load_router(None)
    weights.remove_settler(settle)
    weights.remove_scope(_update_scope)
    layerwise.release(NAME)


SPEC = PatchSpec(
    name=NAME,
    summary="Weight updates never leave garbage, stale or mixed weights: strict layerwise reloads, direct "
            "model.load_weights routed through a reload, updates refused while asleep, mixed engines refuse "
            "requests",
    vllm=">=0.20",
    targets=(),
    lazy_targets=(*layerwise.TARGETS, f"{WORKER}.sleep", f"{WORKER}.wake_up", f"{WORKER}.execute_model", *FRONTEND,
                  *engine_core.CORE_TARGETS),
    apply=apply,
    revert=revert,
    upstream="not reported upstream (layerwise.py logs 'Failed to load weights' / 'Delayed processing' and goes on; "
             "no sleep check on update paths)",
    remove_when="vLLM's layerwise reload raises on incomplete layers and update paths refuse sleeping engines",
)
