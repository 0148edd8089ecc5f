"""What every worker-side hook needs from a vLLM worker: its model and device, and the contexts vLLM's
loaders expect (the current vLLM config; a LoRA engine's base layers under their checkpoint names)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any


def model_of(worker: Any):
    runner = getattr(worker, "model_runner", None)
    get_model = getattr(runner, "get_model", None)
    if callable(get_model):
        return get_model()
    return getattr(runner, "model", None)


def device_of(worker):
    import torch

    dev = getattr(worker, "device", None)
    if isinstance(dev, torch.device):
        return dev
    try:
        return next(model_of(worker).parameters()).device
    except Exception:
        return torch.device("cpu")


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
    import torch

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


def _rest(mq: Any) -> bool:
    """Date a vLLM ``MessageQueue`` reader's last read back: its next wait sleeps on its socket at once."""
    spin = getattr(mq, "_spin_condition", None)
    if spin is None or not hasattr(spin, "last_read"):
        return False
    spin.last_read = float("-inf")
    return True


def rest_rpc_reader() -> bool:
    """Call at the end of a worker RPC that ends an update: this worker process's RPC reader waits idle for the
    next RPC instead of spinning. After every read, vLLM's shared-memory broadcast reader polls with
    ``sched_yield`` for ``busy_loop_s`` (1 s) before it sleeps on its socket (``SpinCondition.wait`` /
    ``record_read`` in vllm/distributed/device_communicators/shm_broadcast.py, 0.20-0.32): a full core per
    engine worker for a second after each update, the cores a trainer on a small host packs its next update on
    (benchmarks/rpc_spin.py). Dating the last read back makes the reader sleep at once; the executor's next
    write wakes it through the socket it notifies on every write. The reader is the multiproc executor's
    ``WorkerProc.rpc_broadcast_mq``, found on the frames calling this RPC (``worker_busy_loop`` /
    ``_execute_worker_rpc``). Returns whether one was found (not with the uniproc or Ray executors)."""
    f = sys._getframe(1)
    for _ in range(32):
        if f is None:
            return False
        owner = f.f_locals.get("self")
        mq = getattr(owner, "rpc_broadcast_mq", None) if owner is not None else None
        if mq is not None:
            return _rest(mq)
        f = f.f_back
    return False


def rest_response_readers(executor: Any) -> int:
    """The engine core's side of :func:`rest_rpc_reader`: the multiproc executor reads its workers' replies
    through ``response_mqs``, and spins while it waits for the next reply if its last read was less than a
    second ago (the next update's prepare, while the trainer sends). Returns how many were rested."""
    return sum(_rest(mq) for mq in (getattr(executor, "response_mqs", None) or ()))
