"""The ``cuda_ipc`` transport: same GPU, other process; the engine reads the trainer's own tensors.

Sender (trainer side, :mod:`.ipc_sender`): one IPC handle per tensor (:func:`ipc_handles`, reused while the
tensor object lives and points at the same memory), the tensors digested with the fused kernel. The trainer and
the worker read the *same* memory, so it is hashed once, there: the worker does not hash the sources again;
after it writes, it digests the destination windows and compares them with these digests.

Zero-pack variant: :class:`EngineLayout`, one trainer buffer laid out like the engine's parameters (one
handle, one copy); :class:`LayoutSource` opens it in the worker.
"""

from __future__ import annotations

import pickle
from typing import Any, Iterable

import torch

from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.ipc_sender import ipc_handles
from vllm_rlpatch.refit.resolve import resolve
from vllm_rlpatch.refit.source import Source

def ipc_unpickle(handle: bytes):
    return pickle.loads(handle)


def ipc_open(handles: list[Any], device: torch.device) -> list[torch.Tensor]:
    """The trainer's tensors, opened in this process; :class:`~vllm_rlpatch.refit.protocol.TransportError` when a
    handle does not open (the trainer freed its tensor or exited, another GPU)."""
    out = []
    for h in handles:
        fn, args = ipc_unpickle(h) if isinstance(h, (bytes, bytearray)) else h
        args = list(args)
        # reduce_tensor records the sender's device index (arg 6); open it on this worker's device
        if device.type == "cuda" and len(args) > 6:
            args[6] = device.index if device.index is not None else torch.cuda.current_device()
        try:
            out.append(fn(*args))
        except RuntimeError as e:
            first = str(e).splitlines()[0] if str(e) else ""
            raise P.TransportError(f"cuda_ipc transport: a CUDA IPC handle did not open in the engine's worker "
                                   f"({type(e).__name__}: {first}): the trainer freed the tensor or exited, or "
                                   "it is on another GPU") from e
    return out


def _ipc_key(handle) -> bytes | None:
    try:
        # torch's reduce_tensor for CUDA: (type, size, stride, offset, storage type, dtype, device, handle,
        # storage size, storage offset, requires_grad, ref counter handle/offset, event handle, sync flag)
        fn, args = ipc_unpickle(handle) if isinstance(handle, (bytes, bytearray)) else handle
        return bytes(args[7]) + str(args[9]).encode() + str(tuple(args[1])).encode() + str(tuple(args[2])).encode() \
            + str(args[3]).encode()
    except Exception:
        return None


# the last update's opened handles, per kind of source (reused while the trainer keeps its tensors)
_IPC_OPEN: dict[bytes, torch.Tensor] = {}
_IPC_LAYOUT: dict[bytes, torch.Tensor] = {}


class IpcSource(Source):
    """The trainer's own tensors (same GPU, other process), opened by handle; no copy, no second hash."""

    kind = "cuda_ipc"
    trusted_digests = True

    def __init__(self, metas, spec: dict[str, Any], device: torch.device):
        self.metas, self.handles, self.device = metas, spec["handles"], device
        self.views: list[torch.Tensor] = []
        self.reused = 0

    def open(self) -> None:
        keep: dict[bytes, torch.Tensor] = {}
        views = []
        for h in self.handles:
            # the trainer sends the very same pickled bytes for a tensor it sent before: a dict hit, no unpickling
            t = _IPC_OPEN.get(h) if isinstance(h, (bytes, bytearray)) else None
            k = h if t is not None else _ipc_key(h)
            if t is None and k is not None:
                t = _IPC_OPEN.get(k)
            if t is None:
                t = ipc_open([h], self.device)[0]
            else:
                self.reused += 1
            if k is not None:
                keep[k] = t
            if isinstance(h, (bytes, bytearray)):
                keep[bytes(h)] = t
            views.append(t)
        _IPC_OPEN.clear()
        _IPC_OPEN.update(keep)
        self.views = views

    def tensors(self):
        for m, t in zip(self.metas, self.views):
            yield m, t

    def close(self) -> None:
        self.views = []


class LayoutSource(Source):
    """Zero-pack CUDA IPC: one buffer laid out like the engine's parameters; the trainer's tensors are views
    into it. One handle, opened once and kept while the trainer keeps it."""

    kind = "cuda_ipc_layout"
    trusted_digests = True

    def __init__(self, metas, spec: dict[str, Any], device: torch.device):
        self.metas, self.spec, self.device = metas, spec, device
        self.buf: torch.Tensor | None = None
        self.reused = 0

    def open(self) -> None:
        h = self.spec["handle"]
        k = _ipc_key(h)
        t = _IPC_LAYOUT.get(k) if k is not None else None
        if t is None:
            t = ipc_open([h], self.device)[0]
            _IPC_LAYOUT.clear()
            if k is not None:
                _IPC_LAYOUT[k] = t
        else:
            self.reused = 1
        self.buf = t

    def tensors(self):
        for m in self.metas:
            size, stride, off = self.spec["views"][m.name]
            yield m, self.buf.view(P.dtype_of(m.dtype)).as_strided(size, stride, off)

    def close(self) -> None:
        self.buf = None


class EngineLayout:
    """Trainer tensors that already live in the engine's layout: one CUDA buffer shaped like the engine's
    parameters (fused qkv/gate_up included), with a view per trainer tensor name. Put your model's
    parameters in the views (``param.data = layout.views[name]``) or copy into them; ``push_weights(target,
    layout)`` then sends one IPC handle and the engine copies the buffer into its parameters: no packing,
    no per-tensor handles. Needs the same GPU, tensor parallel 1, and a copy plan the engine verified on an
    earlier complete update (the first ``push_weights`` of ordinary tensors records it)."""

    def __init__(self, target: Any, device: Any = None):
        tgt = resolve(target)
        if tgt.kind == "http":
            raise P.RefitError("EngineLayout needs CUDA IPC, which is not offered over HTTP", kind="validation")
        descs = tgt.call("rlpatch_refit_layout")
        if len(descs) != 1:
            raise P.RefitError(f"EngineLayout needs tensor parallel 1 (the engine has {len(descs)} workers)",
                               kind="validation")
        d = descs[0]
        if not d.get("ok"):
            raise P.RefitError(f"no engine layout: {d.get('message')} (push one complete update of ordinary "
                               "tensors first: it records and verifies the copy plan)", kind="validation")
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.dtype = P.dtype_of(d["dtype"])
        self.buffer = torch.zeros(int(d["numel"]), dtype=self.dtype, device=dev)
        self.spec_views = {n: tuple(v) for n, v in d["views"].items()}
        self.views = {n: self.buffer.as_strided(size, stride, off) for n, (size, stride, off) in
                      self.spec_views.items()}
        self._handle = None

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return sorted(self.views.items())

    def copy_from(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in (named_tensors.items() if isinstance(named_tensors, dict) else named_tensors):
            self.views[name].copy_(t)

    def handle(self):
        if self._handle is None:
            self._handle = ipc_handles([("buffer", self.buffer)])[0]
        return self._handle
