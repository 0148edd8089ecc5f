"""The sender of one update (:class:`Outgoing`): ``named_tensors`` turned into metadata, checked against the
engine's schema, the bytes moved with the chosen transport (:mod:`.shm`, :mod:`.dist`, :mod:`.cuda_ipc`) and
digested on the way (a NaN is refused here, before any RPC), and the worker request built. The same for
``push_weights``, ``push_weights_async``, sessions and fleets; always in the caller's process."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
import weakref
from typing import Any

import torch

from vllm_rlpatch.refit import checks
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.coordinator import timeline
from vllm_rlpatch.refit.cuda_ipc import EngineLayout, ipc_handles
from vllm_rlpatch.refit.dist import DistSender
from vllm_rlpatch.refit.options import Options
from vllm_rlpatch.refit.report import RefitReport, build_report
from vllm_rlpatch.refit.shm import ShmPool, ShmSender
from vllm_rlpatch.refit.target import AsyncTarget, Target, is_loopback

logger = logging.getLogger("vllm.rlpatch")

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def collect(named_tensors: Any) -> list[tuple[str, torch.Tensor]]:
    items = list(named_tensors.items()) if isinstance(named_tensors, dict) else list(named_tensors)
    out = []
    for i, item in enumerate(items):
        if type(item) is tuple and len(item) == 2 and type(item[0]) is str and type(item[1]) in _PLAIN:
            if item[1].is_meta:
                raise P.RefitError(f"{item[0]}: a meta tensor has no data", kind="validation")
            out.append(item)  # a plain tensor or parameter (not a DTensor): the checks below in one step
            continue
        if not (isinstance(item, tuple) and len(item) == 2):
            raise P.RefitError(f"named_tensors[{i}] is a {type(item).__name__}, not a (name, tensor) pair",
                               kind="validation")
        name, t = item
        if not isinstance(name, str):
            raise P.RefitError(f"named_tensors[{i}]: name {name!r} is not a string", kind="validation")
        if not isinstance(t, torch.Tensor):
            raise P.RefitError(f"{name}: a {type(t).__name__}, not a torch.Tensor", kind="validation")
        if getattr(t, "is_meta", False):
            raise P.RefitError(f"{name}: a meta tensor has no data", kind="validation")
        if type(t).__name__ == "DTensor" or hasattr(t, "_local_tensor"):
            raise P.RefitError(f"{name}: a DTensor/FSDP shard; gather the full tensor (full_tensor()) first",
                               kind="validation")
        out.append((name, t))  # the object itself: a CUDA IPC handle is reused while it lives
    return out


def _metas(tensors: list[tuple[str, torch.Tensor]]) -> list[P.TensorMeta]:
    return [P.TensorMeta(n, P.dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size()) for n, t in tensors]


def _fresh(metas: list[P.TensorMeta]) -> list[P.TensorMeta]:
    """New records of the same tensors (no placement, no digests): what an update writes its digests into."""
    return [P.TensorMeta(m.name, m.dtype, m.shape, m.nbytes) for m in metas]


@dataclasses.dataclass
class _Sent:
    """What the last ``cuda_ipc`` update to a target found about its tensors, reused when the next update
    passes the very same tensor objects (a trainer that updates its parameters in place): their metadata,
    already checked against ``schema``, their IPC handles and the update template's hash. Only weak
    references to the tensors: the cache never keeps a trainer's memory alive."""

    flags: tuple
    records: list  # per tensor: name, weak reference, address, dtype, shape, strides
    schema: Any
    metas: list[P.TensorMeta]
    handles: list[bytes] | None = None
    static: Any = None


_SENT: dict[Any, _Sent] = {}


def _records(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple]:
    return [(n, weakref.ref(t), t.data_ptr(), t.dtype, t.shape, t.stride()) for n, t in tensors]


def _sent_for(key: Any, tensors: list[tuple[str, torch.Tensor]], flags: tuple, schema: Any) -> _Sent | None:
    """The cached entry when ``tensors`` are the very objects it saw, each at the same address with the same
    dtype, shape and strides, under the same schema and options that change the metadata check; else None.
    One pass that stops at the first difference (an 8B model's 291 tensors are read on every update)."""
    hit = _SENT.get(key)
    if hit is None or hit.schema is not schema or hit.flags != flags or len(hit.records) != len(tensors):
        return None
    for (n, ref, ptr, dtype, shape, stride), (n2, t) in zip(hit.records, tensors):
        if n != n2 or ref() is not t or t.data_ptr() != ptr or t.dtype != dtype or t.shape != shape \
                or t.stride() != stride:
            return None
    return hit


