"""The entry points: ``push_weights`` / ``push_weights_async`` / ``weight_version``, one weight-update API for
every vLLM the plugin supports; a list (or tuple) of targets is a fleet (:mod:`.fleet`).

The work splits in two halves that run where the data and the engine are:

* the **sender** (always in the caller's process, :class:`~.outgoing.Outgoing`, one list of steps for the sync
  and the async call, :mod:`.push`): turns ``named_tensors`` into metadata, checks it against the engine's
  schema, and moves the bytes with the chosen transport (:mod:`.transports`), digesting them on the way: a NaN
  is refused here, before any RPC;
* the **coordinator** (:mod:`.coordinator`, in the process that owns the engine's front end: the caller's for
  a ``vllm.LLM`` or ``AsyncLLM``, the actor's for a Ray handle, the API server's for a URL): runs the worker
  RPCs (:mod:`.transaction`) and decides what the engine holds afterwards.

The names this module held before the split (``Options``, ``Outgoing``, ``RefitReport``, ``build_report``,
``collect``, ``schema_for``, ...) are importable from here still.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable

import torch

from vllm_rlpatch.refit import push
from vllm_rlpatch.refit.caches import schema_for, schema_for_async
from vllm_rlpatch.refit.fleet import FleetReport, fleet_versions, push_fleet
from vllm_rlpatch.refit.options import INFLIGHT, MODES, TRANSPORTS, Options
from vllm_rlpatch.refit.outgoing import Outgoing, collect
from vllm_rlpatch.refit.report import RefitReport, build_report
from vllm_rlpatch.refit.resolve import resolve
from vllm_rlpatch.refit.target import AsyncTarget, is_async_llm

__all__ = ["INFLIGHT", "MODES", "TRANSPORTS", "Options", "Outgoing", "RefitReport", "build_report", "collect",
           "push_weights", "push_weights_async", "schema_for", "schema_for_async", "weight_version"]


def push_weights(target: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], *, transport: str = "auto",
                 mode: str = "atomic", guarantee: str = "auto", inflight: str | None = None,
                 version: int | None = None, partial: bool = False, allow_cast: bool = False,
                 bucket_bytes: int | None = None, verify: bool = True, dist_host: str | None = None,
                 dist_port: int = 0, dist_backend: str | None = None, timeout_s: float = 300.0,
                 backup: str = "auto", raise_on_error: bool = True) -> RefitReport | FleetReport:
    """Push new weights (trainer/Hugging Face naming) into a vLLM engine.

    ``target``: a ``vllm.LLM``, an ``AsyncLLM`` (from another thread than its loop; on the loop use
    :func:`push_weights_async`), a Ray actor handle hosting one, or ``"http://host:port"`` of ``vllm serve``
    started with the plugin. ``mode``: ``atomic`` (default; with a ``guarantee``) or ``direct`` (written straight
    in, checked after; on failure the engine refuses to generate until a good update lands). ``guarantee``:
    ``auto`` (default: ``rollback`` when a bounded backup fits, else ``validate-then-write`` where the write is
    plain copies, else refused before writing), ``rollback`` or ``validate-then-write`` (see
    :mod:`vllm_rlpatch.refit.transaction`). ``inflight``: what happens to requests running at the update
    (``refuse``, ``abort``, ``keep``, ``recompute``; default the engine's ``VLLM_RLPATCH_INFLIGHT``).
    ``version``: the weight version the engine reports afterwards (default: previous + 1). ``partial``: allow a
    subset of whole layers. ``backup``: where a rollback backup goes (``auto``, ``device``, ``host``). Raises
    :class:`RefitError` (``raise_on_error``) when the update did not land; the report is on the exception.

    ``target`` may also be a list (or tuple) of engines: a fleet, updated all-or-nothing (:mod:`vllm_rlpatch.refit.fleet`),
    which returns a :class:`FleetReport`; ``timeout_s`` then bounds each phase and is the engines' commit deadline.
    """
    opts = Options(transport=transport, mode=mode, guarantee=guarantee, inflight=inflight, version=version,
                   partial=partial, allow_cast=allow_cast, bucket_bytes=bucket_bytes, verify=verify,
                   dist_host=dist_host, dist_port=dist_port, dist_backend=dist_backend, timeout_s=timeout_s,
                   backup=backup)
    opts.validate()
    if isinstance(target, (list, tuple)):
        return push_fleet(list(target), named_tensors, opts, raise_on_error)
    tgt = resolve(target)
    return push.run_sync(tgt, push.steps(tgt, named_tensors, opts, raise_on_error))


async def push_weights_async(target: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], **kw
                             ) -> RefitReport | FleetReport:
    """:func:`push_weights` from an event loop: for an ``AsyncLLM`` from its own loop, with the same sender,
    transports and guarantees. Other targets, and a fleet, run in a worker thread (an ``AsyncLLM`` of this
    loop in a fleet is driven on the loop, which stays free while it waits)."""
    if isinstance(target, (list, tuple)) or not is_async_llm(target):
        return await asyncio.to_thread(push_weights, target, named_tensors, **kw)
    raise_on_error = kw.pop("raise_on_error", True)
    try:
        opts = Options(**kw)
    except TypeError as e:
        raise TypeError(f"push_weights_async: {e}") from None
    opts.validate()
    tgt = AsyncTarget(target)
    return await push.run_async(tgt, push.steps(tgt, named_tensors, opts, raise_on_error))


def weight_version(target: Any) -> int | list[int]:
    """The engine's current weight version (0 = the weights it started with), read from its workers. For a list
    of engines each one's (a list), raising :class:`~vllm_rlpatch.refit.protocol.RefitError` if they disagree."""
    if isinstance(target, (list, tuple)):
        return fleet_versions(list(target))
    return resolve(target).version()
