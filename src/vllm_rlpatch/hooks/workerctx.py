"""What every worker-side hook needs from a vLLM worker: its model and device, and the contexts vLLM's
loaders expect (the current vLLM config; a LoRA engine's base layers under their checkpoint names)."""

from __future__ import annotations

import contextlib
import sys
import time
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


# How long a rested reader still spins: a message written within this time is read without the socket's
# wake-up. vLLM's writer notifies through a PUB socket with SNDHWM=1, and zmq refreshes a pipe's credit only when
# the writing thread processes its commands, which it skips for ~1 ms after the last time: a second
# notification within that window is dropped. A reader sent to sleep at once missed the RPC that came right
# after (the engine core's weight-state RPC after a commit: both processes waiting forever, vLLM 0.25.1 CPU).
# vLLM's own readers sleep only after busy_loop_s (1 s) without a read, long past that window.
REST_GRACE_S = 0.05


def _rest(mq: Any) -> bool:
    """Shorten a vLLM ``MessageQueue`` reader's busy loop to :data:`REST_GRACE_S` from now."""
    spin = getattr(mq, "_spin_condition", None)
    if spin is None or not hasattr(spin, "last_read") or not hasattr(spin, "busy_loop_s"):
        return False
    spin.last_read = min(spin.last_read, time.monotonic() - spin.busy_loop_s + REST_GRACE_S)
    return True


_NO_READER = object()
_reader: Any = None  # this process's RPC reader once found (or _NO_READER: an executor without one)


def rest_rpc_reader() -> bool:
    """Call at the end of a worker RPC that ends an update: this worker process's RPC reader waits idle for the
    next RPC instead of spinning. After every read, vLLM's shared-memory broadcast reader polls with
    ``sched_yield`` for ``busy_loop_s`` (1 s) before it sleeps on its socket (``SpinCondition.wait`` /
    ``record_read`` in vllm/distributed/device_communicators/shm_broadcast.py, 0.20-0.32): a full core per
    engine worker for a second after each update, the cores a trainer on a small host packs its next update on
    (benchmarks/rpc_spin.py). The reader then spins :data:`REST_GRACE_S` more and sleeps; the executor's next
    write wakes it through the socket it notifies on every write. The reader is the multiproc executor's
    ``WorkerProc.rpc_broadcast_mq``, found on the frames calling this RPC (``worker_busy_loop`` /
    ``_execute_worker_rpc``). Returns whether one was found (not with the uniproc or Ray executors). The
    search runs once per process (a process's executor does not change); later calls reuse its answer."""
    global _reader
    if _reader is None:
        _reader = _NO_READER
        f = sys._getframe(1)
        for _ in range(32):
            if f is None:
                break
            owner = f.f_locals.get("self")
            mq = getattr(owner, "rpc_broadcast_mq", None) if owner is not None else None
            if mq is not None:
                _reader = mq
                break
            f = f.f_back
    return _reader is not _NO_READER and _rest(_reader)


def rest_response_readers(executor: Any) -> int:
    """The engine core's side of :func:`rest_rpc_reader`: the multiproc executor reads its workers' replies
    through ``response_mqs``, and spins while it waits for the next reply if its last read was less than a
    second ago (the next update's prepare, while the trainer sends). Returns how many were rested."""
    return sum(_rest(mq) for mq in (getattr(executor, "response_mqs", None) or ()))
