"""The worker extension the plugin installs (``EngineArgs.worker_extension_cls``).

vLLM mixes the extension class into every worker and asserts that none of its attribute names exists on
the Worker, so every method here is prefixed ``rlpatch_`` (vLLM 0.32 has ``update_weights``,
``start_weight_update``, ``reset_weights``, ... on the Worker itself). Call them with
``llm.collective_rpc("rlpatch_<name>")``.

Composition: when the user (or their RL framework) passes its own ``worker_extension_cls``, the
``worker_extension`` patch replaces it with ``vllm_rlpatch.refit.worker_ext.with:<their qualname with : for .>``.
vLLM resolves that name in the worker through this module's ``__getattr__``, which builds one class
deriving from theirs and ours (theirs first, so their methods win). If their class already derives from
ours, it is used as is, so nothing runs twice.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import time
from typing import Any

from vllm_rlpatch import _role, registry
from vllm_rlpatch.hooks import mixed, weights, workerctx
from vllm_rlpatch.patches.worker_extension import COMPOSE_PREFIX, QUALNAME, compose_qualname  # noqa: F401
from vllm_rlpatch.refit import memory, transaction
from vllm_rlpatch.versions import vllm_info

logger = logging.getLogger("vllm.rlpatch")


class RLPatchWorkerExtension:
    """Methods available on every worker of an engine started with the plugin."""

    def rlpatch_ping(self) -> dict[str, Any]:
        """Prove the plugin is live in this worker: pid, role, vLLM version, applied patches."""
        return {"pid": os.getpid(), "role": _role.get(), "vllm": vllm_info().raw_version,
                "applied": registry.applied_names()}

    def rlpatch_status(self) -> list[dict[str, Any]]:
        return [s.as_dict() for s in registry.status()]

    def rlpatch_weight_version(self) -> int:
        """Completed weight updates this worker has seen (reload_weights, native updates, load_weights).
        Finishes a direct-load session a trainer left open first (raises if it left a layer half-loaded)."""
        weights.settle(self)
        return weights.weight_version(self)

    def rlpatch_weight_state(self, rest: bool = False) -> dict[str, Any]:
        """This worker's weight version and mixed-weights state, as data (never raises for mixed weights):
        what the engine core asks after every RPC that may change weights, and the front end after an update
        RPC failed. ``rest``: the engine core asks it after an update's abort or a commit that failed (the
        update's last RPC), while no request is scheduled: this worker's RPC reader then waits idle instead of
        spinning for a second (:func:`~vllm_rlpatch.hooks.workerctx.rest_rpc_reader`)."""
        if rest:
            workerctx.rest_rpc_reader()
        partial: list[str] = []
        try:
            # a fused layer whose parts arrive one RPC at a time stays open: ``partial`` names it (the engine
            # core then refuses to generate until it is complete)
            partial = weights.settle(self, raise_mixed=False, keep_partial=True)
        except Exception as e:  # noqa: BLE001 - closing a direct-load session failed: the state below says what
            # it left
            logger.debug("vllm-rlpatch: settling the weights before the weight state failed: %s: %s",
                         type(e).__name__, e)
        m = mixed.worker_state()
        return {"version": weights.weight_version(self), "mixed": m.as_dict() if m is not None else None,
                "partial": partial}

    # ---- the refit API (vllm_rlpatch.refit); see vllm_rlpatch.refit.worker for the protocol
    def rlpatch_refit_describe(self) -> dict[str, Any]:
        return transaction.for_worker(self).describe()

    def rlpatch_refit_prepare(self, request: dict[str, Any], inflight: str | None = None) -> dict[str, Any]:
        weights.settle(self, raise_mixed=False)  # an update is what repairs mixed weights
        return transaction.for_worker(self).prepare(request)

    def rlpatch_refit_commit(self, txid: str, version: int | None = None, release: bool = True,
                             inflight: str | None = None, request: dict[str, Any] | None = None,
                             final: bool = True, rest: bool = False) -> dict[str, Any]:
        """``rest`` (the engine core adds it while no request is scheduled): a commit that ends the update
        (``release``) rests this worker's RPC reader (:func:`~vllm_rlpatch.hooks.workerctx.rest_rpc_reader`)."""
        t_enter = time.perf_counter()
        if request is not None:
            weights.settle(self, raise_mixed=False)
        try:
            out = transaction.for_worker(self).commit(txid, version=version, release=release, request=request,
                                                      final=final)
            # this process's monotonic clock: the front end splits its round trip with it (coordinator.rpc_split)
            out["clock"] = {"enter": t_enter, "exit": time.perf_counter()}
            return out
        finally:
            if release and rest:  # the update's last RPC (else a release or an abort follows)
                workerctx.rest_rpc_reader()

    def rlpatch_refit_inject_fault(self, where: str) -> dict[str, Any]:
        """Testing only (``VLLM_RLPATCH_FAULT_INJECTION=1``): arm a fault in this worker's next refit."""
        return transaction.for_worker(self).arm_fault(where)

    def rlpatch_refit_abort(self, txid: str) -> dict[str, Any]:
        return transaction.for_worker(self).abort(txid)

    def rlpatch_refit_align_version(self, version: int) -> int:
        """Raise this worker's weight version to ``version`` (a fleet update that rolled back leaves the engines
        that had committed one version ahead of those that never wrote; this brings the others level). The
        weights do not change; a version never goes down."""
        if weights.weight_version(self) < int(version):
            weights.fire(self, "rlpatch_refit_align", "worker", version=int(version))
        return weights.weight_version(self)

    def rlpatch_refit_release(self, txid: str, rest: bool = False) -> dict[str, Any]:
        try:
            return transaction.for_worker(self).release(txid)
        finally:  # a fleet's last RPC (read-only: no weight-state RPC follows it); ``rest`` as in commit
            if rest:
                workerctx.rest_rpc_reader()

    def rlpatch_refit_layout(self) -> dict[str, Any]:
        """The engine layout for zero-pack CUDA IPC updates (``vllm_rlpatch.refit.EngineLayout``)."""
        return transaction.for_worker(self).layout()

    def rlpatch_memory(self) -> dict[str, Any]:
        """This worker's device memory (``vllm-rlpatch kv-pin``): device free/total, PyTorch's allocator,
        the sleep-mode pools by tag (weights, kv_cache, ...; the bytes a wake-up maps again) and the
        KV cache vLLM allocated."""
        return memory.worker_memory(self)

    def rlpatch_fingerprint(self) -> dict[str, Any]:
        """Bit-level fingerprint of every parameter and buffer of this worker's model (and a digest)."""
        return transaction.for_worker(self).fingerprint()


