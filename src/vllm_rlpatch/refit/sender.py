"""The trainer side of a transport: how an update's bytes reach the engine's workers.

The mirror of :mod:`.source`: a transport module (:mod:`.shm`, :mod:`.dist`, :mod:`.ipc_sender` for
``cuda_ipc``) holds its :class:`Sender` subclass, and :mod:`.transports` picks the one an update uses, by name,
in one place. What the rest of the sender needs to know about a transport is a class attribute here, never
its name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from vllm_rlpatch.refit import checks
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.target import Target


@dataclasses.dataclass
class SendJob:
    """What a sender is built from: one update's tensors and their metadata (the sender writes the digests
    into ``metas``), where they go, and the options that concern the transport."""

    target: Target
    tensors: list[tuple[str, torch.Tensor]]
    metas: list[P.TensorMeta]
    bucket_bytes: int
    verify: bool
    timeout_s: float  # a process group's timeout (dist)
    pool: Callable[[], Any]  # the shared-memory pool the segments come from (shm), made when first asked for
    n_workers: int | None = None  # receivers (dist)
    dist_host: str | None = None
    dist_port: int = 0
    dist_backend: str | None = None
    first_segment: int = 0  # a session's later part leases the segments after the earlier parts' (shm)
    fleet: bool = False  # one sender for several engines
    layout: Any = None  # an EngineLayout (cuda_ipc_layout)
    digests: checks.PendingDigests | None = None  # started when the update was collected (cuda_ipc)
    handles: list[bytes] | None = None  # these very tensors' IPC handles, from the last update (cuda_ipc)


class Sender:
    """One update's bytes on their way. Built by :meth:`build` (which places the bytes: packs, digests, makes
    handles); then ``spec()`` is the request's ``transport`` entry, ``send()`` starts what moves after the
    request is built, ``finish(timeout)`` waits for it and returns the stages it took, ``close()`` frees what
    this sender alone holds. ``stages``: seconds of the placing steps; ``host_bytes``: host memory it added.

    What the transport is like (class attributes):
    ``streams_bytes``: the bytes move after the request went out, in the background (``send``/``finish``);
    ``packs_segments``: the bytes travel in numbered segments or buckets (the report counts them);
    ``needs_receivers``: the engines' worker count sizes a group (a fleet gives each engine a rank offset);
    ``same_host_only``: the engine maps this host's memory; ``offered_over_http``: a URL target takes it;
    ``in_sessions``: a refit session's parts can use it; ``digests_early``: the digests start as soon as the
    update is collected (the worker reads this very memory); ``remembers_tensors``: the same tensor objects as
    the last update reuse its checked metadata and handles, and an update template.
    """

    kind = "?"
    streams_bytes = False
    packs_segments = False
    needs_receivers = False
    same_host_only = True
    offered_over_http = False
    in_sessions = True
    digests_early = False
    remembers_tensors = False

    @classmethod
    def build(cls, job: SendJob) -> "Sender":
        raise NotImplementedError

    def spec(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def stages(self) -> dict[str, float]:
        return {}

    @property
    def host_bytes(self) -> int:
        return 0

    @property
    def segments(self) -> int:
        """How many segments this update leased (a session's next part starts after them)."""
        return 0

    def missing_ranks(self) -> list[int]:
        """Receivers that never joined (a group transport)."""
        return []

    def send(self) -> None: ...

    def finish(self, timeout: float) -> dict[str, float]:
        return {}

    def close(self) -> None: ...
