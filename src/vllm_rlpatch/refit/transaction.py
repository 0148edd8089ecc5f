"""The engine side of a refit: one worker's transaction, run through the ``rlpatch_refit_*`` worker methods.

An update is one or more *parts* (one for ``push_weights``; several for a :func:`~vllm_rlpatch.refit.refit_session`)
and ends in one commit with one version bump.

``prepare(request)`` (:mod:`.prepare`, its steps in order)
    validates the part's metadata against the model's schema before any byte is read; opens the transport
    (:mod:`.sources`); checks the bytes (:mod:`.source_checks`: the sender's digests, NaN/inf counted in the
    same pass as the checksum; bytes that crossed a network are digested again here); decides the path and the
    guarantee (below, :mod:`.guarantee`) and reserves the backup (:class:`~.backup.BackupPool`). Nothing is
    written. The request arrives as a dict and is read once into a :class:`~.protocol.RefitRequest`.
``commit(txid, version)`` (:mod:`.commit`)
    writes the part (backing it up first for ``rollback``) and checks what it wrote; on the final part fires
    the weight-update event with the new version. Any failure: ``rollback`` restores every backed-up byte and
    verifies them (:mod:`.undo`); ``validate-then-write`` and ``direct`` leave ``state="mixed"`` (the engine
    refuses to generate until a good update lands).
``abort(txid)`` (:mod:`.undo`)
    drops a prepared update, or rolls back one that was written (another rank failed, or the session ended
    with an exception). An update this worker does not hold is answered ``absent`` (idempotent).

An update of several parts (a session) is one :class:`~.tx_state.Transaction`; what a worker keeps between
its RPCs (open transactions, fenced ids, the copy plan, the backup arenas, update templates) is a
:class:`~.worker_state.WorkerState`, which :class:`WorkerRefit` extends with the RPC methods.

Paths: ``plan`` (a verified copy plan, :mod:`.worker_plan`: plain copies into the parameters' windows,
:mod:`.write_plan`) or ``layerwise`` (vLLM's own layerwise reload, which re-runs each layer's post-processing:
CPU repacking, quantization; :mod:`.write_layerwise`).

Guarantees (``request["guarantee"]``, named in every result):

``rollback``
    a backup of everything the update writes is held until it commits (windows on the plan path; the whole
    model state on the layerwise path, whose post-processing re-creates tensors), in a reused arena of pinned
    host or device memory (:mod:`.backup`). Any failure restores it; the restored weights are compared with the
    backup.
``validate-then-write``
    no backup. Before the first write: the metadata, the sources' digests and finite values, and on the plan
    path that every source is resident and contiguous (the copy allocates nothing), castable in the copy, not
    overlapping a destination, and every destination still the model's live storage; every rank prepares before
    any rank writes. After the write, a mandatory check: the destination windows' digests against the sources'
    (plan path), or every layer complete and processed exactly once (layerwise path, whose post-processing
    leaves nothing to compare byte for byte). A failure after the first write leaves ``mixed``.
``auto`` (default)
    ``rollback`` when a bounded backup fits (on the device for the plan path, in the host arena within its cap
    for the layerwise path); otherwise ``validate-then-write`` on the plan path; otherwise refused before
    writing, with the sizes, offering ``mode="direct"`` or an explicit ``guarantee="validate-then-write"``.

``mode="direct"`` is the guarantee ``none``: written straight in (streamed for ``dist``), checked after,
``mixed`` on failure.

Results are plain dicts (``ok``, ``state``, ``kind``, ``problems``, ``guarantee``, ``path``, ``backup``,
``stages`` seconds, ``checks``...); expected failures are reported, never raised.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

from vllm_rlpatch import envs
from vllm_rlpatch.refit import commit as C
from vllm_rlpatch.refit import prepare as PR
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit import undo
from vllm_rlpatch.refit.source import Source
from vllm_rlpatch.refit.sources import make_source, source_class
from vllm_rlpatch.refit.tx_state import FAULTS, InjectedFault, Transaction, now
from vllm_rlpatch.refit.worker_plan import engine_layout
from vllm_rlpatch.refit.worker_state import WorkerState

__all__ = ["InjectedFault", "Transaction", "WorkerRefit", "for_worker", "make_source", "weights_fingerprint"]

logger = logging.getLogger("vllm.rlpatch")


class WorkerRefit(WorkerState):
    """Per-worker refit: the ``rlpatch_refit_*`` worker methods' side of the protocol."""

    def arm_fault(self, where: str) -> dict[str, Any]:
        """Testing only (``VLLM_RLPATCH_FAULT_INJECTION=1``): the next transaction fails at ``where``
        (``prepare``, ``after_first_write``; ``@rankN`` for one rank)."""
        if not envs.FAULT_INJECTION.get():
            return {"ok": False, "message": "fault injection is disabled in this engine "
                                            "(VLLM_RLPATCH_FAULT_INJECTION=1 enables it, for tests)"}
        if where.split("@")[0] not in FAULTS:
            return {"ok": False, "message": f"unknown fault {where!r}: prepare or after_first_write (@rankN)"}
        self.armed_fault = where
        return {"ok": True, "armed": where, "rank": self.rank}

    def describe(self) -> dict[str, Any]:
        s = self.schema()
        vc = getattr(self.worker, "vllm_config", None)
        return {"schema": s.as_dict(), "device": str(self.device), "rank": self.rank, "pid": os.getpid(),
                "quantization": getattr(self.worker.model_config, "quantization", None),
                "lora": getattr(self.worker, "lora_config", None) is not None
                or getattr(vc, "lora_config", None) is not None,
                "model_class": type(self.model).__name__, "plan": self.plans.note}

    # --------------------------------------------------------------- prepare, commit, abort
    def prepare(self, request: dict[str, Any]) -> dict[str, Any]:
        """Prepare one part of an update (:mod:`.prepare`); nothing is written."""
        req = P.RefitRequest.from_wire(request)
        out, made = PR.prepare(self, req)
        cls = source_class(req.transport)
        if not out.get("ok") and cls is not None and cls.collective:
            self._drain(req, made, out)
        return out

    def _drain(self, req: P.RefitRequest, src: Source | None, out: dict[str, Any]) -> None:
        """A refused collective update (a broadcast): this rank still takes part in the rest of it (joining the
        group if it refused before it did), so the sender and the other receivers - this engine's other
        workers, every other engine of a fleet - are not left waiting for it until the group's timeout."""
        t1 = now()
        try:
            if src is None:
                src = make_source(req, [], self.worker, self.device)
            n = src.drain()
        except Exception as e:  # noqa: BLE001 - the refusal stands; the group fails on its timeout
            logger.warning("vllm-rlpatch: could not drain the refused %s update: %s: %s", req.transport.get("kind"),
                           type(e).__name__, e)
            out["drain_error"] = f"{type(e).__name__}: {e}"
            return
        if n:
            out.setdefault("stages", {})["drain"] = now() - t1

    def commit(self, txid: str, version: int | None = None, release: bool = True,
               request: dict[str, Any] | None = None, final: bool = True) -> dict[str, Any]:
        """Write the prepared part; on the ``final`` part, finish the update (one version bump). ``request``:
        prepare and commit in one RPC (a single worker: nothing to agree on across ranks)."""
        if request is not None:
            prep = self.prepare(request)
            if not prep.get("ok"):
                if not request.get("session"):
                    self.drop(request["txid"])
                return prep
        return C.commit(self, txid, version, release, final, live_proven=request is not None)

    def abort(self, txid: str) -> dict[str, Any]:
        """Drop a prepared update, or undo a written one; ``absent`` when this worker holds no such update."""
        return undo.abort(self, txid)

    def release(self, txid: str) -> dict[str, Any]:
        self.drop(txid)
        return {"ok": True}

    # --------------------------------------------------------------- layout, fingerprint
    def layout(self) -> dict[str, Any]:
        """The engine layout a zero-pack trainer buffer uses (needs a verified copy plan)."""
        plan = self.plans.verified
        if plan is None:
            return {"ok": False, "message": f"no verified copy plan in this worker ({self.plans.note})"}
        return engine_layout(plan)

    def fingerprint(self) -> dict[str, Any]:
        fp, per = weights_fingerprint(self.model)
        return {"fingerprint": fp, "tensors": len(per), "rank": self.rank}


def weights_fingerprint(model) -> tuple[str, dict[str, str]]:
    """One digest of every parameter and buffer of ``model`` (by name), and each one's."""
    named = []
    seen = set()
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for n, t in tensors:
        if id(t) in seen or t.is_meta:
            continue
        seen.add(id(t))
        named.append((n, t))
    named.sort(key=lambda x: x[0])
    fps = P.fingerprints([t for _, t in named])
    per = dict(zip([n for n, _ in named], fps))
    return P.combine(f"{n}={f}" for n, f in per.items()), per


_REFITS: "weakref.WeakKeyDictionary[Any, WorkerRefit]" = weakref.WeakKeyDictionary()
_REFITS_LOCK = threading.RLock()


def for_worker(worker: Any) -> WorkerRefit:
    """The worker's transaction object (one per worker), which the ``rlpatch_refit_*`` worker methods call."""
    with _REFITS_LOCK:
        r = _REFITS.get(worker)
        if r is None:
            r = _REFITS[worker] = WorkerRefit(worker)
        return r
