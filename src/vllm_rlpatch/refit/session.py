"""One update in several calls: ``refit_session``.

Trainers that stream their weights (layer by layer, or one FSDP/Megatron bucket at a time, to bound memory)
send one update as several parts::

    with refit_session(llm) as s:            # begin
        for bucket in gather_buckets(model):
            s.push(bucket)                   # validated, written (backed up first for rollback)
    # commit: one version bump; an exception inside the block aborts instead
    s.report.version

or ``s = refit_session(llm).begin(); s.push(...); s.commit()`` (``s.abort()``).

The whole session is one transaction with one guarantee (decided at the first part, reported on every part):
``rollback`` keeps a backup of everything any part wrote until the commit, so an abort (or a failure in a
later part) restores the weights from before the session; ``validate-then-write`` has no backup, so an abort
after a part was written leaves ``mixed``. A fused layer may be split across parts (vLLM's layerwise reload
buffers it until all its parts arrived); at the commit every layer must be complete. While a session is open
the engine generates nothing: its first part needs an idle engine (``inflight="abort"`` finishes running
requests), and new requests are refused until the commit or the abort.

Targets: a ``vllm.LLM`` or an ``AsyncLLM`` driven from another thread (the session's RPCs are separate calls
into the engine's process); Ray handles and URLs take whole updates (``push_weights``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Iterable

import torch

from vllm_rlpatch.hooks import mixed
from vllm_rlpatch.refit import coordinator as C
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit import transports
from vllm_rlpatch.refit.caches import schema_for
from vllm_rlpatch.refit.options import Options
from vllm_rlpatch.refit.outgoing import Outgoing
from vllm_rlpatch.refit.report import RefitReport, build_report
from vllm_rlpatch.refit.coordinator import rpc_error_to_refit
from vllm_rlpatch.refit.resolve import resolve
from vllm_rlpatch.refit.target import AsyncTarget, LocalTarget

_SESSION_STATE = "a multi-call weight update (refit_session) is in progress"


class RefitSession:
    def __init__(self, target: Any, *, transport: str = "auto", guarantee: str = "auto", mode: str = "atomic",
                 inflight: str | None = None, version: int | None = None, allow_cast: bool = False,
                 bucket_bytes: int | None = None, verify: bool = True, timeout_s: float = 300.0,
                 backup: str = "auto"):
        self.opts = Options(transport=transport, mode=mode, guarantee=guarantee, inflight=inflight,
                            version=version, allow_cast=allow_cast, bucket_bytes=bucket_bytes, verify=verify,
                            timeout_s=timeout_s, backup=backup)
        self.opts.validate()
        if not transports.in_sessions(self.opts.transport):
            raise P.RefitError("refit_session supports the shm and cuda_ipc transports (dist: one push_weights)",
                               kind="validation")
        self.tgt = resolve(target)
        if not isinstance(self.tgt, (LocalTarget, AsyncTarget)):
            raise P.RefitError(f"refit_session needs a vllm.LLM or an AsyncLLM in this process (got a {self.tgt.kind} "
                               "target): send whole updates there with push_weights", kind="validation")
        self.txid = uuid.uuid4().hex
        self.parts: list[RefitReport] = []
        self.report: RefitReport | None = None
        self.open = False
        self._segments = 0
        self._keep: list[Outgoing] = []  # senders whose buffers the engine may still read (until the end)
        self._t0 = 0.0

    # ---------------------------------------------------------------------------------------------- phases
    def begin(self) -> "RefitSession":
        if self.open or self.report is not None:
            raise P.RefitError("this refit session was already begun", kind="validation")
        self.open = True
        self._t0 = time.perf_counter()
        mixed.poison(self.tgt.front, mixed.MixedWeights(_SESSION_STATE, (), "session"))
        return self

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> RefitReport:
        """Validate and write one part (no version bump). Raises :class:`RefitError` if it was refused or
        failed (the session stays open: abort it, or push a corrected part)."""
        if not self.open:
            raise P.RefitError("push() outside an open session: call begin() (or use `with refit_session(...)`)",
                               kind="validation")
        schema = schema_for(self.tgt)
        out_ = Outgoing(self.tgt, named_tensors, self.opts, schema, txid=self.txid, session=True,
                        first_segment=self._segments)
        try:
            out_.send()
            if out_.refused is not None:
                return out_.report(out_.refused, raise_on_error=True)
            if out_.sender is not None:
                self._segments += out_.sender.segments
            t2 = time.perf_counter()
            out = self._drive(C.coordinate_part(out_.req))
            out_.stages["engine"] = time.perf_counter() - t2
            rep = out_.report(out, raise_on_error=False)
        finally:
            self._keep.append(out_)
        self.parts.append(rep)
        if not rep.ok:
            raise P.RefitError(f"part {len(self.parts)} of the session not written ({rep.state}): {rep.message}",
                               kind=out.get("kind", "commit"), state=rep.state, problems=out.get("problems", []),
                               report=rep)
        return rep

    def commit(self) -> RefitReport:
        """Finish the update: the post-write checks, the layerwise reload's close, one version bump."""
        if not self.open:
            raise P.RefitError("commit() without an open session", kind="validation")
        if not self.parts:
            self.abort()
            raise P.RefitError("the session pushed no part: nothing to commit", kind="validation")
        out = self._drive(C.coordinate_finish(self.txid, self.opts.version, self.opts.inflight))
        return self._end(out, raise_on_error=True)

    def abort(self) -> RefitReport:
        """End the session without committing: ``rollback`` restores the weights from before it; without a
        backup, written parts leave ``mixed``."""
        if not self.open:
            raise P.RefitError("abort() without an open session", kind="validation")
        if not self.parts:
            out = {"ok": True, "state": "unchanged", "workers": []}
            self._drive(C.coordinate_abort(self.txid))
        else:
            out = self._drive(C.coordinate_abort(self.txid))
        return self._end(out, raise_on_error=False)

    # ---------------------------------------------------------------------------------------------- helpers
    def _drive(self, gen) -> dict[str, Any]:
        try:
            return C.run_sync(gen, self.tgt.rpc)
        except Exception as e:  # noqa: BLE001 - an RPC raised: the engine core refused, or the engine died

            err = rpc_error_to_refit(e, "refit session")
            return {"ok": False, "state": "unchanged" if not self.parts else "writing", "kind": err.kind,
                    "message": str(err), "problems": []}

    def _end(self, out: dict[str, Any], raise_on_error: bool) -> RefitReport:
        self.open = False
        front = self.tgt.front
        if mixed.poisoned(front) is not None and mixed.poisoned(front).source == "session":
            mixed.clear(front)
        C.finish(front, out)
        for o in self._keep:
            o.close()
        self._keep = []
        nbytes = sum(p.bytes for p in self.parts)
        n = sum(p.tensors for p in self.parts)
        rep = build_report(out, transport=self.parts[0].transport if self.parts else self.opts.transport,
                           mode=self.opts.mode, nbytes=nbytes, n=n, seconds=time.perf_counter() - self._t0,
                           stages={"parts": float(len(self.parts))}, host_extra=0)
        if rep.guarantee is None and self.parts:
            rep.guarantee, rep.path, rep.backup = self.parts[-1].guarantee, self.parts[-1].path, self.parts[-1].backup
        self.report = rep
        if not rep.ok and raise_on_error:
            raise P.RefitError(f"weight update session not committed ({rep.state}): {out.get('message')}",
                               kind=out.get("kind", "commit"), state=rep.state, problems=out.get("problems", []),
                               report=rep)
        return rep

    def __enter__(self) -> "RefitSession":
        return self.begin()

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.open:
            return False
        if exc_type is not None:
            self.abort()
            return False
        self.commit()
        return False


def refit_session(target: Any, **kw) -> RefitSession:
    """A multi-call update of ``target`` (see module doc); ``kw`` as :func:`~vllm_rlpatch.refit.push_weights`
    (``transport``, ``guarantee``, ``mode``, ``inflight``, ``version``, ``allow_cast``, ``bucket_bytes``,
    ``verify``, ``timeout_s``, ``backup``)."""
    return RefitSession(target, **kw)
