"""What every worker-side hook needs from a vLLM worker: its model and device, and the contexts vLLM's
loaders expect (the current vLLM config; a LoRA engine's base layers under their checkpoint names)."""

from __future__ import annotations

import contextlib
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
