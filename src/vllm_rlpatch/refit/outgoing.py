"""The sender of one update (:class:`Outgoing`): ``named_tensors`` turned into metadata, checked against the
engine's schema, the bytes placed by the chosen transport's sender (:mod:`.transports`) and digested on the way
(a NaN is refused here, before any RPC), and the worker request built (:func:`worker_request`). The same for
``push_weights``, ``push_weights_async``, sessions and fleets; always in the caller's process."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import torch

from vllm_rlpatch.refit import checks
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit import transports
from vllm_rlpatch.refit.caches import CACHE, Sent
from vllm_rlpatch.refit.coordinator import timeline
from vllm_rlpatch.refit.cuda_ipc import EngineLayout
from vllm_rlpatch.refit.options import Options
from vllm_rlpatch.refit.report import RefitReport, build_report
from vllm_rlpatch.refit.sender import Sender, SendJob
from vllm_rlpatch.refit.shm import ShmPool
from vllm_rlpatch.refit.target import Target

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


def worker_request(opts: Options, schema: P.Schema, *, txid: str | None, session: bool) -> dict[str, Any]:
    """The request every worker gets (:mod:`.transaction`); ``transport`` and ``tensors`` are filled in once the
    bytes are placed."""
    return {"txid": txid or uuid.uuid4().hex, "mode": opts.mode, "guarantee": opts.guarantee,
            "partial": opts.partial, "allow_cast": opts.allow_cast, "version": opts.version,
            "inflight": opts.inflight, "verify": opts.verify, "backup": opts.backup, "workers": schema.workers,
            "session": session, "tensors": None, "transport": None}


class Outgoing:
    """One update (or one part of a session) on its way: metadata checked, bytes placed and digested, the
    worker request built. The same for ``push_weights``, ``push_weights_async``, sessions and fleets."""

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
        self.sender_type = transports.choose(opts.transport, self.tensors, tgt, layout=self.layout is not None)
        self.transport = self.sender_type.kind
        # the worker reads this very memory, hashed once, here. The kernel starts now and runs while the
        # metadata is built and checked and the handles are made (the sender reads its result)
        self._digests = checks.PendingDigests([t for _, t in self.tensors]) \
            if self.sender_type.digests_early and opts.verify else None
        self.stages: dict[str, float] = {}
        self.sender: Sender | None = None
        self.host_bytes = 0
        self.cache = CACHE.of(tgt)
        t1 = time.perf_counter()
        # the same tensor objects as the last update to this target: their checked metadata and handles are
        # reused (:class:`~.caches.Sent`); fingerprints and NaN counts are always this update's own
        self._flags = (bool(opts.partial or session), bool(opts.allow_cast), bool(fleet))
        hit = self.cache.sent if self.sender_type.remembers_tensors else None
        self._sent = hit if hit is not None and hit.matches(self.tensors, self._flags, schema) else None
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
        self.req = worker_request(opts, schema, txid=txid, session=session)
        self.first_segment = first_segment
        self.pool = pool  # a fleet's segments (every engine maps them); None: the target's own
        self.fleet = fleet  # one packing for several engines: no per-engine update template
        self.template_key: str | None = None  # an update template (cuda_ipc: the same tensors each step)
        self.template_new = False
        self._static: Any = None

    # -- placing the bytes -------------------------------------------------------------------------------
    def send(self, n_workers: int | None = None, group_timeout_s: float | None = None) -> None:
        """Place the bytes (pack / handles / start the broadcast) and fill the request. Refuses (``refused``)
        a NaN/inf the digest found, before any RPC. ``n_workers``: the receivers of a group transport;
        ``group_timeout_s`` its timeout (default ``timeout_s``)."""
        if self.refused is not None:
            return
        o = self.opts
        self.sender = self.sender_type.build(SendJob(
            target=self.tgt, tensors=self.tensors, metas=self.metas,
            bucket_bytes=int(o.bucket_bytes or P.DEFAULT_BUCKET_BYTES), verify=o.verify,
            timeout_s=group_timeout_s or o.timeout_s, pool=lambda: self.pool or self.cache.shm_pool(),
            n_workers=n_workers, dist_host=o.dist_host, dist_port=o.dist_port, dist_backend=o.dist_backend,
            first_segment=self.first_segment, fleet=self.fleet, layout=self.layout, digests=self._digests,
            handles=self._sent.handles if self._sent is not None else None))
        self._digests = None
        self.stages.update(self.sender.stages)
        self.host_bytes = self.sender.host_bytes
        self.req["transport"] = self.sender.spec()
        if self.sender_type.remembers_tensors:
            self._remember(self.sender.handles)
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
        self.sender.send()
        self.mark("sent")

    def mark(self, name: str) -> None:
        self.marks.append((name, time.perf_counter()))

    def _remember(self, handles: list) -> None:
        """Keep what this update found about its tensors for the next one (:class:`~.caches.Sent`). A trainer
        that updates its tensors in place sends the same names, shapes and IPC handles every step: the engine
        keeps them (an update template) and later requests carry only the digests."""
        hit = self._sent
        if not (self.opts.partial or self.req.get("session") or self.fleet):
            self._static = hit.static if hit is not None and hit.static is not None and hit.handles is handles \
                else hash((tuple((m.name, m.dtype, tuple(m.shape)) for m in self.metas), tuple(handles)))
            known = self.cache.template
            if known is not None and known[0] == self._static:
                self.template_key = known[1]
            else:
                self.template_key, self.template_new = uuid.uuid4().hex, True
                self.req["template"] = self.template_key
        if hit is None:
            hit = self.cache.sent = Sent(self._flags, Sent.records_of(self.tensors), self.schema, _fresh(self.metas))
        hit.handles, hit.static = handles, self._static

    def template_result(self, out: dict[str, Any]) -> bool:
        """Record the template once the engine took it; True if the engine did not know it (resend in full)."""
        if self.template_key is None:
            return False
        if out.get("kind") == P.UNKNOWN_TEMPLATE:
            self.cache.template = None
            return True
        if self.template_new and out.get("ok"):
            self.cache.template = (self._static, self.template_key)
        return False

    def finish_send(self, timeout: float = 10.0) -> dict[str, float]:
        """Wait for bytes still moving (a broadcast), up to ``timeout``; the stages that took."""
        took = self.sender.finish(timeout) if self.sender is not None else {}
        self.stages.update(took)
        return took

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

    @property
    def buckets(self) -> int:
        """The segments or buckets the update travelled in (0 for a transport without them)."""
        return len({m.segment for m in self.metas}) if self.sender_type.packs_segments else 0

    # -- the report --------------------------------------------------------------------------------------
    def report(self, out: dict[str, Any], raise_on_error: bool) -> RefitReport:
        nbytes = sum(m.nbytes for m in self.metas)
        rep = build_report(out, transport=self.transport, mode=self.opts.mode, nbytes=nbytes, n=len(self.metas),
                           seconds=time.perf_counter() - self.t0, stages=self.stages, host_extra=self.host_bytes)
        # the engine's clocks are this host's only for an engine in this process (a Ray actor or a server may
        # run elsewhere: its points stay out)
        rep.timeline = timeline(self.marks + [("report", self.t0 + rep.seconds)],
                                out if self.tgt.kind in ("llm", "async_llm") else {})
        rep.buckets = self.buckets
        if not rep.ok and raise_on_error:
            raise P.RefitError(f"weight update not applied ({rep.state}): {out.get('message')}",
                               kind=out.get("kind", "commit"), state=rep.state, problems=out.get("problems", []),
                               report=rep)
        if rep.ok and rep.state == "committed":
            logger.info("vllm-rlpatch: pushed %d tensors (%.1f MB) via %s/%s (%s) in %.3f s (%.2f GB/s) -> weight "
                        "version %s", rep.tensors, rep.bytes / 1e6, rep.transport, rep.mode, rep.guarantee,
                        rep.seconds, rep.gbps, rep.version)
        return rep