_SCHEMAS: "weakref.WeakKeyDictionary[Any, P.Schema]" = weakref.WeakKeyDictionary()
_TEMPLATES: dict[Any, tuple[int, str]] = {}  # per target: (static hash, template key) the engine holds


def _tkey(tgt: Target) -> Any:
    k = _key(tgt)
    return k if isinstance(k, (str, int)) else id(k)
_POOLS: dict[Any, ShmPool] = {}  # per target: shared-memory segments reused across its updates


def _key(tgt: Target) -> Any:
    return tgt.front if tgt.front is not None else (getattr(tgt, "url", None) or getattr(tgt, "handle", tgt))


def pool_for(tgt: Target) -> ShmPool:
    k = _key(tgt)
    return pool_for_key(id(k) if not isinstance(k, (str, int)) else k)


def drop_pool(k: Any) -> None:
    """Forget (and unlink) a pool's segments: the next update packs into new ones."""
    pool = _POOLS.pop(k, None)
    if pool is not None:
        pool.close()


def pool_for_key(k: Any) -> ShmPool:
    pool = _POOLS.get(k)
    if pool is None:
        pool = _POOLS[k] = ShmPool()
    return pool


def _cache_schema(tgt: Target, desc: list[dict[str, Any]]) -> P.Schema:
    s = P.Schema.from_dict(desc[0]["schema"])
    s.workers = len(desc)  # type: ignore[attr-defined]
    try:
        _SCHEMAS[_key(tgt)] = s
    except TypeError:
        pass
    return s


def _cached_schema(tgt: Target) -> P.Schema | None:
    try:
        return _SCHEMAS.get(_key(tgt))
    except TypeError:
        return None


def schema_for(tgt: Target) -> P.Schema:
    return _cached_schema(tgt) or _cache_schema(tgt, tgt.describe())


async def schema_for_async(tgt: AsyncTarget) -> P.Schema:
    return _cached_schema(tgt) or _cache_schema(tgt, await tgt.describe_async())


def _pick_transport(transport: str, tensors, target: Target) -> str:
    if transport != "auto":
        return transport
    on_cuda = any(t.is_cuda for _, t in tensors)
    if target.same_host():
        return "cuda_ipc" if on_cuda and target.kind != "http" else "shm"
    return "dist"


