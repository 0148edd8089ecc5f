"""The worker side of a transport: where an update's bytes are in this worker.

A transport module (:mod:`.shm`, :mod:`.dist`, :mod:`.cuda_ipc`) holds its sender (trainer side) and its
:class:`Source` subclass (worker side); :func:`make_source` picks the one a request names.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from vllm_rlpatch.refit import protocol as P


class Source:
    """``tensors()`` yields ``(meta, tensor)`` in update order. ``streaming``: bytes arrive once, in order
    (cannot be read twice). ``trusted_digests``: the trainer digested these very bytes (same memory), so the
    worker need not read them to check them. ``device_resident``: the tensors are on the engine's device."""

    streaming = False
    trusted_digests = False
    extra_host_bytes = 0
    pinned = False  # kept open across updates (an update template's source)

    def open(self) -> None: ...

    def tensors(self) -> Iterator[tuple[P.TensorMeta, torch.Tensor]]:
        raise NotImplementedError

    def close(self) -> None: ...


def make_source(req: dict[str, Any], metas: list[P.TensorMeta], worker: Any, device: torch.device) -> Source:
    tr = req["transport"]
    kind = tr["kind"]
    if kind == "shm":
        from vllm_rlpatch.refit.shm import ShmSource

        return ShmSource(metas, tr)
    if kind == "dist":
        from vllm_rlpatch.refit.dist import DistSource

        rank = int(tr.get("rank_base", 1)) + int(getattr(worker, "rank", 0) or 0)
        return DistSource(metas, tr, rank, device)
    if kind == "cuda_ipc":
        from vllm_rlpatch.refit.cuda_ipc import IpcSource

        return IpcSource(metas, tr, device)
    if kind == "cuda_ipc_layout":
        from vllm_rlpatch.refit.cuda_ipc import LayoutSource

        return LayoutSource(metas, tr, device)
    raise P.RefitError(f"unknown transport {kind!r}", kind="validation")
