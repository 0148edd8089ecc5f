"""Committing one part of an update in a worker: the write, the post-write checks, the outcome.

:func:`commit` admits the update (prepared here, not aborted, within its deadline), writes the pending part
(:class:`~vllm_rlpatch.refit.write_plan.PlanWrite` or :func:`~vllm_rlpatch.refit.write_layerwise.write_layerwise`)
and, on the ``final`` part, finishes it (a session's reload closed; :func:`finish`: ``direct``'s after-write
check, the layer-completeness check, the copy plan captured after a complete layerwise update), then fires the
weight-update event once with the new version. Any failure goes to :func:`failed`, which undoes what it can
(:func:`~vllm_rlpatch.refit.undo.undo`) and reports what the engine holds.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from vllm_rlpatch.hooks import mixed, wake, weights
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.source_checks import check_sources
from vllm_rlpatch.refit.tx_state import Transaction, error_kind, failure, now
from vllm_rlpatch.refit.undo import close_open_reload, undo
from vllm_rlpatch.refit.worker_state import WorkerState
from vllm_rlpatch.refit.write_layerwise import finish_layerwise, write_layerwise
from vllm_rlpatch.refit.write_plan import PlanWrite

logger = logging.getLogger("vllm.rlpatch")


def admit(ws: WorkerState, txid: str) -> Transaction | dict[str, Any]:
    """The prepared update ``txid``, or the refusal to commit it (unknown, aborted, past its deadline)."""
    tx = ws.txs.get(txid)
    if tx is None:
        if txid in ws.aborted:
            return failure("refused", "unchanged", f"update {txid!r} was aborted: not written", {}, [])
        return failure("validation", "unchanged", f"no prepared update {txid!r} in this worker", {}, [])
    deadline = tx.request.deadline
    if deadline is not None and not tx.written and time.time() > deadline:
        late = time.time() - deadline
        ws.drop(txid)
        ws.aborted.append(txid)
        return failure("refused", "unchanged", f"update {txid!r} passed its deadline {late:.1f} s ago (timeout_s): "
                       "not written", {}, [])
    return tx


def commit(ws: WorkerState, txid: str, version: int | None, release: bool, final: bool,
           live_proven: bool) -> dict[str, Any]:
    """Write the prepared part; on the ``final`` part, finish the update (one version bump). ``live_proven``:
    prepared in this very call (one worker: one RPC), so the plan's liveness was proven a moment ago."""
    tx = admit(ws, txid)
    if isinstance(tx, dict):
        return tx
    t0 = now()
    tx.marks.append(("commit", t0))
    dev = ws.device
    base_alloc = _reset_peak(dev) if dev.type == "cuda" else 0
    error: BaseException | None = None
    findings = None
    try:
        findings = write(ws, tx, final, live_proven)
        if final and tx.path == "layerwise" and tx.reload_open:
            findings = finish_layerwise(ws, tx)
        if final:
            finish(ws, tx)
    except BaseException as e:  # noqa: BLE001 - everything below decides what the engine holds now
        error = e
    tx.stage("commit", now() - t0)
    tx.mark("written")
    if dev.type == "cuda":
        tx.extra_device = max(tx.extra_device, _peak(dev) - base_alloc)
    if error is not None:
        return failed(ws, tx, error, findings)
    if not final:
        return tx.result(ws.rank, ws.plans.note, ok=True, state="writing",
                         findings=findings.as_dict() if findings else None)
    return _committed(ws, tx, version, release, findings)


def write(ws: WorkerState, tx: Transaction, final: bool, live_proven: bool):
    """Write the pending part, if any; the layerwise findings (None on the plan path)."""
    part = tx.pending
    if part is None:
        return None
    tx.pending = None
    findings = None
    if tx.path == "plan":
        PlanWrite(ws, tx, part).run(live_proven)
    else:
        findings = write_layerwise(ws, tx, part)
    tx.parts.append(part)
    tx.names_done |= part.names
    return findings


