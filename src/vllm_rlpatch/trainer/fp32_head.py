"""The fp32 head on the trainer's side: the output projection computed in float32, as the engine's.

The plugin's ``fp32_lm_head`` patch makes vLLM project the last hidden state in float32. A trainer that
keeps its own head in bf16 then compares bf16-rounded logits with fp32 ones, which can make the rollout /
trainer mismatch *worse* than bf16 on both sides (NeMo-RL warns about exactly this). Use the same head on
both sides:

    from vllm_rlpatch.trainer import fp32_lm_head
    model = fp32_lm_head(model)       # transformers or any torch model with an output projection

The parameters are not converted: the weight stays in its dtype (optimizer state, checkpoints and the
tensors pushed to vLLM are unchanged); only the projection runs as ``F.linear(h.float(), w.float())``,
differentiable as before. ``restore_lm_head(model)`` undoes it.
"""

from __future__ import annotations

from typing import Any

_ATTR = "_rlpatch_fp32_forward"


def _head_of(model: Any, head: Any = None) -> Any:
    import torch

    if head is not None:
        return head
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else None
    if out is None:
        out = getattr(model, "lm_head", None)
    if out is None:
        if isinstance(model, torch.nn.Linear):
            return model
        raise TypeError(f"fp32_lm_head: {type(model).__name__} has no output projection "
                        "(no get_output_embeddings() and no .lm_head); pass head=<the nn.Linear>")
    return out


def fp32_lm_head(model: Any, *, head: Any = None) -> Any:
    """Make ``model``'s output projection compute in float32 (idempotent). Returns ``model``.

    ``head``: the projection module, when ``model.get_output_embeddings()`` / ``model.lm_head`` does not
    find it. Only a plain ``torch.nn.Linear`` (bias or not) is supported: a quantized or otherwise custom
    head raises ``TypeError`` rather than silently staying in its dtype."""
    import torch
    import torch.nn.functional as F

    lm = _head_of(model, head)
    if not isinstance(lm, torch.nn.Linear) or type(lm).forward is not torch.nn.Linear.forward:
        raise TypeError(f"fp32_lm_head: the head is a {type(lm).__module__}.{type(lm).__name__}, not a plain "
                        "torch.nn.Linear (quantized/custom heads are not supported: compute its fp32 logits "
                        "yourself, or turn the engine's head off with VLLM_RLPATCH_FP32_LM_HEAD=0 so both sides match)")
    if not lm.weight.is_floating_point():
        raise TypeError(f"fp32_lm_head: the head's weight is {lm.weight.dtype}, not a floating-point tensor")
    if getattr(lm, _ATTR, None) is not None:
        return model

    def forward(x: torch.Tensor, _lm: torch.nn.Linear = lm) -> torch.Tensor:
        b = _lm.bias
        return F.linear(x.float(), _lm.weight.float(), None if b is None else b.float())

    lm.forward = forward  # instance attribute: the class and other instances are untouched
    setattr(lm, _ATTR, forward)
    return model


def restore_lm_head(model: Any, *, head: Any = None) -> Any:
    """Undo :func:`fp32_lm_head` (no-op if it was not applied). Returns ``model``."""
    lm = _head_of(model, head)
    if getattr(lm, _ATTR, None) is not None:
        del lm.forward
        delattr(lm, _ATTR)
    return model


def is_fp32_lm_head(model: Any, *, head: Any = None) -> bool:
    return getattr(_head_of(model, head), _ATTR, None) is not None
