"""vllm-rlpatch: make the vLLM rollout engine correct and fast for RL.

Installed next to vLLM, the ``vllm.general_plugins`` entry point (:func:`vllm_rlpatch.plugin.register`)
applies the patches in :mod:`vllm_rlpatch.patches` in every vLLM process. This module stays import-light:
it is imported by the ``.pth`` start-up hook in every interpreter of the environment.
"""

from __future__ import annotations

__version__ = "0.1.0"


def status() -> "list[dict]":
    """One record per patch: ``name``, ``state`` (applied / disabled / not_needed / unsupported / failed),
    ``reason`` and the spec's range, ``fixed_in``, default and env toggle."""
    from vllm_rlpatch import plugin, registry

    plugin.compose()
    return [s.as_dict() for s in registry.status()]


def weight_version(engine) -> int:
    """Completed weight updates seen for ``engine`` (a ``vllm.LLM``, ``LLMEngine`` or ``AsyncLLM``)."""
    from vllm_rlpatch.hooks import weights

    return weights.weight_version(engine)


def on_weight_update(callback):
    """Subscribe ``callback(event, engine)`` to weight-update events; returns an unsubscribe function."""
    from vllm_rlpatch.hooks import weights

    return weights.on_weight_update(callback)
