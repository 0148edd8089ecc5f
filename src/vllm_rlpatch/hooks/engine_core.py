"""The engine-core hook: one owner wraps vLLM's ``EngineCore``, ``Scheduler`` and ``OutputProcessor`` for
every patch that needs to see weight updates; patches say they need it with :func:`require` /
:func:`release` (no patch wraps these targets itself).

The hook's parts, one job each:

* :mod:`~vllm_rlpatch.hooks.update_events`: which RPCs write weights, and the :class:`Guard` of each engine
  core that detects, counts and reacts to updates (policies: :func:`add_policy`);
* :mod:`~vllm_rlpatch.hooks.output_stamps`: outputs stamped with :class:`VersionSpan` lists, and payload
  channels from the workers to the ``CompletionOutput`` (:func:`add_channel`, :func:`put_payload`);
* :mod:`~vllm_rlpatch.hooks.refit_rpc`: the refit API's RPC names, its answers (:func:`pack_answers` /
  :func:`unpack_answers`) and its session gate.

This module installs their wrappers, and itself wraps ``EngineCore.collective_rpc`` (each RPC's steps:
:func:`_collective_rpc_wrapper`), the request intake (salting, each request's KV version) and the step (aborts
of an in-process engine core). Every name above is importable from here.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from vllm_rlpatch import _wrapping
from vllm_rlpatch.hooks import inflight, mixed, output_stamps, refit_rpc, update_events, weights
from vllm_rlpatch.hooks.output_stamps import PAYLOAD_KEY, TAG_KEY, Channel, add_channel, put_payload, remove_channel, spans_of
from vllm_rlpatch.hooks.refit_rpc import (PACKED, REFIT_ABORT, REFIT_COMMIT, REFIT_PREPARE, REFIT_RELEASE, REFIT_RPCS,
                                          pack_answers, unpack_answers)
from vllm_rlpatch.hooks.update_events import (Guard, Policy, UpdateInfo, VersionSpan, add_policy, combine_salt, guard_for,
                                              in_rpc, remove_policy, starts_update, update_method_names)

__all__ = [
    "OWNER", "CORE", "SCHED", "OUTPUTS", "CORE_TARGETS", "SCHED_TARGETS", "FRONTEND_TARGETS", "TARGETS",
    "require", "release",
    "Guard", "Policy", "UpdateInfo", "VersionSpan", "add_policy", "remove_policy", "guard_for", "in_rpc",
    "starts_update", "update_method_names", "combine_salt",
    "Channel", "add_channel", "remove_channel", "put_payload", "spans_of", "TAG_KEY", "PAYLOAD_KEY",
    "REFIT_PREPARE", "REFIT_COMMIT", "REFIT_ABORT", "REFIT_RELEASE", "REFIT_RPCS", "PACKED", "pack_answers",
    "unpack_answers",
]

logger = logging.getLogger("vllm.rlpatch")

OWNER = "engine_core_hook"
CORE = "vllm.v1.engine.core"
SCHED = "vllm.v1.core.sched.scheduler"
OUTPUTS = "vllm.v1.engine.output_processor"
REQUEST_OUTPUT = "vllm.outputs"

CORE_TARGETS = (
    f"{CORE}:EngineCore.collective_rpc",
    f"{CORE}:EngineCore.preprocess_add_request",
    f"{CORE}:EngineCore.add_request",
    f"{CORE}:EngineCore.step",
    f"{CORE}:EngineCore.step_with_batch_queue",
)
SCHED_TARGETS = (
    f"{SCHED}:Scheduler.schedule",
    f"{SCHED}:Scheduler.update_from_output",
    f"{SCHED}:Scheduler._preempt_request",
)
FRONTEND_TARGETS = (
    f"{OUTPUTS}:OutputProcessor.process_outputs",
    f"{OUTPUTS}:RequestState._new_completion_output",
    f"{REQUEST_OUTPUT}:RequestOutput.add",
)
TARGETS = CORE_TARGETS + SCHED_TARGETS + FRONTEND_TARGETS

_LOCK = threading.RLock()
_USERS: set[str] = set()
_active = False
_unsubscribe: Callable[[], None] | None = None


# ---------------------------------------------------------------------------------------------- collective_rpc
def _rpc_name(args, kwargs) -> str:
    method = args[0] if args else kwargs.get("method")
    return method if isinstance(method, str) else getattr(method, "__name__", "<callable>")


def _rpc_parts(args, kwargs) -> tuple[str, tuple, dict]:
    """(method, args, kwargs) of ``EngineCore.collective_rpc(method, timeout=None, args=(), kwargs=None)``."""
    method = _rpc_name(args, kwargs)
    rargs = args[2] if len(args) > 2 else kwargs.get("args", ())
    rkw = args[3] if len(args) > 3 else kwargs.get("kwargs")
    return method, tuple(rargs or ()), dict(rkw or {})


def _with_rpc_kwargs(args: tuple, kwargs: dict, extra: dict) -> tuple[tuple, dict]:
    """``EngineCore.collective_rpc``'s arguments with ``extra`` added to the RPC's own kwargs."""
    if len(args) > 3:
        return args[:3] + ({**(args[3] or {}), **extra},) + args[4:], kwargs
    return args, {**kwargs, "kwargs": {**(kwargs.get("kwargs") or {}), **extra}}


def _collective_rpc_wrapper(wrapped, instance, args, kwargs):
    """One RPC of a client to the workers: refuse or prepare an update before it, read what it left after."""
    clock = {"enter": time.perf_counter()}
    method, rargs, rkw = _rpc_parts(args, kwargs)
    if method in refit_rpc.LAST_RPCS:
        # the update's last RPC rests the workers' RPC readers, only while no request is scheduled (Guard.idle)
        args, kwargs = _with_rpc_kwargs(args, kwargs, {"rest": guard_for(instance).idle()})
    if method in update_events.READ_ONLY:
        return wrapped(*args, **kwargs)
    g = guard_for(instance)
    g.rpc = (method, rargs, rkw)
    g.inflight_override = rkw.get("inflight") if method in REFIT_RPCS else None
    try:
        _before_rpc(g, method, rargs, rkw)
        result = _call_workers(g, method, wrapped, args, kwargs, clock)
        _check_after_rpc(g, method, result)
        if method in REFIT_RPCS and isinstance(result, list):
            return _refit_answers(g, method, rargs, rkw, result, clock)
        return result
    finally:
        g.rpc = None
        g.inflight_override = None


def _before_rpc(g: Guard, method: str, rargs: tuple, rkw: dict) -> None:
    """The session gate, the in-flight policy and the patches' policies: each may refuse the RPC."""
    refit_rpc.session_gate(g, method, rargs, rkw)
    if inflight.active() and starts_update(method):
        inflight.before_update(g, method)
    for p in update_events.policies():
        if p.before_rpc is not None:
            p.before_rpc(g, method)


