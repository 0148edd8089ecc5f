"""Worker-side glue of the refit API: which model and device a worker has, the contexts vLLM's loaders need,
and the per-worker transaction object (:class:`vllm_rlpatch.refit.transaction.WorkerRefit`) the
``rlpatch_refit_*`` worker methods call.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import torch

from vllm_rlpatch.refit import protocol as P

_REFITS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()


def for_worker(worker: Any):
    from vllm_rlpatch.refit.transaction import WorkerRefit

    with _LOCK:
        r = _REFITS.get(worker)
        if r is None:
            r = _REFITS[worker] = WorkerRefit(worker)
        return r


def model_of(worker: Any):
    runner = getattr(worker, "model_runner", None)
    get_model = getattr(runner, "get_model", None)
    if callable(get_model):
        return get_model()
    return getattr(runner, "model", None)


@contextlib.contextmanager
def vllm_config_ctx(worker: Any):
    cfg = getattr(worker, "vllm_config", None)
    if cfg is None:
        yield
        return
    try:
        from vllm.config import set_current_vllm_config
    except ImportError:  # pragma: no cover
        yield
        return
    with set_current_vllm_config(cfg):
        yield


@contextlib.contextmanager
def lora_unwrapped(model):
    """vLLM's LoRA wrappers rename every base parameter (``x.weight`` -> ``x.base_layer.weight``), so the
    model's own ``load_weights`` cannot find checkpoint names in a LoRA engine (``There is no module or
    parameter named 'embed_tokens.weight'``). For the reload, put each wrapped base layer back in its
    parent's place; the wrappers keep referencing the same base modules, whose tensors are updated in place.
    """
    swaps = []
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            base = getattr(child, "base_layer", None)
            if isinstance(base, torch.nn.Module) and type(child).__name__.endswith("WithLoRA"):
                swaps.append((parent, child_name, child))
                parent._modules[child_name] = base
    try:
        yield len(swaps)
    finally:
        for parent, child_name, child in swaps:
            parent._modules[child_name] = child


def weights_fingerprint(model) -> tuple[str, dict[str, str]]:
    named = []
    seen = set()
    for n, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        if id(t) in seen or t.is_meta:
            continue
        seen.add(id(t))
        named.append((n, t))
    named.sort(key=lambda x: x[0])
    fps = P.fingerprints([t for _, t in named])
    per = dict(zip([n for n, _ in named], fps))
    return P.combine(f"{n}={f}" for n, f in per.items()), per


def device_of(worker) -> torch.device:
    dev = getattr(worker, "device", None)
    if isinstance(dev, torch.device):
        return dev
    try:
        return next(model_of(worker).parameters()).device
    except Exception:
        return torch.device("cpu")


def abort_open_reload(worker: Any) -> None:
    """A load raised in the middle of a layerwise reload: every layer not yet processed gets its previous
    tensors back (vLLM would otherwise leave them on the meta device)."""
    from vllm_rlpatch.hooks import layerwise

    lw = layerwise._lw()
    model = model_of(worker)
    for layer in model.modules():
        info = lw.LAYERWISE_INFO.get(layer)
        if info is not None and info.can_load():
            info.load_numel = 0
            info.loaded_weights.clear()
    with layerwise.strict(require_full=False, raise_errors=False), vllm_config_ctx(worker):
        lw.finalize_layerwise_processing(model, worker.model_config)
