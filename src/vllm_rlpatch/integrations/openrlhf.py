"""OpenRLHF: its per-parameter weight broadcast moved onto :func:`vllm_rlpatch.refit.push_weights`, in one line.

OpenRLHF 0.11.2 builds each vLLM engine with ``worker_extension_cls="openrlhf.trainer.ray.vllm_worker_wrap
.WorkerWrap"`` (``openrlhf/trainer/ray/vllm_engine.py``, line 267). The one changed line names this module's
class instead::

    "worker_extension_cls": "vllm_rlpatch.integrations.openrlhf.WorkerWrap",

What OpenRLHF does on its own (``openrlhf/trainer/ray/ppo_actor.py``, ``broadcast_to_vllm``, lines 409-493): it
fires ``reset_prefix_cache`` on every engine first (line 415), then for every parameter of the policy calls the
engine's ``update_weight(name, dtype, shape, empty_cache=count == num_params)`` (line 427) and broadcasts the
tensor from trainer rank 0 (line 436); in the worker, ``WorkerWrap.update_weight``
(``openrlhf/trainer/ray/vllm_worker_wrap.py``, lines 32-50) receives it into a new ``cuda`` tensor and calls
``self.model_runner.model.load_weights(weights=[(name, weight)])``. With the plugin each of those direct
``load_weights`` calls is made strict (a fused layer is processed once complete; a tied head follows its
embedding); the engine still counts one weight update per completed layer.

:class:`WorkerWrap` keeps OpenRLHF's process-group setup (its own ``init_process_group`` runs) and its receive
(the same broadcast into a tensor on the worker's device), but stages each received tensor instead of loading
it. The parameter OpenRLHF marks as the last (``empty_cache=True``) ends the sync: the staged tensors go into the
engine as one :func:`~vllm_rlpatch.refit.push_weights` from inside the worker (one validated, versioned update
with a guarantee level and a report; a NaN is refused before anything is written), and the plugin's prefix-cache
policy keeps KV of older weights out.

Refused (:class:`~vllm_rlpatch.integrations.support.IntegrationError`, nothing staged or written): an OpenRLHF
release this adapter does not know (``VLLM_RLPATCH_OPENRLHF_ANY_VERSION=1`` accepts it at your risk); an engine
whose plugin is off (``push_weights`` needs it); tensor parallelism (each rank would commit alone); a tensor whose
dtype is not the engine's (OpenRLHF asserts the same); a parameter sent twice in one sync. A refused call drops
the tensors its sync staged so far (the engine holds the weights of the last sync). A sync that
``push_weights`` refuses raises :class:`~vllm_rlpatch.refit.RefitError` with the engine unchanged, and the staged
tensors are dropped.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

import torch

from vllm_rlpatch import registry
from vllm_rlpatch.integrations.support import IntegrationError, require_framework
from vllm_rlpatch.refit import RefitReport, push_weights
from vllm_rlpatch.refit.coordinator import coordinate, rpc_error_to_refit, run_sync
from vllm_rlpatch.refit.target import Target
from vllm_rlpatch.refit.worker_ext import RLPatchWorkerExtension

# The OpenRLHF releases whose WorkerWrap / broadcast_to_vllm this adapter was written against and run with.
KNOWN = ">=0.11.2,<0.12"
ALLOW_ENV = "VLLM_RLPATCH_OPENRLHF_ANY_VERSION"
THEIRS = "openrlhf.trainer.ray.vllm_worker_wrap"  # OpenRLHF's worker extension module


def require_openrlhf() -> None:
    """Raise :class:`IntegrationError` unless the installed OpenRLHF is a release this adapter knows."""
    require_framework("OpenRLHF", "openrlhf", KNOWN, allow_env=ALLOW_ENV)


class WorkerTarget(Target):
    """This worker as a ``push_weights`` target: the update's worker RPCs are calls of its own methods."""

    kind = "openrlhf-worker"

    def __init__(self, worker: Any):
        self.worker = worker

    def rpc(self, method: str, args: tuple, kwargs: dict) -> list:
        return [getattr(self.worker, method)(*args, **kwargs)]

    def call(self, method: str, *args: Any, **kwargs: Any) -> list:
        return self.rpc(method, args, kwargs)

    def describe(self) -> list[dict[str, Any]]:
        return self.rpc("rlpatch_refit_describe", (), {})

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        # the engine core reads this worker's new version after OpenRLHF's update_weight RPC returns (every RPC
        # that may change weights is followed by that check), so the front end needs no call from here
        try:
            return run_sync(coordinate(req), self.rpc)
        except Exception as e:  # noqa: BLE001 - a worker step raised: nothing was committed
            err = rpc_error_to_refit(e, "refit")
            return {"ok": False, "state": "unchanged", "kind": err.kind, "message": str(err), "problems": []}

    def version(self) -> int:
        return max(int(v) for v in self.rpc("rlpatch_weight_version", (), {}))


class OpenRLHFSync:
    """One worker's staged sync: the tensors received since the last one ended, and the reports so far."""

    def __init__(self, worker: Any, push_kwargs: dict[str, Any]):
        self.target = WorkerTarget(worker)
        self.push_kwargs = dict(push_kwargs)
        self.staged: dict[str, torch.Tensor] = {}
        self.reports: list[RefitReport] = []
        self.seconds: list[float] = []
        self.started: float | None = None

    def stage(self, name: str, weight: torch.Tensor) -> None:
        if name in self.staged:
            raise IntegrationError(f"OpenRLHF: {name!r} was sent twice in one sync: which tensor the engine should "
                                   "hold is ambiguous (nothing written; this sync's staged tensors are dropped)")
        if self.started is None:
            self.started = time.perf_counter()
        self.staged[name] = weight

    def commit(self) -> RefitReport:
        tensors, self.staged = list(self.staged.items()), {}
        t0, self.started = self.started or time.perf_counter(), None
        report = push_weights(self.target, tensors, **self.push_kwargs)
        self.seconds.append(time.perf_counter() - t0)
        self.reports.append(report)
        return report