def _call_workers(g: Guard, method: str, wrapped, args, kwargs, clock: dict[str, float]) -> Any:
    """The RPC itself; when it fails, what it left is asked as data (not read out of the exception's text)."""
    with update_events.handling_rpc(g):
        clock["call"] = time.perf_counter()
        try:
            result = wrapped(*args, **kwargs)
        except Exception:
            try:
                left = g.check_workers(method)
            except Exception:
                left = None
                logger.debug("vllm-rlpatch: weight-state check after a failed %r failed", method, exc_info=True)
            if left is not None:
                g.poison(left)
            raise
    clock["return"] = time.perf_counter()
    return result


def _check_after_rpc(g: Guard, method: str, result: Any) -> None:
    """Did the weights change, and are they a mix? A mix poisons the engine and, unless the refit API reads
    the answers itself, fails the RPC."""
    if method == REFIT_PREPARE:  # prepare writes nothing
        return
    mixed_after = None
    try:
        mixed_after = g.check_workers(method, result)
    except Exception:
        logger.exception("vllm-rlpatch: weight-version check after collective_rpc(%r) failed", method)
    if mixed_after is None:
        return
    g.poison(mixed_after)
    if method not in REFIT_RPCS:
        # the RPC returned, but the weights it left are a mix (e.g. a framework method swallowed the
        # reload's error): tell its caller instead of returning as if all went well
        raise mixed.MixedWeightsError(mixed_after)


def _refit_answers(g: Guard, method: str, rargs: tuple, rkw: dict, result: list, clock: dict[str, float]) -> list:
    """A refit RPC's answers: a rank's mixed weights poison the engine, the session moves on, a commit's answers
    carry the engine core's record and clock (this process's perf_counter around the workers' call), and all
    travel packed."""
    m = mixed.from_results(result)
    if m is not None:
        g.poison(m)
    refit_rpc.session_after(g, method, rargs, rkw, result)
    if method == REFIT_COMMIT:
        refit_rpc.stamp_commit(result, {**g.last_update, "engine_version": g.version,
                                        "clock": {**clock, "exit": time.perf_counter()}})
    return pack_answers(result)


# ---------------------------------------------------------------------------------------------- requests, steps
def _preprocess_wrapper(wrapped, instance, args, kwargs):
    """Salt the EngineCoreRequest before vLLM hashes its prompt blocks (runs in vLLM's input thread)."""
    g = guard_for(instance)
    request = args[0] if args else kwargs.get("request")
    user = getattr(request, "cache_salt", None)
    key = g.salt_key()
    if key is not None and request is not None:
        request.cache_salt = combine_salt(user, key)
    result = wrapped(*args, **kwargs)
    req = result[0] if isinstance(result, tuple) else result
    if req is not None and hasattr(req, "request_id"):
        update_events.record_salt(req, user, key)
    return result


