"""Strict layerwise reloading: no layer is ever processed half-loaded, none silently keeps old weights.

vLLM (0.20 - 0.32) reloads weights in place through ``model_loader/reload/layerwise.py``: every layer is
put back on the meta device, the loads into it are buffered, and the layer is processed (and copied into
its old storage) once all its elements arrived. ``finalize_layerwise_processing`` then deals with the
rest, silently:

* a layer that received *some* of its elements (a fused qkv/gate_up whose q arrived but not k and v) is
  processed anyway ("Delayed processing", DEBUG), the missing part taken from ``torch.empty_strided``:
  uninitialised memory;
* a layer that received *nothing* keeps its old weights with one WARNING ("Failed to load weights");
* a tied head (``lm_head`` sharing ``embed_tokens.weight``) receives nothing by design; its storage is
  updated through the embedding, but its own post-processing is not re-run, so a CPU head repacked from
  the old weights keeps computing with them (vLLM 0.32 CPU, seen here).

:func:`strict` (a context manager) makes a reload strict while it is active, and the ``refit_guard`` patch
makes every reload in the process strict: a half-loaded layer is **not** processed (its old weights are
put back, whole) and the reload raises :class:`LayerwiseError` naming the layers; a layer with parameters
that received nothing raises too when the update claims to be complete (``require_full``); a tied layer is
re-processed from its updated storage (unquantized heads only; a quantized one is reported).

The wrapping is one owner (``layerwise_hook``) on ``layerwise.finalize_layerwise_processing`` and
``layerwise._layerwise_process`` (both looked up as module globals at call time in all three versions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from typing import Any, Iterator

from vllm_rlpatch import _wrapping

logger = logging.getLogger("vllm.rlpatch")

OWNER = "layerwise_hook"
MODULE = "vllm.model_executor.model_loader.reload.layerwise"
FINALIZE = f"{MODULE}:finalize_layerwise_processing"
PROCESS = f"{MODULE}:_layerwise_process"
TARGETS = (FINALIZE, PROCESS)
from vllm_rlpatch.hooks import mixed as _mixed_state
from vllm_rlpatch.hooks import workerctx

MIXED_MARK = _mixed_state.MARK  # starts every mixed-weights message (for people; code reads the state)


class LayerwiseError(RuntimeError):
    """A reload that would have processed a half-loaded layer, or left a layer with its old weights."""

    def __init__(self, message: str, findings: "Findings"):
        super().__init__(message)
        self.findings = findings


@dataclasses.dataclass
class Findings:
    half: list[str] = dataclasses.field(default_factory=list)  # "name (got/total elements)"
    empty: list[str] = dataclasses.field(default_factory=list)
    tied: list[str] = dataclasses.field(default_factory=list)  # re-processed from the shared storage
    tied_unsupported: list[str] = dataclasses.field(default_factory=list)
    processed: int = 0  # layers written (processed and copied into their storage)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Policy:
    require_full: bool = False  # a layer with parameters that received nothing is an error
    raise_errors: bool = True
    findings: Findings = dataclasses.field(default_factory=Findings)
    processed_ptrs: set = dataclasses.field(default_factory=set)  # ids of parameters written in this reload


class _Tls(threading.local):
    stack: list[Policy]
    implicit: Policy | None

    def __init__(self) -> None:
        self.stack = []
        self.implicit = None  # the process-wide default policy's state for the reload in progress


_TLS = _Tls()
_LOCK = threading.RLock()
_users: set[str] = set()
_default: Policy | None = None  # set by the refit_guard patch: every reload in the process is strict


def _current() -> Policy | None:
    if _TLS.stack:
        return _TLS.stack[-1]
    if _default is not None:
        if _TLS.implicit is None:
            _TLS.implicit = Policy(require_full=_default.require_full)
        return _TLS.implicit
    return None


@contextlib.contextmanager
def strict(require_full: bool = False, raise_errors: bool = True) -> Iterator[Policy]:
    """Make reloads inside this block strict (installs the hook for the block if nobody else has)."""
    pol = Policy(require_full=require_full, raise_errors=raise_errors)
    require("strict-block")
    _TLS.stack.append(pol)
    try:
        yield pol
    finally:
        _TLS.stack.pop()
        release("strict-block")


@contextlib.contextmanager
def using(pol: Policy) -> Iterator[Policy]:
    """Make an existing policy current (a session spanning several calls keeps one policy)."""
    require("strict-block")
    _TLS.stack.append(pol)
    try:
        yield pol
    finally:
        _TLS.stack.pop()
        release("strict-block")


# ------------------------------------------------------------------------------------------ helpers
def vllm_layerwise():
    """vLLM's layerwise-reload module (0.32+), imported when first needed."""
    import vllm.model_executor.model_loader.reload.layerwise as lw

    return lw


