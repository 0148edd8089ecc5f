"""The worker side of a transport: where an update's bytes are in this worker.

A transport module (:mod:`.shm`, :mod:`.dist`, :mod:`.cuda_ipc`) holds its sender (trainer side) and its
:class:`Source` subclass (worker side); :mod:`.sources` is the one registry that picks the class a request
names. The transaction asks the source what it is (``collective``, ``trusted_digests``, :meth:`Source.streams`),
never the transport's name.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from vllm_rlpatch.refit import protocol as P


class Source:
    """``tensors()`` yields ``(meta, tensor)`` in update order. ``streaming``: bytes arrive once, in order
    (cannot be read twice). ``trusted_digests``: the trainer digested these very bytes (same memory), so the
    worker need not read them to check them. ``collective``: one transfer every receiver takes part in (a
    broadcast), so a worker that refuses the update still drains it (:meth:`drain`). Open and receive failures
    raise :class:`~vllm_rlpatch.refit.protocol.TransportError`."""

    kind = ""  # the transport's name in a request's spec (the registry's key)
    streaming = False
    trusted_digests = False
    collective = False
    extra_host_bytes = 0
    pinned = False  # kept open across updates (an update template's source)

    @classmethod
    def for_rank(cls, metas: list[P.TensorMeta], spec: dict[str, Any], worker_rank: int,
                 device: torch.device) -> "Source":
        """The source of worker ``worker_rank`` (its rank in its engine) for a request's transport ``spec``."""
        return cls(metas, spec, device)

    def open(self) -> None: ...

    def receive_all(self) -> None:
        """Have every byte here before the write (a no-op where the bytes are in place: shared memory, IPC)."""

    def streams(self) -> bool:
        """Can the bytes be written into the weights as they arrive (``mode="direct"``), received once?"""
        return False

    def tensors(self) -> Iterator[tuple[P.TensorMeta, torch.Tensor]]:
        raise NotImplementedError

    def drain(self) -> int:
        """Take part in the rest of a collective transfer without keeping the bytes; the transfers drained."""
        return 0

    def close(self) -> None: ...