def _add_request_wrapper(wrapped, instance, args, kwargs):
    g = guard_for(instance)
    req = args[0] if args else kwargs.get("request")
    if req is not None and hasattr(req, "request_id"):
        if hasattr(req, "block_hashes"):
            # The input thread salted it with the key current then; an update may have landed since.
            if getattr(req, "_rlpatch_salt_key", None) != g.salt_key():
                g.salt(req, rehash=True)
        g.kv_version[req.request_id] = g.version
    result = wrapped(*args, **kwargs)
    if req is not None and hasattr(req, "request_id"):
        if g.poisoned is not None:
            g.abort_ids([req.request_id], f"refused: {g.poisoned.message}")
        elif g.session is not None:
            g.abort_ids([req.request_id], "refused: a multi-call weight update is in progress")
        elif g.partial:
            g.abort_ids([req.request_id], f"refused: a weight update is arriving in parts ({g.partial[0]}, ...)")
    return result


def _inject_pending_aborts(g: Guard, outputs: Any) -> Any:
    if not g.pending_aborts:
        return outputs
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    pending, g.pending_aborts = g.pending_aborts, []
    outputs = dict(outputs or {})
    for client, rid in pending:
        eco = outputs.get(client)
        if eco is None:
            eco = outputs[client] = EngineCoreOutputs()
        eco.outputs = [*(eco.outputs or []), EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT)]
        eco.finished_requests = {*(eco.finished_requests or ()), rid}
    return outputs


def _step_wrapper(wrapped, instance, args, kwargs):
    outputs, executed = wrapped(*args, **kwargs)
    g = update_events.guard_of_core(instance)
    if g is not None and g.pending_aborts:
        outputs = _inject_pending_aborts(g, outputs)
    return outputs, executed


def _schedule_wrapper(wrapped, instance, args, kwargs):
    g = update_events.guard_of_scheduler(instance)
    if g is not None:
        for p in update_events.policies():
            if p.before_schedule is not None:
                p.before_schedule(g)
    out = wrapped(*args, **kwargs)
    if g is not None:
        try:
            out._rlpatch_version = g.version  # the weights this batch runs with
        except AttributeError:
            pass
    return out


def _preempt_wrapper(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    g = update_events.guard_of_scheduler(instance)
    req = args[0] if args else kwargs.get("request")
    if g is not None and req is not None and getattr(req, "num_computed_tokens", 1) == 0:
        # It will be recomputed from scratch: with the weights of now, under the salt of now.
        if getattr(req, "_rlpatch_salt_key", None) != g.salt_key():
            g.salt(req, rehash=True)
        g.kv_version[req.request_id] = g.version
    return result


# ---------------------------------------------------------------------------------------------- install
_WRAPPERS: dict[str, Callable] = {
    f"{CORE}:EngineCore.collective_rpc": _collective_rpc_wrapper,
    f"{CORE}:EngineCore.preprocess_add_request": _preprocess_wrapper,
    f"{CORE}:EngineCore.add_request": _add_request_wrapper,
    f"{CORE}:EngineCore.step": _step_wrapper,
    f"{CORE}:EngineCore.step_with_batch_queue": _step_wrapper,
    f"{SCHED}:Scheduler.schedule": _schedule_wrapper,
    f"{SCHED}:Scheduler.update_from_output": output_stamps.update_from_output_wrapper,
    f"{SCHED}:Scheduler._preempt_request": _preempt_wrapper,
    f"{OUTPUTS}:OutputProcessor.process_outputs": output_stamps.process_outputs_wrapper,
    f"{OUTPUTS}:RequestState._new_completion_output": output_stamps.new_completion_output_wrapper,
    f"{REQUEST_OUTPUT}:RequestOutput.add": output_stamps.request_output_add_wrapper,
}


def _missing(targets: list[str]) -> None:
    logger.warning("vllm-rlpatch: %s missing in this vLLM; that part of the weight-update handling is off",
                   ", ".join(targets))


_LAZY = [_wrapping.LateWraps(module, {t: w for t, w in _WRAPPERS.items() if t.partition(":")[0] == module}, OWNER,
                             on_missing=_missing) for module in (CORE, SCHED, OUTPUTS, REQUEST_OUTPUT)]


def require(user: str) -> None:
    """A patch needs the hook: install it (idempotent), wrapping each module when vLLM imports it."""
    global _active, _unsubscribe
    with _LOCK:
        _USERS.add(user)
        if _active:
            return
        _active = True
        for lz in _LAZY:
            lz.apply()
        _unsubscribe = weights.on_weight_update(update_events.on_weight_event)


def release(user: str) -> None:
    global _active, _unsubscribe
    with _LOCK:
        _USERS.discard(user)
        if _USERS:
            return
        _active = False
        for lz in _LAZY:
            lz.revert()
        if _unsubscribe is not None:
            _unsubscribe()
            _unsubscribe = None