def _is_deferred_attention(lw, layer) -> bool:
    fn = getattr(lw, "is_deferred_attention_layer", None)
    if fn is not None:
        return bool(fn(layer))
    classes = tuple(c for c in (getattr(lw, "Attention", None), getattr(lw, "MLAAttention", None)) if c)
    return bool(classes) and isinstance(layer, classes)


def _is_embedding(layer) -> bool:
    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    except ImportError:  # pragma: no cover
        return False
    return isinstance(layer, VocabParallelEmbedding)


def _reprocess_tied(layer) -> bool:
    """Re-run an unquantized layer's post-processing on its (updated, shared) storage."""
    qm = getattr(layer, "quant_method", None)
    if qm is None:
        return True
    if "Unquantized" not in type(qm).__name__:
        return False
    qm.process_weights_after_loading(layer)
    return True


# ------------------------------------------------------------------------------------------ wrappers
_MOE_SKIPS_EXPERTS: bool | None = None


def _moe_update_skips_experts() -> bool:
    """vLLM 0.32's unquantized MoE method runs the experts' own post-processing (the CPU grouped-GEMM prepack)
    only on the first load, not when a reload re-processes the layer: the reloaded weights reach the kernel
    unpacked and the MoE computes with garbage (seen on vLLM 0.32 CPU: stock reload_weights of a Mixtral
    differs from a fresh engine). Detected from the method's source."""
    global _MOE_SKIPS_EXPERTS
    if _MOE_SKIPS_EXPERTS is None:
        try:
            import inspect

            from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

            src = inspect.getsource(UnquantizedFusedMoEMethod._setup_kernel)
            _MOE_SKIPS_EXPERTS = "if not is_weight_update" in src and "fused_experts.process_weights_after_loading" in src
        except Exception:
            _MOE_SKIPS_EXPERTS = False
    return _MOE_SKIPS_EXPERTS


def _redo_moe_experts(layer, had_kernel: bool) -> None:
    if not had_kernel or not _moe_update_skips_experts():
        return
    qm = getattr(layer, "quant_method", None)
    if type(qm).__name__ != "UnquantizedFusedMoEMethod":
        return
    fe = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
    if fe is None:
        return
    owner = next((c for c in type(fe).__mro__ if "process_weights_after_loading" in c.__dict__), None)
    if owner is None or owner.__module__.endswith("modular_kernel"):
        return  # the base class's no-op: nothing was skipped
    fe.process_weights_after_loading(layer)
    logger.info("vllm-rlpatch: re-ran %s.process_weights_after_loading for %s (vLLM skips it on weight updates)",
                type(fe).__name__, type(layer).__name__)


def _process_wrapper(wrapped, instance, args, kwargs):
    pol = _current()
    layer = args[0] if args else kwargs.get("layer")
    had_kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None) is not None
    if pol is None:
        result = wrapped(*args, **kwargs)
        _redo_moe_experts(layer, had_kernel)
        return result
    if pol is not None:
        info = args[1] if len(args) > 1 else kwargs.get("info")
        kt = getattr(info, "kernel_tensors", None)
        if kt:
            for t in kt[0].values():
                if t is not None and t.numel() > 0:
                    pol.processed_ptrs.add(id(t))  # the parameter objects a tied layer shares
            pol.findings.processed += 1
    result = wrapped(*args, **kwargs)
    _redo_moe_experts(layer, had_kernel)
    return result


