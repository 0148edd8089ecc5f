"""The worker side of a transport: where an update's bytes are in this worker.

A transport module (:mod:`.shm`, :mod:`.dist`, :mod:`.cuda_ipc`) holds its sender (trainer side) and its
:class:`Source` subclass (worker side); :func:`vllm_rlpatch.refit.transaction.make_source` picks the one a request names.
"""

from __future__ import annotations

from typing import Iterator

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