class Outgoing:
    """One update (or one part of a session) on its way: metadata checked, bytes placed and digested, the
    worker request built. The same for ``push_weights``, ``push_weights_async`` and sessions."""

    def __init__(self, tgt: Target, named_tensors: Any, opts: Options, schema: P.Schema, *,
                 txid: str | None = None, session: bool = False, first_segment: int = 0,
                 pool: ShmPool | None = None, fleet: bool = False):
        self.t0 = time.perf_counter()
        self.marks: list[tuple[str, float]] = [("start", self.t0)]
        self.tgt, self.opts = tgt, opts
        self.layout = named_tensors if isinstance(named_tensors, EngineLayout) else None
        self.tensors = collect(self.layout.named_tensors() if self.layout is not None else named_tensors)
        self.mark("collected")
        if not self.tensors:
            raise P.RefitError("the update contains no tensors", kind="validation")
        self.transport = "cuda_ipc_layout" if self.layout is not None else _pick_transport(opts.transport,
                                                                                           self.tensors, tgt)
        # cuda_ipc: the worker reads this very memory, hashed once, here. The kernel starts now and runs while
        # the metadata is built and checked and the handles are made (send() reads its result)
        self._digests = checks.PendingDigests([t for _, t in self.tensors]) \
            if self.transport in ("cuda_ipc", "cuda_ipc_layout") and opts.verify else None
        self.stages: dict[str, float] = {}
        self.sender: Any = None
        self.host_bytes = 0
        t1 = time.perf_counter()
        # cuda_ipc with the same tensor objects as the last update to this target: their checked metadata and
        # handles are reused (:class:`_Sent`); fingerprints and NaN counts are always this update's own
        self._sent: _Sent | None = None
        self._flags = (bool(opts.partial or session), bool(opts.allow_cast), bool(fleet))
        if self.transport == "cuda_ipc":
            self._sent = _sent_for(_tkey(tgt), self.tensors, self._flags, schema)
        if self._sent is not None:
            # digests are written into the records: then this update's own copies; without digests the cached
            # records themselves, never written to (291 copies cost an 8B update ~0.2 ms)
            self.metas = _fresh(self._sent.metas) if self._digests is not None else self._sent.metas
            probs: list[dict[str, Any]] = []
        else:
            self.metas = _metas(self.tensors)
            probs = P.validate_metadata(self.metas, schema, partial=opts.partial or session,
                                        allow_cast=opts.allow_cast)
        self.schema = schema
        self.stages["validate_metadata"] = time.perf_counter() - t1
        self.mark("metadata")
        self.refused: dict[str, Any] | None = None
        if probs:
            self.refused = {"ok": False, "state": "unchanged", "kind": "validation", "message": P.summarize(probs),
                            "problems": probs}
        self.req = {"txid": txid or uuid.uuid4().hex, "mode": opts.mode, "guarantee": opts.guarantee,
                    "partial": opts.partial, "allow_cast": opts.allow_cast, "version": opts.version,
                    "inflight": opts.inflight, "verify": opts.verify, "backup": opts.backup,
                    "workers": getattr(schema, "workers", None), "session": session, "tensors": None,
                    "transport": None}
        self.first_segment = first_segment
        self.pool = pool  # a fleet's segments (every engine maps them); None: the target's own
        self.fleet = fleet  # one packing for several engines: no per-engine update template
        self.template_key: str | None = None  # an update template (cuda_ipc: the same tensors each step)
        self.template_new = False
        self._static: Any = None

    # -- placing the bytes -------------------------------------------------------------------------------
    def send(self, n_workers: int | None = None, group_timeout_s: float | None = None) -> None:
        """Place the bytes (pack / handles / start the broadcast) and fill the request. Refuses (``refused``)
        a NaN/inf the digest found, before any RPC. ``dist``: ``n_workers`` receivers; ``group_timeout_s`` the
        process group's timeout (default ``timeout_s``)."""
        if self.refused is not None:
            return
        o, tr = self.opts, self.transport
        bucket = int(o.bucket_bytes or P.DEFAULT_BUCKET_BYTES)
        if tr == "shm":
            if not self.tgt.same_host():
                raise P.RefitError("transport='shm' needs the trainer and the engine on one host; this target is on "
                                   "another host: use transport='dist' (or 'auto')", kind="validation")
            self.sender = ShmSender(self.tensors, self.metas, bucket, verify=o.verify,
                                    pool=self.pool or pool_for(self.tgt),
                                    first_segment=self.first_segment)
            self.stages["pack"] = self.sender.seconds_pack
            self.host_bytes = self.sender.nbytes
            self.req["transport"] = self.sender.spec()
        elif tr == "dist":
            if not self.fleet and not self.tgt.same_host() and (not o.dist_host or is_loopback(o.dist_host)):
                raise P.RefitError(f"the engine is on another host: a dist group hosted at {o.dist_host or '127.0.0.1'} "
                                   "(loopback) is out of its reach: pass dist_host= an address of this host that "
                                   "the engine can reach", kind="validation")
            backend = o.dist_backend or ("nccl" if any(t.is_cuda for _, t in self.tensors) else "gloo")
            self.sender = DistSender(self.tensors, self.metas, bucket, n_workers=n_workers or 1,
                                     host=o.dist_host or "127.0.0.1", port=o.dist_port, backend=backend,
                                     timeout_s=group_timeout_s or o.timeout_s, verify=o.verify)
            self.stages["fingerprint"] = self.sender.seconds_fingerprint
            self.req["transport"] = self.sender.spec()
        elif tr in ("cuda_ipc", "cuda_ipc_layout"):
            if self.tgt.kind == "http":
                raise P.RefitError("transport='cuda_ipc' is not offered over HTTP (IPC handles would need pickle): use "
                                   "shm or dist with a URL target, or cuda_ipc with a vllm.LLM/AsyncLLM/Ray target",
                                   kind="validation")
            t1 = time.perf_counter()
            if tr == "cuda_ipc":
                hit = self._sent
                handles = hit.handles if hit is not None and hit.handles is not None else ipc_handles(self.tensors)
                self.req["transport"] = {"kind": "cuda_ipc", "handles": handles}
                self._template(handles)
                if hit is None:
                    hit = _SENT[_tkey(self.tgt)] = _Sent(
                        self._flags, _records(self.tensors), self.schema, _fresh(self.metas))
                hit.handles, hit.static = handles, self._static
            else:
                self.req["transport"] = {"kind": "cuda_ipc_layout", "handle": self.layout.handle(),
                                         "views": {n: list(v) for n, v in self.layout.spec_views.items()}}
            self.stages["ipc_handles"] = time.perf_counter() - t1
            t1 = time.perf_counter()
            if self._digests is not None:  # started in __init__; the wait for the kernel is what is left of it
                for m, d in zip(self.metas, self._digests.result()):
                    m.fingerprint, m.nonfinite = d.key, d.nonfinite
                self._digests = None
            self.stages["fingerprint"] = time.perf_counter() - t1
            torch.cuda.synchronize()
        else:
            raise P.RefitError(f"transport {tr!r} is not available for a {self.tgt.kind} target", kind="validation")
        bad = [m for m in self.metas if m.nonfinite]
        if bad:
            probs = [P.problem("nonfinite", m.name, f"{m.name}: {m.nonfinite} values are NaN or infinite")
                     for m in bad]
            self.refused = {"ok": False, "state": "unchanged", "kind": "validation", "message": P.summarize(probs),
                            "problems": probs}
            return
        if self.template_key is not None and not self.template_new:
            # the same tensors as the last update: the engine has their metadata and open handles
            self.req["transport"] = {"kind": "template", "key": self.template_key}
            self.req["fingerprints"] = [m.fingerprint for m in self.metas]
            self.req["nonfinite"] = [m.nonfinite for m in self.metas]
        else:
            self.req["tensors"] = [m.as_dict() for m in self.metas]
        if tr == "dist":
            self.sender.start()
        self.mark("sent")

    def mark(self, name: str) -> None:
        self.marks.append((name, time.perf_counter()))

    def _template(self, handles: list) -> None:
        """A trainer that updates its tensors in place sends the same names, shapes and IPC handles every step:
        the engine keeps them (an update template) and later requests carry only the digests."""
        if self.opts.partial or self.req.get("session") or self.fleet:
            return
        hit = self._sent
        self._static = hit.static if hit is not None and hit.static is not None and hit.handles is handles else \
            hash((tuple((m.name, m.dtype, tuple(m.shape)) for m in self.metas), tuple(handles)))
        known = _TEMPLATES.get(_tkey(self.tgt))
        if known is not None and known[0] == self._static:
            self.template_key = known[1]
        else:
            self.template_key, self.template_new = uuid.uuid4().hex, True
            self.req["template"] = self.template_key

    def template_result(self, out: dict[str, Any]) -> bool:
        """Record the template once the engine took it; True if the engine did not know it (resend in full)."""
        if self.template_key is None:
            return False
        if out.get("kind") == "template":
            _TEMPLATES.pop(_tkey(self.tgt), None)
            return True
        if self.template_new and out.get("ok"):
            _TEMPLATES[_tkey(self.tgt)] = (self._static, self.template_key)
        return False

    def finish_send(self, timeout: float = 10.0) -> None:
        if self.transport == "dist" and self.sender is not None:
            self.sender.join(timeout=timeout)
            if self.sender.running:
                return  # still waiting in the group (a receiver never joined): it ends on the group's timeout
            self.stages["group"] = self.sender.seconds_group
            self.stages["send"] = self.sender.seconds_send
            if self.sender.error is not None:
                logger.warning("vllm-rlpatch: dist sender reported %r", self.sender.error)

    def close(self) -> None:
        if self.transport == "shm" and self.sender is not None:
            self.sender.close()

    # -- the report --------------------------------------------------------------------------------------
    def report(self, out: dict[str, Any], raise_on_error: bool) -> RefitReport:
        nbytes = sum(m.nbytes for m in self.metas)
        rep = build_report(out, transport=self.transport, mode=self.opts.mode, nbytes=nbytes, n=len(self.metas),
                           seconds=time.perf_counter() - self.t0, stages=self.stages, host_extra=self.host_bytes)
        # the engine's clocks are this host's only for an engine in this process (a Ray actor or a server may
        # run elsewhere: its points stay out)
        rep.timeline = timeline(self.marks + [("report", self.t0 + rep.seconds)],
                                out if self.tgt.kind in ("llm", "async_llm") else {})
        if self.transport in ("shm", "dist"):
            rep.buckets = len({m.segment for m in self.metas})
        if not rep.ok and raise_on_error:
            raise P.RefitError(f"weight update not applied ({rep.state}): {out.get('message')}",
                               kind=out.get("kind", "commit"), state=rep.state, problems=out.get("problems", []),
                               report=rep)
        if rep.ok and rep.state == "committed":
            logger.info("vllm-rlpatch: pushed %d tensors (%.1f MB) via %s/%s (%s) in %.3f s (%.2f GB/s) -> weight "
                        "version %s", rep.tensors, rep.bytes / 1e6, rep.transport, rep.mode, rep.guarantee,
                        rep.seconds, rep.gbps, rep.version)
        return rep

