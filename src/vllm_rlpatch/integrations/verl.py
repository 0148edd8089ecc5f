"""verl: one line moves its rollout's weight sync onto :func:`vllm_rlpatch.refit.push_weights`.

    import vllm_rlpatch.integrations.verl; vllm_rlpatch.integrations.verl.install()   # in the trainer worker

verl 0.9 syncs weights from each trainer worker through ``ServerAdapter.update_weights``
(``verl/workers/rollout/vllm_rollout/vllm_rollout.py``, 0.9.1 line 210): it starts ``update_weights_from_ipc``
on the vLLM workers (its ``vLLMColocateWorkerExtension``, ``vllm_rollout/utils.py`` line 243), streams buckets
over ZMQ (``BucketedWeightSender``: CUDA IPC, shared memory elsewhere), each bucket into the model's
``load_weights`` (``utils.py`` line 405), then ``process_weights_after_loading`` once, then the server's
``clear_kv_cache``. :func:`install` replaces that method on ``ServerAdapter``: the rank that owns the server
pushes the same ``(name, tensor)`` stream with ``push_weights`` (validated, checksummed, one guarantee level,
a version bump the prefix cache and the completions' version spans follow) and keeps the
:class:`~vllm_rlpatch.refit.RefitReport` on the rollout (``rollout.rlpatch_report``); the other ranks drain
their generator (verl's generators gather sharded parameters collectively, so every rank must iterate).

Refused, before anything is read or written (:class:`IntegrationError`, the engine unchanged): an unknown verl
release (``VLLM_RLPATCH_VERL_ANY_VERSION=1`` accepts one), a ``delta_flush`` payload (verl's sparse deltas,
not full tensors), and a LoRA sync (``peft_config``: verl sends adapters to vLLM's ``add_lora``, not to the
base weights). :func:`uninstall` restores verl's own method.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from typing import Any

from packaging.version import Version

from vllm_rlpatch.integrations.support import IntegrationError, require_framework
from vllm_rlpatch.refit import RefitReport, push_weights
from vllm_rlpatch.refit.ray import RayTarget
from vllm_rlpatch.refit.target import is_ray_handle

KNOWN = ">=0.9.1,<0.10"
ALLOW_ENV = "VLLM_RLPATCH_VERL_ANY_VERSION"
MODULE = "verl.workers.rollout.vllm_rollout.vllm_rollout"
# verl's vLLMHttpServer actor keeps its engine client here (vllm_async_server.py, 0.9.1 line 532).
ENGINE_ATTR = "engine"
_ORIGINAL = "__rlpatch_original__"


def _server_adapter() -> Any:
    return importlib.import_module(MODULE).ServerAdapter


def install(**push_kw: Any) -> Version:
    """Route ``ServerAdapter.update_weights`` onto ``push_weights`` (keyword arguments go to every push, e.g.
    ``guarantee=``, ``inflight=``). Returns the verl release; idempotent."""
    version = require_framework("verl", "verl", KNOWN, allow_env=ALLOW_ENV)
    cls = _server_adapter()
    original = getattr(cls.update_weights, _ORIGINAL, cls.update_weights)

    async def update_weights(self: Any, weights: Any, global_steps: int | None = None,
                             wire_format: str = "named_tensors", **kwargs: Any) -> RefitReport | None:
        return await sync(self, weights, global_steps=global_steps, wire_format=wire_format, push_kw=push_kw,
                          **kwargs)

    setattr(update_weights, _ORIGINAL, original)
    update_weights.__doc__ = "verl's rollout sync, moved onto vllm_rlpatch.refit.push_weights."
    cls.update_weights = update_weights
    return version


def uninstall() -> None:
    """Put verl's own ``ServerAdapter.update_weights`` back."""
    cls = _server_adapter()
    original = getattr(cls.update_weights, _ORIGINAL, None)
    if original is not None:
        cls.update_weights = original


def installed() -> bool:
    return getattr(_server_adapter().update_weights, _ORIGINAL, None) is not None


def refuse_unsafe(wire_format: str, kwargs: dict[str, Any]) -> None:
    """Raise for a sync ``push_weights`` cannot make safe; nothing has been read or written."""
    if wire_format != "named_tensors":
        raise IntegrationError(f"verl adapter: wire_format={wire_format!r} carries sparse deltas, not full "
                               "tensors; push_weights takes whole updates (uninstall() to use verl's own path)")
    if kwargs.get("peft_config"):
        raise IntegrationError("verl adapter: a LoRA sync (peft_config) goes to vLLM's add_lora, not to the base "
                               "weights push_weights writes (uninstall() to use verl's own path)")
    unknown = sorted(set(kwargs) - {"peft_config", "base_sync_done"})
    if unknown:
        raise IntegrationError(f"verl adapter: update_weights got arguments it does not know: {unknown}")


def engine_of(server_handle: Any) -> Any:
    """The push target behind verl's server handle: its Ray actor (the engine in ``engine``), or an object
    holding the engine in ``engine`` (a vllm.LLM or AsyncLLM)."""
    if is_ray_handle(server_handle):
        return RayTarget(server_handle, engine_attr=ENGINE_ATTR)
    engine = getattr(server_handle, ENGINE_ATTR, None)
    if engine is None:
        raise IntegrationError(f"verl adapter: the server handle {type(server_handle).__name__} is neither a Ray "
                               f"actor handle nor an object with an {ENGINE_ATTR!r} attribute")
    return engine


async def _materialize(weights: Any) -> Any:
    if inspect.isasyncgen(weights) or hasattr(weights, "__aiter__"):
        return [item async for item in weights]
    return weights


async def sync(rollout: Any, weights: Any, *, global_steps: int | None = None,
               wire_format: str = "named_tensors", push_kw: dict[str, Any] | None = None,
               **kwargs: Any) -> RefitReport | None:
    """One verl sync through ``push_weights``; the report also lands in ``rollout.rlpatch_report``."""
    refuse_unsafe(wire_format, kwargs)
    if not rollout._ensure_server_handle():
        for _ in await _materialize(weights):
            pass
        return None
    target = engine_of(rollout.server_handle)
    items = await _materialize(weights)
    report = await asyncio.to_thread(push_weights, target, items, **(push_kw or {}))
    if global_steps is not None and hasattr(rollout.server_handle, "set_global_steps"):
        await rollout.server_handle.set_global_steps.remote(global_steps)
    rollout.rlpatch_report = report
    return report
