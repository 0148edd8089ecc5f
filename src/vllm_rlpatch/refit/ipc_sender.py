"""The ``cuda_ipc`` transport's trainer side: the engine reads the trainer's own tensors (same GPU, other
process), so nothing is copied and the bytes are digested once, here.

:class:`IpcSender` sends one handle per tensor (:func:`ipc_handles`); :class:`LayoutSender` sends the one buffer
of an :class:`~vllm_rlpatch.refit.cuda_ipc.EngineLayout` and its views. The worker side is :mod:`.cuda_ipc`.
"""

from __future__ import annotations

import pickle
import time
import weakref
from typing import Any

import torch

from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.sender import Sender, SendJob

_HANDLES: dict[int, tuple[Any, tuple, bytes]] = {}  # id(tensor) -> (weakref, (data_ptr, shape, stride, dtype), handle)


def ipc_handles(tensors: list[tuple[str, torch.Tensor]]) -> list[bytes]:
    """CUDA IPC handles of the trainer's tensors (no copy). Pickled: they travel to the engine's workers on
    this host inside vLLM's RPC (whose msgpack carries bytes), never over a network."""
    from torch.multiprocessing.reductions import reduce_tensor

    out = []
    for name, t in tensors:
        if not t.is_cuda:
            raise P.RefitError(f"cuda_ipc transport: {name} is on {t.device}, not a CUDA device", kind="validation")
        key = id(t)
        hit = _HANDLES.get(key)
        where = (t.data_ptr(), t.shape, t.stride(), t.dtype)  # a handle records the view's shape and strides too
        if hit is not None and hit[0]() is t and hit[1] == where:
            out.append(hit[2])
            continue
        h = pickle.dumps(reduce_tensor(t.detach()))
        try:
            ref = weakref.ref(t, lambda _r, k=key: _HANDLES.pop(k, None))
            _HANDLES[key] = (ref, where, h)
        except TypeError:
            pass
        out.append(h)
    return out


class IpcSender(Sender):
    """One IPC handle per tensor; the digests started when the update was collected are read here."""

    kind = "cuda_ipc"
    digests_early = True
    remembers_tensors = True

    def __init__(self, job: SendJob):
        if job.target.kind == "http":
            raise P.RefitError("transport='cuda_ipc' is not offered over HTTP (IPC handles would need pickle): use "
                               "shm or dist with a URL target, or cuda_ipc with a vllm.LLM/AsyncLLM/Ray target",
                               kind="validation")
        t1 = time.perf_counter()
        self.handles = self._open(job)
        self._stages = {"ipc_handles": time.perf_counter() - t1}
        t1 = time.perf_counter()
        if job.digests is not None:  # started with the update; the wait for the kernel is what is left of it
            for m, d in zip(job.metas, job.digests.result()):
                m.fingerprint, m.nonfinite = d.key, d.nonfinite
        self._stages["fingerprint"] = time.perf_counter() - t1
        torch.cuda.synchronize()

    @classmethod
    def build(cls, job: SendJob) -> "IpcSender":
        return cls(job)

    def _open(self, job: SendJob) -> Any:
        self._spec = {"kind": "cuda_ipc", "handles": job.handles if job.handles is not None
                      else ipc_handles(job.tensors)}
        return self._spec["handles"]

    def spec(self) -> dict[str, Any]:
        return self._spec

    @property
    def stages(self) -> dict[str, float]:
        return self._stages


class LayoutSender(IpcSender):
    """Zero-pack: the one handle of an EngineLayout's buffer, and where each tensor is in it."""

    kind = "cuda_ipc_layout"
    remembers_tensors = False

    def _open(self, job: SendJob) -> Any:
        handle = job.layout.handle()
        self._spec = {"kind": "cuda_ipc_layout", "handle": handle,
                      "views": {n: list(v) for n, v in job.layout.spec_views.items()}}
        return [handle]
