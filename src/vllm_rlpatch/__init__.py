"""vllm-rlpatch: make the vLLM rollout engine correct and fast for RL.

Installed next to vLLM, the ``vllm.general_plugins`` entry point (:func:`vllm_rlpatch.plugin.register`)
applies the patches in :mod:`vllm_rlpatch.patches` in every vLLM process. This module stays import-light:
it is imported by the ``.pth`` start-up hook in every interpreter of the environment.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__", "on_weight_update", "status", "updates_seen", "weight_version"]


def status() -> "list[dict]":
    """One record per patch: ``name``, ``state`` (applied / disabled / not_needed / unsupported / failed),
    ``reason`` and the spec's range, ``fixed_in``, default and env toggle."""
    from vllm_rlpatch import plugin, registry

    plugin.compose()
    return [s.as_dict() for s in registry.status()]


def updates_seen(engine) -> int:
    """Completed weight updates this process saw for ``engine`` (a ``vllm.LLM``, ``LLMEngine`` or ``AsyncLLM``),
    counted by its front end. The engine's own weight version, read from its workers (also of a Ray actor or a
    server), is :func:`vllm_rlpatch.refit.weight_version`."""
    from vllm_rlpatch.hooks import weights

    return weights.weight_version(engine)


def weight_version(engine) -> int:
    """Deprecated: :func:`updates_seen` (the name meant another thing than ``vllm_rlpatch.refit.weight_version``)."""
    import warnings  # not at the top: the start-up hook imports this module in every interpreter

    warnings.warn("vllm_rlpatch.weight_version is deprecated: use vllm_rlpatch.updates_seen (the updates this "
                  "process saw), or vllm_rlpatch.refit.weight_version (the engine's version, read from its workers)",
                  DeprecationWarning, stacklevel=2)
    return updates_seen(engine)


def on_weight_update(callback):
    """Subscribe ``callback(event, engine)`` to weight-update events; returns an unsubscribe function."""
    from vllm_rlpatch.hooks import weights

    return weights.on_weight_update(callback)
