"""The worker side's one registry of transports: a request's ``transport["kind"]`` -> its :class:`Source` class.

The transaction never compares transport names: it asks this registry for the source of a request
(:func:`make_source`), or for its class before opening anything (:func:`source_class`: a refused collective
transfer is still drained), and asks the source itself what it can do. An update template
(``{"kind": "template", "key": ...}``) is no transport of its own: it names the source an earlier update
opened (:func:`template_key`).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.cuda_ipc import IpcSource, LayoutSource
from vllm_rlpatch.refit.dist import DistSource
from vllm_rlpatch.refit.shm import ShmSource
from vllm_rlpatch.refit.source import Source

SOURCES: dict[str, type[Source]] = {cls.kind: cls for cls in (ShmSource, DistSource, IpcSource, LayoutSource)}
TEMPLATE = "template"  # the transport spec's kind of a repeated update: its key names an update template


def template_key(spec: dict[str, Any] | None) -> str | None:
    """The update template a transport spec refers to, or None (a transport of its own)."""
    spec = spec or {}
    return spec.get("key") if spec.get("kind") == TEMPLATE else None


def source_class(spec: dict[str, Any] | None) -> type[Source] | None:
    """The Source class of a transport spec; None for an update template or an unknown kind."""
    return SOURCES.get((spec or {}).get("kind"))


def make_source(req: P.RefitRequest, metas: list[P.TensorMeta], worker: Any, device: torch.device) -> Source:
    """The (unopened) source of ``req``'s transport in ``worker``."""
    cls = source_class(req.transport)
    if cls is None:
        raise P.RefitError(f"unknown transport {(req.transport or {}).get('kind')!r}", kind="validation")
    return cls.for_rank(metas, req.transport or {}, int(getattr(worker, "rank", 0) or 0), device)