def _finalize_wrapper(wrapped, instance, args, kwargs):
    pol = _current()
    if pol is None:
        return wrapped(*args, **kwargs)
    _TLS.implicit = None  # the next reload starts afresh
    lw = vllm_layerwise()
    model = args[0] if args else kwargs.get("model")
    f = pol.findings
    tied_layers = []
    infos = getattr(lw, "LAYERWISE_INFO", {})
    for name, layer in model.named_modules():
        info = infos.get(layer)
        if info is None or not info.can_load() or _is_deferred_attention(lw, layer):
            continue
        total, got = int(info.load_numel_total or 0), int(info.load_numel or 0)
        if total <= 0:
            continue
        if 0 < got < total and not _is_embedding(layer):
            # never processed half-loaded: forget the partial loads, vLLM puts the kernel tensors back
            f.half.append(f"{name or type(layer).__name__} ({got}/{total} elements)")
            info.load_numel = 0
            info.loaded_weights.clear()
            logger.error("vllm-rlpatch: %s received %d of its %d elements in this reload: keeping its previous "
                         "weights instead of processing it from uninitialised memory", name, got, total)
            continue
        if got == 0:
            params = (info.kernel_tensors or ({}, {}))[0]
            if not params:
                continue  # buffers only (rotary caches): nothing a checkpoint carries
            ids = {id(t) for t in params.values() if t is not None and t.numel() > 0}
            if ids and ids <= pol.processed_ptrs:
                tied_layers.append((name, layer))
            else:
                f.empty.append(name or type(layer).__name__)
    # vLLM would log "Failed to load weights" for each empty/tied layer; say what it really is instead
    lw_logger = getattr(lw, "logger", None)
    quiet = lw_logger is not None
    if quiet:
        old_disabled = lw_logger.disabled
        lw_logger.disabled = True
    try:
        result = wrapped(*args, **kwargs)
    finally:
        if quiet:
            lw_logger.disabled = old_disabled
    for name, layer in tied_layers:
        try:
            if _reprocess_tied(layer):
                f.tied.append(name)
            else:
                f.tied_unsupported.append(name)
        except Exception as e:  # noqa: BLE001 - reported below
            f.tied_unsupported.append(f"{name} ({type(e).__name__}: {e})")
    if f.tied:
        logger.info("vllm-rlpatch: re-processed tied layer(s) %s from their updated shared storage", ", ".join(f.tied))
    if f.empty and not pol.require_full:
        logger.info("vllm-rlpatch: %d layer(s) received no weights in this reload and keep their previous ones: %s",
                    len(f.empty), ", ".join(f.empty[:6]) + (" ..." if len(f.empty) > 6 else ""))
    problems = []
    if f.half:
        problems.append(f"{len(f.half)} layer(s) received only part of their elements and kept their previous "
                        f"weights: {', '.join(f.half[:6])}")
    if f.empty and pol.require_full:
        problems.append(f"{len(f.empty)} layer(s) received no weights: {', '.join(f.empty[:6])}")
    if f.tied_unsupported:
        problems.append(f"tied layer(s) {', '.join(f.tied_unsupported)} could not be re-processed (quantized head)")
    if not problems and (pol.require_full or not f.empty):
        _mixed_state.clear_worker()  # a complete reload: whatever mix there was is gone
    if problems and pol.raise_errors:
        msg = "vllm-rlpatch: incomplete weight reload: " + "; ".join(problems)
        if f.processed > 0:
            m = _mixed_state.MixedWeights(
                f"{msg}. {f.processed} other layer(s) already hold the new weights: the model is a mix of old and "
                "new weights", tuple(h.split(" (")[0] for h in f.half) + tuple(f.empty), "reload")
            _mixed_state.set_worker(m)
            msg = m.message
        raise LayerwiseError(msg, f)
    return result


def _missing(targets: list[str]) -> None:
    logger.warning("vllm-rlpatch: %s missing: strict reloads unavailable in this vLLM", ", ".join(targets))


_LATE = _wrapping.LateWraps(MODULE, {FINALIZE: _finalize_wrapper, PROCESS: _process_wrapper}, OWNER,
                            on_missing=_missing, all_or_none=True)


def require(user: str) -> None:
    with _LOCK:
        _users.add(user)
        _LATE.apply()


def release(user: str) -> None:
    with _LOCK:
        _users.discard(user)
        if not _users:
            _LATE.revert()


def reload_active(model) -> bool:
    """Is a layerwise reload in progress on ``model`` (vLLM's own, or one of ours)?"""
    try:
        infos = vllm_layerwise().LAYERWISE_INFO
    except Exception:
        return False
    # Every update asks. First the records alone: no walk over the model's ~1000 modules when none can load.
    # The WeakKeyDictionary's own dict (weakref -> info) is copied in one C-level step, so a weakref callback
    # cannot change it while it is read.
    data = getattr(infos, "data", None)
    records = tuple(data.values()) if isinstance(data, dict) else tuple(infos.values())
    if not any(info.can_load() for info in records):
        return False
    for layer in model.modules():
        info = infos.get(layer)
        if info is not None and info.can_load():
            return True
    return False


def half_loaded(model) -> list[str]:
    """Layers of an open reload that received part of their elements (not yet processed)."""
    lw = vllm_layerwise()
    out = []
    for name, layer in model.named_modules():
        info = lw.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or _is_deferred_attention(lw, layer) or _is_embedding(layer):
            continue
        total, got = int(info.load_numel_total or 0), int(info.load_numel or 0)
        if 0 < got < total:
            out.append(name)
    return out


def abort_open_reload(worker: Any) -> None:
    """A load raised in the middle of a layerwise reload: every layer not yet processed gets its previous
    tensors back (vLLM would otherwise leave them on the meta device)."""
    lw = vllm_layerwise()
    model = workerctx.model_of(worker)
    for layer in model.modules():
        info = lw.LAYERWISE_INFO.get(layer)
        if info is not None and info.can_load():
            info.load_numel = 0
            info.loaded_weights.clear()
    with strict(require_full=False, raise_errors=False), workerctx.vllm_config_ctx(worker):
        lw.finalize_layerwise_processing(model, worker.model_config)
