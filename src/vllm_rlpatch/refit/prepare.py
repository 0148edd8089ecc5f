"""Preparing one part of an update in a worker: every check that can be made before the first byte is written.

:func:`prepare` runs :data:`STEPS` in order over one :class:`Prep`; the first step that refuses ends it (a
result dict), and an exception in any step is a structured failure too (its ``kind`` from its type:
``RefitError.kind``, an injected test fault, else ``validation``). Nothing is written. In order:

1. :func:`known_guarantee` - the guarantee asked for is one of ``GUARANTEES``;
2. :func:`no_open_vllm_update` - vLLM's own weight update is not open on this engine;
3. :func:`read_metadata` - the tensors' records (an update template's own, with this update's digests), checked
   against the model's schema and against the parts already written;
4. :func:`newer_version` - the version asked for is above the engine's;
5. :func:`injected_fault` - a test's ``prepare`` fault;
6. :func:`open_source` - the transport's source (:mod:`.sources`), or the template's; a request that registers
   a template keeps its source open;
7. :func:`name_sets` - the part's names (kept by an update template);
8. :func:`choose_path` - ``plan`` when the verified copy plan covers the part and is live, else ``layerwise``;
9. :func:`receive` - the bytes, unless they are written as they arrive (``direct`` over a streaming source);
10. :func:`check_received` - digests, NaN/inf, tied tensors (:mod:`.source_checks`);
11. :func:`decide_guarantee` - the first part decides the guarantee and reserves its backup (:mod:`.guarantee`);
12. :func:`grow_session_backup` - a later part of a ``rollback`` session makes room for its own backup;
13. :func:`preconditions` - ``validate-then-write`` on the plan path proves the copy cannot fail part-way.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from vllm_rlpatch.hooks import layerwise, weights
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit import guarantee
from vllm_rlpatch.refit.source import Source
from vllm_rlpatch.refit.source_checks import check_sources
from vllm_rlpatch.refit.sources import make_source, template_key
from vllm_rlpatch.refit.templates import Template
from vllm_rlpatch.refit.tx_state import InjectedFault, Part, Transaction, error_kind, failure, now
from vllm_rlpatch.refit.worker_state import WorkerState

logger = logging.getLogger("vllm.rlpatch")


@dataclasses.dataclass(eq=False)
class Prep:
    """One ``prepare`` call: what the steps read and what they leave for the next ones."""

    ws: WorkerState
    req: P.RefitRequest
    tx: Transaction
    new: bool  # the update's first part
    t0: float
    deciding: bool = False  # this part decides the guarantee (none decided yet)
    schema: P.Schema | None = None
    reused: Template | None = None  # the update template this request names
    template: Template | None = None  # ``reused``, or the one this request registers (their caches)
    metas: list[P.TensorMeta] = dataclasses.field(default_factory=list)
    made: Source | None = None  # the source made for this request (not a template's): drained if refused
    source: Source | None = None
    t_open: float = 0.0
    part: Part | None = None
    live_now: bool = False  # the plan's liveness proven in this call

    def refuse(self, result: dict[str, Any]) -> dict[str, Any]:
        """A refusal after the bytes were received: the source is closed (a template's stays open)."""
        if not self.source.pinned:
            self.source.close()
        return result


Step = Callable[[Prep], "dict[str, Any] | None"]


def known_guarantee(c: Prep) -> dict[str, Any] | None:
    if c.deciding and c.req.guarantee not in P.GUARANTEES:
        return c.tx.fail("validation", f"guarantee={c.req.guarantee!r}: use one of {', '.join(P.GUARANTEES)}",
                         state="unchanged")
    return None


def no_open_vllm_update(c: Prep) -> dict[str, Any] | None:
    if c.new and layerwise.reload_active(c.ws.model):
        # vLLM's own update (start_weight_update ... finish_weight_update, or a reload that did not finish)
        # holds the layers on the meta device: its finish would overwrite whatever we write
        return c.tx.fail("refused", "vLLM's own weight update is open on this engine (its layers are being "
                         "reloaded: start_weight_update without finish_weight_update, or a reload that did not "
                         "finish); finish or abort it before push_weights", state="unchanged")
    return None


def read_metadata(c: Prep) -> dict[str, Any] | None:
    c.schema = c.ws.schema()
    key = template_key(c.req.transport)
    if key is not None:
        # the same tensors as an earlier update (a trainer updates its tensors in place): metadata checked
        # and IPC handles opened then; only this update's digests travel
        c.reused = c.ws.templates.get(key)
        if c.reused is None:
            return c.tx.fail(P.UNKNOWN_TEMPLATE, "unknown update template (the engine restarted?): send the full request",
                             state="unchanged")
        c.metas = c.reused.metas  # the template's own records, this update's digests written into them
        fps = c.req.fingerprints or [None] * len(c.metas)
        nfs = c.req.nonfinite or [None] * len(c.metas)
        if len(fps) != len(c.metas) or len(nfs) != len(c.metas):
            return c.tx.fail("validation", f"the update template has {len(c.metas)} tensors, the request "
                             f"{len(fps)} digests", state="unchanged")
        for m, fp, nf in zip(c.metas, fps, nfs):
            m.fingerprint, m.nonfinite = fp, nf
        probs = []
    else:
        c.metas = [P.TensorMeta.from_dict(d) for d in c.req.tensors]
        probs = P.validate_metadata(c.metas, c.schema, partial=c.tx.subset, allow_cast=c.tx.request.allow_cast)
    again = sorted({m.name for m in c.metas} & c.tx.names_done)
    if again:
        probs.append(P.problem("duplicate", again[0], f"{again[0]} was already sent in an earlier part of this "
                                                      "update"))
    c.tx.check("metadata")
    c.tx.mark("metadata")
    return c.tx.fail("validation", P.summarize(probs), probs) if probs else None


def newer_version(c: Prep) -> dict[str, Any] | None:
    if c.new and c.req.version is not None:
        cur = weights.weight_version(c.ws.worker)
        if int(c.req.version) <= cur:
            return c.tx.fail("validation", f"version {c.req.version} is not greater than the engine's current "
                             f"weight version {cur}", state="unchanged")
    return None


def injected_fault(c: Prep) -> None:
    c.tx.raise_fault("prepare", c.ws.rank)


def open_source(c: Prep) -> None:
    c.t_open = now()
    if c.reused is not None:
        c.source = c.reused.source
        c.source.metas = c.metas
        c.template = c.reused
        return
    c.source = c.made = make_source(c.req, c.metas, c.ws.worker, c.ws.device)
    c.source.open()
    if c.req.template:
        c.template = c.ws.templates.register(c.req.template, c.metas, c.source)


def name_sets(c: Prep) -> None:
    cache = c.template  # an update template keeps its name sets (an 8B model's 291 names, on every update)
    if cache is not None and cache.plan_names is not None:
        all_names, names = cache.all_names, cache.plan_names
    else:
        all_names = frozenset(m.name for m in c.metas)
        names = frozenset(n for n in all_names if n not in c.schema.aliases)
        if cache is not None:
            cache.all_names, cache.plan_names = all_names, names
    c.part = Part(c.metas, c.source, all_names, names, c.template)
    c.tx.stage("open", now() - c.t_open)
    c.tx.mark("opened")


def choose_path(c: Prep) -> dict[str, Any] | None:
    tx, names = c.tx, c.part.plan_names
    if tx.path is None:
        tx.path = "plan" if c.ws.plans.usable(names, tx.subset) else "layerwise"
        c.live_now = tx.path == "plan"
    elif tx.path == "plan" and not c.ws.plans.usable(names, tx.subset):
        return tx.fail("validation", "this part has tensors the copy plan does not cover (an earlier part of the "
                       "session took the plan path)")
    tx.mark("path")
    return None


def receive(c: Prep) -> None:
    # streamed (direct over a streaming source): received in commit, as it is written; a fleet's dist source
    # does not stream: every engine takes part in the one broadcast while they all prepare
    if c.tx.request.mode == "direct" and c.source.streams():
        return
    t1 = now()
    c.source.receive_all()
    c.part.tensors = {m.name: t for m, t in c.source.tensors()}
    c.tx.stage("receive", now() - t1)
    c.tx.mark("received")


def check_received(c: Prep) -> dict[str, Any] | None:
    if c.part.tensors is None:  # streamed: the sender counted; nothing here to read twice
        return None
    probs = check_sources(c.tx, c.part, c.schema.aliases)
    if not probs:
        return None
    kind = "transport" if any(p["kind"] == "fingerprint" for p in probs) else "validation"
    return c.refuse(c.tx.fail(kind, P.summarize(probs), probs))


def decide_guarantee(c: Prep) -> dict[str, Any] | None:
    if not c.deciding:
        return None
    refused = guarantee.decide(c.ws, c.tx, c.req, c.part)
    return c.refuse(refused) if refused is not None else None


def grow_session_backup(c: Prep) -> dict[str, Any] | None:
    if c.deciding:
        return None
    refused = guarantee.room_for_part(c.ws, c.tx, c.part)
    return c.refuse(refused) if refused is not None else None


def preconditions(c: Prep) -> dict[str, Any] | None:
    tx, plan = c.tx, c.ws.plans.plan
    if tx.guarantee != "validate-then-write" or tx.path != "plan":
        return None
    entries = plan.entries_for(c.part.plan_names)
    static_key = (plan, tx.request.allow_cast, len(entries))
    if c.reused is not None and c.reused.static_ok == static_key:
        # the sources are the template's: only liveness can change (proven just above, or now)
        why = None if c.live_now else plan.live()
    else:
        why = plan.preconditions(entries, c.part.tensors or {}, tx.request.allow_cast)
        if why is None and c.reused is not None:
            c.reused.static_ok = static_key
    if why is not None:
        return c.refuse(tx.fail("validation", f"validate-then-write: {why}"))
    tx.check("preconditions")
    return None


STEPS: tuple[Step, ...] = (known_guarantee, no_open_vllm_update, read_metadata, newer_version, injected_fault,
                           open_source, name_sets, choose_path, receive, check_received, decide_guarantee,
                           grow_session_backup, preconditions)


def prepare(ws: WorkerState, req: P.RefitRequest) -> tuple[dict[str, Any], Source | None]:
    """Prepare one part: (the result, the source made for this request, if any)."""
    t0 = now()
    if req.txid in ws.aborted:
        return failure("refused", "unchanged", f"update {req.txid!r} was aborted: it cannot be prepared again", {},
                       []), None
    tx = ws.txs.get(req.txid)
    new = tx is None
    if new:
        tx = Transaction(req, fault=ws.armed_fault)
        ws.armed_fault = None
    elif tx.pending is not None:
        return failure("validation", "unchanged", f"part of {req.txid!r} prepared twice", {}, []), None
    tx.marks.append(("prepare", t0))
    c = Prep(ws, req, tx, new, t0, deciding=tx.guarantee is None)
    return _run(c), c.made


def _run(c: Prep) -> dict[str, Any]:
    tx = c.tx
    try:
        for step in STEPS:
            refused = step(c)
            if refused is not None:
                return refused
    except P.RefitError as e:
        return tx.fail(e.kind, str(e), e.problems)
    except InjectedFault as e:
        return tx.fail("fault", str(e))
    except Exception as e:  # noqa: BLE001 - an unexpected failure is still a structured failure
        logger.exception("vllm-rlpatch: refit prepare failed")
        return tx.fail(error_kind(e, "validation"), f"{type(e).__name__}: {e}")
    tx.pending = c.part
    c.ws.txs[c.req.txid] = tx
    tx.mark("prepared")
    tx.stage("prepare", now() - c.t0)
    # the version this rank holds now: a fleet picks max + 1 from these answers (no RPC of its own)
    return tx.result(c.ws.rank, c.ws.plans.note, ok=True, state=tx.state_now(),
                     weight_version=weights.weight_version(c.ws.worker))