def refusal(worker: Any, dtype: Any) -> str | None:
    """Why this ``update_weight`` call cannot move onto ``push_weights`` safely, or None."""
    if not registry.applied_names():
        return ("the plugin is not active in this engine (VLLM_RLPATCH_ENABLED=0 or not installed): push_weights "
                "needs it; use OpenRLHF's own WorkerWrap")
    tp = int(getattr(worker.parallel_config, "tensor_parallel_size", 1) or 1)
    if tp != 1:
        return (f"tensor_parallel_size={tp}: each rank would commit its shard alone, so the engine could hold two "
                "weight versions; only one worker per engine is handled")
    if dtype != worker.model_config.dtype:
        return f"a {dtype} tensor for a {worker.model_config.dtype} engine (OpenRLHF asserts the same)"
    return None


class WorkerWrap(RLPatchWorkerExtension):
    """OpenRLHF's ``WorkerWrap`` with its sync moved onto ``push_weights`` (name it as the engine's
    ``worker_extension_cls``). ``rlpatch_openrlhf_sync()`` returns this worker's :class:`OpenRLHFSync`."""

    rlpatch_openrlhf_push_kwargs: dict[str, Any] = {}

    def rlpatch_openrlhf_sync(self) -> OpenRLHFSync:
        sync = self.__dict__.get("_rlpatch_openrlhf_sync")
        if sync is None:
            sync = self._rlpatch_openrlhf_sync = OpenRLHFSync(self, self.rlpatch_openrlhf_push_kwargs)
        return sync

    def init_process_group(self, master_address, master_port, rank_offset, world_size, group_name, backend="nccl",
                           use_ray=False):
        """OpenRLHF's own (``vllm_worker_wrap.py``, lines 2-30), after the version check."""
        require_openrlhf()
        theirs = importlib.import_module(THEIRS).WorkerWrap
        return theirs.init_process_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                         backend=backend, use_ray=use_ray)

    def update_weight(self, name, dtype, shape, empty_cache=False):
        """Receive one parameter as OpenRLHF does (a broadcast from trainer rank 0, ``vllm_worker_wrap.py``,
        lines 40-46, into a tensor on this worker's device) and stage it; ``empty_cache`` (OpenRLHF's mark of
        the last parameter) pushes the sync."""
        self.rlpatch_openrlhf_check(dtype)
        weight = torch.empty(shape, dtype=dtype, device=self.device)
        if self._model_update_with_ray:
            importlib.import_module("ray.util.collective").broadcast(weight, 0, group_name=self._model_update_group)
        else:
            stream = torch.cuda.current_stream() if weight.is_cuda else None
            self._model_update_group.broadcast(weight, src=0, stream=stream)
        return self.rlpatch_openrlhf_receive(name, weight, empty_cache)

    def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles=None, empty_cache=False):
        """OpenRLHF's colocated path (``vllm_worker_wrap.py``, lines 52-70): the tensor from the trainer's CUDA
        IPC handle for this GPU, staged like a broadcast one."""
        self.rlpatch_openrlhf_check(dtype)
        gpu = importlib.import_module("openrlhf.trainer.ray.utils").get_physical_gpu_id()
        func, args = ipc_handles[gpu]
        args = list(args)
        args[6] = self.device.index
        weight = func(*args).clone()  # the trainer's buffer is its own after this call returns
        torch.cuda.synchronize()
        return self.rlpatch_openrlhf_receive(name, weight, empty_cache)

    def rlpatch_openrlhf_check(self, dtype) -> None:
        """Refuse an update_weight call before anything is received, staged or written (the sync it belongs to is
        dropped: it cannot end correctly)."""
        try:
            require_openrlhf()
            why = refusal(self, dtype)
            if why is not None:
                raise IntegrationError(f"OpenRLHF: {why}")
        except IntegrationError:
            self.rlpatch_openrlhf_sync().staged.clear()
            raise

    def rlpatch_openrlhf_receive(self, name: str, weight: torch.Tensor, last: bool) -> dict[str, Any] | None:
        """Stage one received tensor; ``last`` pushes every staged tensor as one update (its report as data)."""
        sync = self.rlpatch_openrlhf_sync()
        try:
            sync.stage(name, weight)
        except IntegrationError:
            sync.staged.clear()
            raise
        if not last:
            return None
        return sync.commit().as_dict()

    def rlpatch_openrlhf_stage(self, name: str, weight: torch.Tensor, last: bool = False) -> dict[str, Any] | None:
        """The sync without OpenRLHF's process group: one tensor as the broadcast would deliver it (a replay of
        ``update_weight`` where no group can be built, e.g. on CPU), checked and staged the same way."""
        self.rlpatch_openrlhf_check(weight.dtype)
        return self.rlpatch_openrlhf_receive(name, weight.to(self.device), last)

    def rlpatch_openrlhf_reports(self) -> list[dict[str, Any]]:
        sync = self.rlpatch_openrlhf_sync()
        return [dict(r.as_dict(), sync_seconds=s) for r, s in zip(sync.reports, sync.seconds)]


__all__ = ["ALLOW_ENV", "KNOWN", "OpenRLHFSync", "WorkerTarget", "WorkerWrap", "require_openrlhf"]
