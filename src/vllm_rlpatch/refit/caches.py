"""What the sender keeps about each engine between updates (:class:`SenderCache`, one per process: ``CACHE``).

Per engine (:class:`TargetState`): its schema, the shared-memory segments its updates are packed into, what the
last ``cuda_ipc`` update found about its tensors (:class:`Sent`) and the update template the engine holds.

The key is the engine: its front-end object for an engine in this process, its Ray actor handle, or its URL
(:func:`engine_of`); a fleet's segments are kept under the fleet's own key (its engines together). An engine
object is held weakly: its state goes when it does, and an object that later gets its address is a new engine.
Only an engine held that way keeps its schema: the server behind a URL may restart with another model.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

import torch

from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.shm import ShmPool
from vllm_rlpatch.refit.target import AsyncTarget, Target


@dataclasses.dataclass
class Sent:
    """What the last ``cuda_ipc`` update to an engine found about its tensors, reused when the next update
    passes the very same tensor objects (a trainer that updates its parameters in place): their metadata,
    already checked against ``schema``, their IPC handles and the update template's hash. Only weak
    references to the tensors: the cache never keeps a trainer's memory alive."""

    flags: tuple
    records: list  # per tensor: name, weak reference, address, dtype, shape, strides
    schema: Any
    metas: list[P.TensorMeta]
    handles: list[bytes] | None = None
    static: Any = None

    @staticmethod
    def records_of(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple]:
        return [(n, weakref.ref(t), t.data_ptr(), t.dtype, t.shape, t.stride()) for n, t in tensors]

    def matches(self, tensors: list[tuple[str, torch.Tensor]], flags: tuple, schema: Any) -> bool:
        """``tensors`` are the very objects it saw, each at the same address with the same dtype, shape and
        strides, under the same schema and options that change the metadata check. One pass that stops at the
        first difference (an 8B model's 291 tensors are read on every update)."""
        if self.schema is not schema or self.flags != flags or len(self.records) != len(tensors):
            return False
        for (n, ref, ptr, dtype, shape, stride), (n2, t) in zip(self.records, tensors):
            if n != n2 or ref() is not t or t.data_ptr() != ptr or t.dtype != dtype or t.shape != shape \
                    or t.stride() != stride:
                return False
        return True


@dataclasses.dataclass
class TargetState:
    """One engine's entry. ``weak``: it follows a live engine object (its schema may be kept)."""

    weak: bool
    schema: P.Schema | None = None
    sent: Sent | None = None
    template: tuple[int, str] | None = None  # (static hash, template key) the engine holds
    pool: ShmPool | None = None

    def shm_pool(self) -> ShmPool:
        """The segments this engine's updates are packed into, reused across them."""
        if self.pool is None:
            self.pool = ShmPool()
        return self.pool

    def keep_schema(self, desc: list[dict[str, Any]]) -> P.Schema:
        """The schema from the workers' description (one entry per worker)."""
        s = P.Schema.from_dict(desc[0]["schema"])
        s.workers = len(desc)
        if self.weak:
            self.schema = s
        return s


def engine_of(tgt: Target) -> Any:
    """What identifies the engine behind ``tgt``: its front end, its URL or its Ray actor handle."""
    return tgt.front if tgt.front is not None else (getattr(tgt, "url", None) or getattr(tgt, "handle", tgt))


class SenderCache:
    def __init__(self) -> None:
        self._states: dict[Any, tuple[Any, TargetState]] = {}  # key -> (weak reference or None, state)
        self._lock = threading.Lock()  # a fleet asks for its engines' schemas from one thread each

    def of(self, tgt: Target) -> TargetState:
        obj = engine_of(tgt)
        if isinstance(obj, (str, int)):
            return self.of_key(obj)
        key = id(obj)
        with self._lock:
            ref, st = self._states.get(key, (None, None))
            if st is not None and (ref is None or ref() is obj):
                return st
            try:
                ref = weakref.ref(obj, lambda _r, k=key: self._forget(k, _r))
            except TypeError:  # not weakly referenceable: kept by address, as long as the process lives
                ref = None
            st = TargetState(weak=ref is not None)
            self._states[key] = (ref, st)
            return st

    def of_key(self, key: Any) -> TargetState:
        """The state kept under a plain key (a URL; a fleet's engines together)."""
        with self._lock:
            hit = self._states.get(key)
            if hit is None:
                hit = self._states[key] = (None, TargetState(weak=False))
            return hit[1]

    def _forget(self, key: Any, ref: Any) -> None:
        # the engine object is gone (its segments stay registered for unlinking at exit, as before)
        if self._states.get(key, (None,))[0] is ref:
            self._states.pop(key, None)

    def drop_pool(self, key: Any) -> None:
        """Forget (and unlink) the segments kept under ``key``: the next update packs into new ones."""
        hit = self._states.get(key)
        if hit is not None and hit[1].pool is not None:
            pool, hit[1].pool = hit[1].pool, None
            pool.close()

    def close_pools(self) -> None:
        """Unlink every kept segment now (a process that exits without running its exit handlers)."""
        for _, st in list(self._states.values()):
            if st.pool is not None:
                st.pool.close()

    def clear(self) -> None:
        with self._lock:
            self._states.clear()


CACHE = SenderCache()


def schema_for(tgt: Target) -> P.Schema:
    st = CACHE.of(tgt)
    return st.schema or st.keep_schema(tgt.describe())


async def schema_for_async(tgt: AsyncTarget) -> P.Schema:
    st = CACHE.of(tgt)
    return st.schema or st.keep_schema(await tgt.describe_async())
