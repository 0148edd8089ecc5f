"""The transports by name: the one place that turns a transport's name into its sender class.

``push_weights``, ``push_weights_async``, sessions, fleets and the HTTP routes ask here; everything else reads
the chosen :class:`~.sender.Sender` class's attributes. The choices, in order:

1. an :class:`~.cuda_ipc.EngineLayout`: its own transport (``cuda_ipc_layout``);
2. a transport named by the caller: that one;
3. ``auto``: on this host, ``cuda_ipc`` for CUDA tensors (not to a URL) and ``shm`` otherwise; an engine on
   another host, ``dist``.

A fleet (:func:`for_fleet`) takes one transport for every engine: with an engine on another host, ``dist``;
with a URL among them, ``shm`` (or ``dist`` if asked for).
"""

from __future__ import annotations

from typing import Any

from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.dist import DistSender
from vllm_rlpatch.refit.ipc_sender import IpcSender, LayoutSender
from vllm_rlpatch.refit.sender import Sender
from vllm_rlpatch.refit.shm import ShmSender
from vllm_rlpatch.refit.target import Target, is_loopback

AUTO = "auto"
SENDERS: dict[str, type[Sender]] = {c.kind: c for c in (ShmSender, DistSender, IpcSender, LayoutSender)}
CHOICES = (AUTO, ShmSender.kind, DistSender.kind, IpcSender.kind)  # what a caller may name


def sender_for(name: str, target: Target) -> type[Sender]:
    try:
        return SENDERS[name]
    except KeyError:
        raise P.RefitError(f"transport {name!r} is not available for a {target.kind} target",
                           kind="validation") from None


def choose(requested: str, tensors: list[tuple[str, Any]], target: Target, layout: bool = False) -> type[Sender]:
    """The sender of one update to ``target`` (steps 1-3 above)."""
    if layout:
        return LayoutSender
    if requested != AUTO:
        return sender_for(requested, target)
    on_cuda = any(t.is_cuda for _, t in tensors)
    if target.same_host():
        return IpcSender if on_cuda and target.kind != "http" else ShmSender
    return DistSender


def in_sessions(requested: str) -> bool:
    """Whether a refit session's parts can travel by ``requested`` (``auto`` picks one that can)."""
    return requested == AUTO or SENDERS[requested].in_sessions


def for_fleet(requested: str, *, remote: str | None, url: str | None, dist_host: str | None) -> str:
    """One transport for every engine of a fleet: the bytes are placed once. ``remote``: the name of an engine on
    another host (None: all on this one); ``url``: the name of an engine behind a URL (None: none)."""
    if remote is not None:
        if requested != AUTO and SENDERS[requested].same_host_only:
            raise P.RefitError(f"{remote} is on another host: transport={requested!r} maps this host's memory; a "
                               "fleet with engines on other hosts is one broadcast group: transport='dist' (or "
                               "'auto') with dist_host= an address of this host they can reach", kind="validation")
        if not dist_host or is_loopback(dist_host):
            raise P.RefitError(f"{remote} is on another host: the fleet's broadcast group would be hosted at "
                               f"{dist_host or '127.0.0.1'} (loopback), out of its reach: pass dist_host= an "
                               "address of this host that every engine can reach", kind="validation")
        return DistSender.kind
    if url is not None:
        if requested != AUTO and not SENDERS[requested].offered_over_http:
            raise P.RefitError(f"{url}: transport='cuda_ipc' is not offered over HTTP (IPC handles would need "
                               "pickle): use shm (or auto) for a fleet with a URL", kind="validation")
        return requested if requested != AUTO else ShmSender.kind
    return requested


def http_refusal(spec: dict[str, Any], client_on_loopback: bool) -> str | None:
    """Why a refit request that came over HTTP cannot be taken (None: it can)."""
    kind = spec.get("kind")
    sender = SENDERS.get(kind) if isinstance(kind, str) else None
    if sender is None or not sender.offered_over_http:
        return f"transport {kind!r} is not accepted over HTTP (shm from this host, or dist)"
    if sender.same_host_only and not client_on_loopback:
        return f"the {kind} transport needs the trainer on the server's host"
    return None