def finish(ws: WorkerState, tx: Transaction) -> None:
    """The final part's checks and follow-ups (after a session's reload finished)."""
    req = tx.request
    if req.mode == "direct" and req.verify:
        check_after_direct(ws, tx)
    if tx.path == "layerwise" and tx.guarantee == "validate-then-write":
        tx.post_check = "layer_completeness"
        tx.check("layers_complete")
    if tx.path == "layerwise" and ws.plans.plan is None and not tx.subset and tx.guarantee != "none":
        t1 = now()
        ws.plans.capture(ws.worker, ws.model, ws.schema().aliases, tx, tx.parts[-1] if tx.parts else None)
        tx.stage("plan_capture", now() - t1)


def check_after_direct(ws: WorkerState, tx: Transaction) -> None:
    """``direct``: the bytes were written unchecked; check them now (a failure leaves ``mixed``)."""
    t1 = now()
    probs = []
    aliases = ws.schema().aliases
    for part in tx.parts:
        if part.tensors is None:
            continue  # streamed: checked bucket by bucket on arrival is not possible; the sender counted
        if not part.expected:
            probs += check_sources(tx, part, aliases)
    tx.stage("check_after", now() - t1)
    if probs:
        raise P.RefitError(P.summarize(probs), kind="validation", problems=probs)


def _committed(ws: WorkerState, tx: Transaction, version: int | None, release: bool, findings) -> dict[str, Any]:
    tx.committed = True
    mixed.clear_worker()
    if not tx.request.partial:
        wake.set_discarded(ws.worker, False)  # valid weights again
    # logged by the caller and the engine core (a log line costs the update ~50 us here)
    ev = weights.fire(ws.worker, "rlpatch_refit", "worker", version=version, log_level=logging.DEBUG)
    tx.mark("fired")
    out = tx.result(ws.rank, ws.plans.note, ok=True, state="committed", version=ev.version,
                    findings=findings.as_dict() if findings else None)
    if release:
        ws.drop(tx.txid)
    return out


def failed(ws: WorkerState, tx: Transaction, error: BaseException, findings) -> dict[str, Any]:
    """A failure while writing: undo what can be undone, report what the engine holds (``kind`` by the error's
    type: :func:`~vllm_rlpatch.refit.tx_state.error_kind`)."""
    if isinstance(error, P.RefitError):
        kind, msg, probs = error.kind, str(error), error.problems
    else:
        kind, msg, probs = error_kind(error, "commit"), f"{type(error).__name__}: {error}", []
    if isinstance(error, mixed.MixedWeightsError):
        msg = error.mixed.reason
    close_open_reload(ws, tx)
    state, note = undo(ws, tx)
    if note:
        msg = f"{msg} ({note})"
    if state == "mixed":
        m = mixed.MixedWeights(msg, tuple(getattr(findings, "half", ()) or ()), "refit")
        mixed.set_worker(m)
        msg = m.message
    logger.error("vllm-rlpatch: refit %s failed (guarantee %s, %s path): %s -> engine state %s", tx.txid,
                 tx.guarantee, tx.path, msg, state)
    out = failure(kind, state, msg, tx.stages, tx.checks, probs, guarantee=tx.guarantee, path=tx.path,
                  backup=tx.backup_report(), findings=findings.as_dict() if findings else None, rank=ws.rank)
    ws.drop(tx.txid)
    return out


def _reset_peak(dev: torch.device) -> int:
    """Reset the allocator's peak and return what is allocated now. The allocator's counters are read directly
    (``torch.cuda.memory_allocated`` flattens every statistic into a dict first: ~1 ms per update)."""
    try:
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        torch._C._cuda_resetPeakMemoryStats(idx)
        return int(torch._C._cuda_memoryStats(idx)["allocated_bytes"]["all"]["current"])
    except Exception:  # noqa: BLE001 - another torch: the public calls
        torch.cuda.reset_peak_memory_stats(dev)
        return torch.cuda.memory_allocated(dev)


def _peak(dev: torch.device) -> int:
    try:
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        return int(torch._C._cuda_memoryStats(idx)["allocated_bytes"]["all"]["peak"])
    except Exception:  # noqa: BLE001
        return torch.cuda.max_memory_allocated(dev)