def _resolve(qualname: str) -> type:
    module_name, _, name = qualname.rpartition(".")
    if not module_name:
        raise ValueError(f"worker_extension_cls {qualname!r} is not a 'module.Class' qualname")
    return getattr(importlib.import_module(module_name), name)


@functools.lru_cache(maxsize=None)
def composed(user_qualname: str) -> type:
    user_cls = _resolve(user_qualname)
    if isinstance(user_cls, type) and issubclass(user_cls, RLPatchWorkerExtension):
        return user_cls
    clash = sorted(a for a in vars(RLPatchWorkerExtension) if not a.startswith("__") and hasattr(user_cls, a))
    if clash:
        raise TypeError(f"worker_extension_cls {user_qualname} defines {clash}, reserved by vllm-rlpatch's "
                        "worker extension; rename them or set VLLM_RLPATCH_WORKER_EXTENSION=0")
    return type(f"RLPatchWith_{user_cls.__name__}", (user_cls, RLPatchWorkerExtension),
                {"__module__": __name__, "__qualname__": COMPOSE_PREFIX + user_qualname.replace(".", ":")})


def __getattr__(name: str) -> Any:
    if name.startswith(COMPOSE_PREFIX):
        return composed(name[len(COMPOSE_PREFIX):].replace(":", "."))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
